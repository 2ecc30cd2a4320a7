"""The embedded default pipeline: text encoder, DiT, decoder, and an Euler flow-matching loop.

:class:`DemoPipeline` declares its topology the way a served model does (the
``SupportsComponentDiscovery`` lists and an ``_offload_plan``), so every strategy dlo offers
runs on it unchanged. Build one with :func:`~dlo.models.build.build_pipeline`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from dlo.models.decoder import Decoder
from dlo.models.dit import DiT
from dlo.models.presets import Preset, get_preset
from dlo.models.text_encoder import TextEncoder
from dlo.plan.declarations import OffloadPlan


class DemoPipeline(nn.Module):
    """Text-to-image (or video) diffusion pipeline with ``text_encoder``, ``transformer``, ``vae``.

    Args:
        preset: the sizes of every component.

    The DiT's ``blocks`` and the text encoder's ``layers`` are the streamed rings; the text
    encoder is declared replicated (every rank holds its whole weights), so its ring may use
    the AllGather transfer too.

    Example:
        >>> pipe = build_pipeline("tiny")
        >>> ids, latents = make_inputs("tiny", seed=0)
        >>> pipe.generate(ids, latents, steps=4).shape
        torch.Size([1, 3, 32, 32])
    """

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = ["vae"]
    _resident_modules: ClassVar[list[str]] = []
    _offload_plan: ClassVar[OffloadPlan] = OffloadPlan(
        block_attrs={"transformer": ("blocks",)},
        encoder_block_attrs={"text_encoder": ("layers",)},
        encoder_dlo_weight_replication=("text_encoder",),
    )

    def __init__(self, preset: Preset) -> None:
        super().__init__()
        self.preset = preset
        self.text_encoder = TextEncoder(preset)
        self.transformer = DiT(preset)
        self.vae = Decoder(preset)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` to text features ``[B, T, text_dim]``."""
        return self.text_encoder(ids)

    def denoise(
        self,
        latents: torch.Tensor,
        text: torch.Tensor,
        steps: int,
        on_step: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Integrate the flow from noise (``t = 1``) to data (``t = 0``) with Euler steps.

        Calls ``self.transformer`` exactly once per step, at timesteps ``1000 * t`` for ``t``
        in ``linspace(1, 0, steps + 1)[:-1]``. The state is accumulated in float32 and each
        call sees it in the dtype of ``latents``.

        Args:
            latents: noise ``[B, tokens, latent_channels]``.
            text: ``[B, T, text_dim]`` from :meth:`encode`.
            steps: number of transformer calls, at least 1.
            on_step: called with the step index after each transformer call is enqueued.

        Returns:
            Denoised latents, same shape and dtype as ``latents``.

        Raises:
            ValueError: ``steps < 1``.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        # the schedule is Python floats: the loop never reads a tensor back to the host
        sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
        batch = latents.shape[0]
        x = latents.float()
        for i, (sigma, sigma_next) in enumerate(itertools.pairwise(sigmas)):
            timestep = torch.full(
                (batch,), 1000.0 * sigma, device=latents.device, dtype=torch.float32
            )
            velocity = self.transformer(x.to(latents.dtype), timestep, text)
            x = x + (sigma_next - sigma) * velocity.float()
            if on_step is not None:
                on_step(i)
        return x.to(latents.dtype)

    def decode(self, latents: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """Latent tokens to RGB; see :meth:`Decoder.forward` for ``grid`` and the shapes."""
        return self.vae(latents, grid)

    def generate(
        self,
        ids: torch.Tensor,
        latents: torch.Tensor,
        steps: int,
        grid: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """``decode(denoise(latents, encode(ids), steps))`` under ``torch.inference_mode()``."""
        with torch.inference_mode():
            text = self.encode(ids)
            return self.decode(self.denoise(latents, text, steps), grid)


def make_inputs(
    preset: str | Preset,
    *,
    batch: int = 1,
    tokens: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic inputs for a preset: token ids and initial noise.

    Both are drawn on the CPU from one generator seeded with ``seed`` (so they are the same
    on every device), then moved to ``device``.

    Args:
        preset: a :class:`Preset` or the name of one.
        batch: batch size.
        tokens: latent tokens; default the preset's grid.
        seed: the seed.
        device: where the tensors go.
        dtype: dtype of the latents (ids are int64).

    Returns:
        ``(ids [batch, text_len], latents [batch, tokens, latent_channels])``.

    Raises:
        ValueError: unknown preset, or ``batch``/``tokens`` below 1.
    """
    p = get_preset(preset)
    num_tokens = p.num_tokens if tokens is None else tokens
    if batch < 1 or num_tokens < 1:
        raise ValueError(f"batch and tokens must be >= 1, got batch={batch!r} tokens={tokens!r}")
    generator = torch.Generator("cpu").manual_seed(seed)
    ids = torch.randint(0, p.vocab, (batch, p.text_len), generator=generator)
    latents = torch.randn(batch, num_tokens, p.latent_channels, generator=generator).to(dtype)
    return ids.to(device), latents.to(device)
