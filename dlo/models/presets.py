"""Sizes of the embedded default pipeline, and their parameter and byte counts. Pure.

A :class:`Preset` fixes every dimension of :class:`~dlo.models.pipeline.DemoPipeline` (text
encoder, DiT, decoder). The counts below are computed arithmetically from those integers,
so a planner or a benchmark can size a model (host bytes, slot bytes) without building it;
``tests/pure/test_models.py`` checks them against built models.

[Note: demo presets]
``tiny`` is the test model: five blocks (odd on purpose, so a ring of two slots wraps
unevenly), cross-attention and the Wan-style modulation table, a forward in milliseconds on
a CPU. ``medium`` is the benchmark model: DiT-style (per-block ``Linear(dim, 6 * dim)``
modulation, no cross-attention) at ``dim = 3072``, so one block is ``18 * dim**2`` = 170M
parameters, about 340 MB in bf16, and 24 of them are about 8 GB. ``wan14b-like`` follows the
shapes of Wan2.1-T2V-14B's DiT (40 blocks, ``dim = 5120``, 40 heads, ffn 13824,
cross-attention, modulation table; 14.25B parameters in the DiT), with a small two-layer
text encoder (width 2048) in place of umT5, so the whole pipeline is 14.34B parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODULATIONS = ("linear", "table")
COMPONENT_NAMES = ("text_encoder", "transformer", "vae")


def _linear_numel(in_features: int, out_features: int) -> int:
    return in_features * out_features + out_features


def _self_attention_numel(dim: int) -> int:
    return _linear_numel(dim, 3 * dim) + _linear_numel(dim, dim)


def _cross_attention_numel(dim: int, context_dim: int) -> int:
    return _linear_numel(dim, dim) + _linear_numel(context_dim, 2 * dim) + _linear_numel(dim, dim)


def _mlp_numel(dim: int, ffn_dim: int) -> int:
    return _linear_numel(dim, ffn_dim) + _linear_numel(ffn_dim, dim)


@dataclass(frozen=True)
class Preset:
    """Every dimension of the demo pipeline.

    Example:
        >>> from dlo.models import PRESETS
        >>> PRESETS["medium"].block_nbytes(torch.bfloat16)
        339831040
    """

    name: str
    """Key in :data:`PRESETS` (free text for custom presets)."""
    dim: int
    """Hidden size of the DiT."""
    num_heads: int
    """Attention heads of the DiT; ``dim`` must be a multiple, with an even head dim."""
    ffn_dim: int
    """Hidden size of each DiT block's MLP."""
    num_blocks: int
    """Number of DiT blocks (the streamed ring)."""
    cross_attention: bool
    """Whether DiT blocks cross-attend to the text; without it the mean-pooled text is added
    to the timestep embedding."""
    modulation: str
    """``"linear"``: a per-block ``Linear(dim, 6 * dim)`` on the timestep embedding (DiT);
    ``"table"``: a per-block ``(1, 6, dim)`` table added to a shared projection (Wan)."""
    text_dim: int
    """Hidden size of the text encoder (and of the text the DiT receives)."""
    text_layers: int
    """Number of text encoder blocks."""
    text_heads: int
    """Attention heads of the text encoder."""
    text_ffn: int
    """Hidden size of each text encoder block's MLP."""
    vocab: int
    """Vocabulary size of the text encoder."""
    text_len: int
    """Maximum (and default) number of text tokens."""
    latent_channels: int
    """Channels of one latent token (patch channels already folded in)."""
    grid: tuple[int, ...]
    """Default latent token grid, ``(height, width)`` or ``(frames, height, width)``."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep features."""
    vae_channels: int = 64
    """Channels of the decoder's convolutions."""
    vae_upsamples: int = 2
    """Number of 2x nearest upsampling stages in the decoder."""
    rope_theta: float = 10000.0
    """Base of the rotary frequency table in each DiT block."""

    def __post_init__(self) -> None:
        if self.modulation not in MODULATIONS:
            raise ValueError(
                f"Preset.modulation must be one of {MODULATIONS}, got {self.modulation!r}"
            )
        for field_name, heads, width in (
            ("num_heads", self.num_heads, self.dim),
            ("text_heads", self.text_heads, self.text_dim),
        ):
            if heads < 1 or width % heads != 0:
                raise ValueError(f"Preset.{field_name}={heads} must divide the width {width}")
        if (self.dim // self.num_heads) % 2 != 0:
            raise ValueError(f"Preset head dim {self.dim // self.num_heads} must be even (RoPE)")
        if len(self.grid) not in (2, 3) or min(self.grid) < 1:
            raise ValueError(f"Preset.grid must be (h, w) or (f, h, w), got {self.grid!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def num_tokens(self) -> int:
        """Tokens of the default grid."""
        n = 1
        for g in self.grid:
            n *= g
        return n

    # ------------------------------------------------------------------ counts
    def block_num_params(self) -> int:
        """Parameters of one DiT block."""
        d = self.dim
        n = _self_attention_numel(d) + _mlp_numel(d, self.ffn_dim)
        n += _linear_numel(d, 6 * d) if self.modulation == "linear" else 6 * d
        if self.cross_attention:
            n += self._block_fp32_numel() + _cross_attention_numel(d, d)
        return n

    def _block_fp32_numel(self) -> int:
        # the affine cross-attention norm, kept in float32 whatever the model dtype
        return 2 * self.dim if self.cross_attention else 0

    def block_nbytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of one DiT block's tensors when built in ``dtype``.

        Counts parameters (the fp32 cross-attention norm at 4 bytes an element, the rest at
        ``dtype``'s size) and the non-persistent RoPE frequency buffer (fp32). Alignment
        padding added by :mod:`dlo.plan.layout` is not included.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        fp32 = self._block_fp32_numel()
        buffer_numel = self.head_dim // 2
        return (self.block_num_params() - fp32) * itemsize + (fp32 + buffer_numel) * 4

    def num_params(self, component: str | None = None) -> int:
        """Parameters of the whole pipeline, or of one component.

        Args:
            component: ``None`` for the total, else one of ``"text_encoder"``,
                ``"transformer"``, ``"vae"``.

        Raises:
            ValueError: unknown component.
        """
        counts = {
            "text_encoder": self._text_encoder_numel(),
            "transformer": self._transformer_numel(),
            "vae": self._vae_numel(),
        }
        if component is None:
            return sum(counts.values())
        if component not in counts:
            raise ValueError(
                f"component must be one of {COMPONENT_NAMES} or None, got {component!r}"
            )
        return counts[component]

    def _transformer_numel(self) -> int:
        d, c = self.dim, self.latent_channels
        n = _linear_numel(c, d)  # patch embedding
        n += _linear_numel(self.freq_dim, d) + _linear_numel(d, d)  # timestep MLP
        if self.modulation == "table":
            n += _linear_numel(d, 6 * d)  # shared timestep projection
        if self.text_dim != d:
            n += _linear_numel(self.text_dim, d)  # text projection
        n += self.num_blocks * self.block_num_params()
        n += _linear_numel(d, 2 * d) if self.modulation == "linear" else 2 * d  # head modulation
        n += _linear_numel(d, c)  # head projection
        return n

    def _text_encoder_numel(self) -> int:
        t = self.text_dim
        layer = 4 * t + _self_attention_numel(t) + _mlp_numel(t, self.text_ffn)
        return self.vocab * t + self.text_len * t + self.text_layers * layer + 2 * t

    def _vae_numel(self) -> int:
        ch = self.vae_channels
        conv3 = 9 * ch * ch + ch
        n = 9 * self.latent_channels * ch + ch  # conv_in
        n += self.vae_upsamples * (2 * ch + conv3)  # (GroupNorm, conv) per stage
        n += 2 * ch + 9 * ch * 3 + 3  # norm_out, conv_out
        return n


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="tiny",
            dim=64,
            num_heads=4,
            ffn_dim=256,
            num_blocks=5,
            cross_attention=True,
            modulation="table",
            text_dim=32,
            text_layers=2,
            text_heads=2,
            text_ffn=64,
            vocab=256,
            text_len=16,
            latent_channels=16,
            grid=(8, 8),
            freq_dim=32,
            vae_channels=16,
            vae_upsamples=2,
        ),
        Preset(
            name="medium",
            dim=3072,
            num_heads=24,
            ffn_dim=4 * 3072,
            num_blocks=24,
            cross_attention=False,
            modulation="linear",
            text_dim=1024,
            text_layers=4,
            text_heads=16,
            text_ffn=4096,
            vocab=32000,
            text_len=128,
            latent_channels=64,
            grid=(64, 64),
            vae_channels=128,
            vae_upsamples=3,
        ),
        Preset(
            name="wan14b-like",
            dim=5120,
            num_heads=40,
            ffn_dim=13824,
            num_blocks=40,
            cross_attention=True,
            modulation="table",
            text_dim=2048,
            text_layers=2,
            text_heads=16,
            text_ffn=5120,
            vocab=4096,
            text_len=512,
            latent_channels=64,
            grid=(21, 30, 52),
            vae_channels=128,
            vae_upsamples=3,
        ),
    )
}
"""The named presets; see [Note: demo presets]."""


def get_preset(preset: str | Preset) -> Preset:
    """Return ``preset`` itself, or the named entry of :data:`PRESETS`.

    Raises:
        ValueError: ``preset`` is a string that names no preset.
        TypeError: ``preset`` is neither a string nor a :class:`Preset`.
    """
    if isinstance(preset, Preset):
        return preset
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a str or Preset, got {type(preset).__name__}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[preset]
