"""The demo diffusion transformer: embeddings, a stack of :class:`DiTBlock`, an adaLN head.

Everything outside ``blocks`` (embeddings, the timestep MLP, the head) is small and stays on
the device under layerwise offload; ``blocks`` is the ring, declared through
``_layerwise_offload_blocks_attrs``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dlo.models.blocks import DiTBlock, timestep_features
from dlo.models.presets import Preset


class DiT(nn.Module):
    """Diffusion transformer over latent tokens.

    Args:
        preset: the sizes (``dim``, ``num_heads``, ``ffn_dim``, ``num_blocks``,
            ``cross_attention``, ``modulation``, ``text_dim``, ``latent_channels``,
            ``freq_dim``, ``rope_theta``).

    Without cross-attention the text conditions the model through its mean over tokens,
    projected and added to the timestep embedding.

    Example:
        >>> dit = DiT(PRESETS["tiny"])
        >>> dit(torch.randn(1, 64, 16), torch.tensor([500.0]), torch.randn(1, 16, 32)).shape
        torch.Size([1, 64, 16])
    """

    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, preset: Preset) -> None:
        super().__init__()
        d = preset.dim
        self.dim = d
        self.freq_dim = preset.freq_dim
        self.cross_attention = preset.cross_attention
        self.modulation_kind = preset.modulation
        self.patch_embed = nn.Linear(preset.latent_channels, d)
        self.time_mlp = nn.Sequential(nn.Linear(preset.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_proj: nn.Linear | None = (
            nn.Linear(d, 6 * d) if preset.modulation == "table" else None
        )
        self.text_proj: nn.Module = (
            nn.Linear(preset.text_dim, d) if preset.text_dim != d else nn.Identity()
        )
        self.blocks = nn.ModuleList(
            DiTBlock(
                d,
                preset.num_heads,
                preset.ffn_dim,
                cross_attention=preset.cross_attention,
                text_dim=d,
                modulation=preset.modulation,
                rope_theta=preset.rope_theta,
            )
            for _ in range(preset.num_blocks)
        )
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        if preset.modulation == "linear":
            self.head_modulation: nn.Module | nn.Parameter = nn.Linear(d, 2 * d)
        else:
            self.head_modulation = nn.Parameter(torch.zeros(1, 2, d))
        self.proj_out = nn.Linear(d, preset.latent_channels)

    def compile_repeated_blocks(self, **kwargs: Any) -> None:
        """Compile every block (``block.compile(**kwargs)``), as diffusers' method of this
        name does for its models: regional compilation, one graph per block shape."""
        for block in self.blocks:
            block.compile(**kwargs)

    def forward(
        self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor
    ) -> torch.Tensor:
        """Predict the flow velocity.

        Args:
            latents: ``[B, tokens, latent_channels]``.
            timestep: ``[B]``, in ``[0, 1000]``.
            text: ``[B, text_tokens, text_dim]`` (the text encoder's output).

        Returns:
            ``[B, tokens, latent_channels]`` in the dtype of ``latents``.
        """
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(latents.to(dtype))
        temb = self.time_mlp(timestep_features(timestep, self.freq_dim).to(dtype))
        text = self.text_proj(text.to(dtype))
        context: torch.Tensor | None = text
        if not self.cross_attention:
            temb = temb + text.mean(dim=1)
            context = None
        t_block = (
            temb
            if self.time_proj is None
            else self.time_proj(F.silu(temb)).unflatten(-1, (6, self.dim))
        )
        for block in self.blocks:
            x = block(x, t_block, context)
        if isinstance(self.head_modulation, nn.Parameter):
            shift, scale = (self.head_modulation + temb.unsqueeze(1)).unsqueeze(2).unbind(1)
        else:
            shift, scale = (
                self.head_modulation(F.silu(temb))
                .unflatten(-1, (2, self.dim))
                .unsqueeze(2)
                .unbind(1)
            )
        x = self.norm_out(x) * (1 + scale) + shift
        return self.proj_out(x).to(latents.dtype)
