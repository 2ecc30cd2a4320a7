"""Building blocks of the demo pipeline: attention, MLP, the DiT block and the text block.

The DiT block is the unit dlo streams, so it is built to exercise what a real one holds:
weights in the model dtype, an affine LayerNorm kept in float32 (the cross-attention norm,
as in Wan), and a non-persistent buffer the forward reads (the RoPE frequency table). See
[Note: fp32 tensors] for how :func:`~dlo.models.build.build_pipeline` keeps those float32.

[Note: fp32 tensors]
A module lists in ``_keep_in_fp32`` the names of its own parameters and buffers that stay
float32 whatever dtype the model is built in; the builder honours the list and so must any
code that casts a demo model.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


class FP32LayerNorm(nn.LayerNorm):
    """Affine LayerNorm whose weights and arithmetic stay float32 (see [Note: fp32 tensors])."""

    _keep_in_fp32: ClassVar[tuple[str, ...]] = ("weight", "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(
            x.float(), self.normalized_shape, self.weight, self.bias, self.eps
        ).type_as(x)


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """Rotary frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim // 2``, fp32 on CPU."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return (1.0 / theta**exponent).to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` ``[B, H, N, head_dim]`` by angles given as ``[N, head_dim // 2]``."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs.unbind(-1)
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Multi-head attention; self-attention with a fused ``qkv`` projection, or
    cross-attention (``context_dim`` given) with ``q`` and a fused ``kv`` projection."""

    def __init__(self, dim: int, num_heads: int, *, context_dim: int | None = None) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"num_heads={num_heads} must divide dim={dim}")
        self.num_heads = num_heads
        self.is_cross = context_dim is not None
        if context_dim is None:
            self.qkv = nn.Linear(dim, 3 * dim)
        else:
            self.q = nn.Linear(dim, dim)
            self.kv = nn.Linear(context_dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.is_cross:
            if context is None:
                raise ValueError("cross-attention needs a context tensor")
            q = self.q(x)
            k, v = self.kv(context).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).flatten(-2))


class Mlp(nn.Module):
    """``fc1 -> GELU(tanh) -> fc2``."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """adaLN-modulated self-attention (with RoPE), optional cross-attention to the text, MLP.

    Args:
        dim: hidden size.
        num_heads: attention heads.
        ffn_dim: MLP hidden size.
        cross_attention: add a cross-attention to ``context`` (of width ``text_dim``).
        text_dim: width of the context the block cross-attends to.
        modulation: ``"linear"`` (``t`` is ``[B, dim]``; a per-block ``Linear(dim, 6*dim)``
            on ``SiLU(t)``) or ``"table"`` (``t`` is ``[B, 6, dim]``, a shared projection;
            a per-block ``(1, 6, dim)`` table is added to it).
        rope_theta: base of the rotary frequency table.

    The rotary frequency table is a non-persistent buffer (``rope_freqs``, float32): it is
    not in the state dict, is rebuilt by :meth:`init_buffers`, and the forward reads it.
    """

    _keep_in_fp32: ClassVar[tuple[str, ...]] = ("rope_freqs",)
    rope_freqs: torch.Tensor

    def __init__(
        self,
        dim: int,
        num_heads: int,
        ffn_dim: int,
        *,
        cross_attention: bool,
        text_dim: int,
        modulation: str,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__()
        if modulation not in ("linear", "table"):
            raise ValueError(f"modulation must be 'linear' or 'table', got {modulation!r}")
        self.dim = dim
        self.modulation_kind = modulation
        self.rope_theta = rope_theta
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm_cross: FP32LayerNorm | None = None
        self.cross_attn: Attention | None = None
        if cross_attention:
            self.norm_cross = FP32LayerNorm(dim, eps=1e-6)
            self.cross_attn = Attention(dim, num_heads, context_dim=text_dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, ffn_dim)
        if modulation == "linear":
            self.modulation: nn.Module | nn.Parameter = nn.Linear(dim, 6 * dim)
        else:
            self.modulation = nn.Parameter(torch.zeros(1, 6, dim))
        self.register_buffer(
            "rope_freqs", torch.empty(dim // num_heads // 2, dtype=torch.float32), persistent=False
        )
        if self.rope_freqs.device.type != "meta":
            self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the non-persistent buffers in place, deterministically."""
        head_dim = 2 * self.rope_freqs.numel()
        with torch.no_grad():
            self.rope_freqs.copy_(rope_frequencies(head_dim, self.rope_theta))

    def _rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.rope_freqs.float())
        return angles.cos(), angles.sin()

    def _modulation(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(self.modulation, nn.Parameter):
            return self.modulation + t  # [1, 6, dim] + [B, 6, dim]
        return self.modulation(F.silu(t)).unflatten(-1, (6, self.dim))

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor | None = None
    ) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self._modulation(t).unsqueeze(2).unbind(1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, rope=self._rope(x))
        if self.cross_attn is not None and self.norm_cross is not None:
            x = x + self.cross_attn(self.norm_cross(x), context)
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class TextEncoderBlock(nn.Module):
    """Pre-LN transformer encoder block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def timestep_features(timestep: torch.Tensor, freq_dim: int) -> torch.Tensor:
    """Sinusoidal features ``[B, freq_dim]`` (fp32) of timesteps ``[B]`` in ``[0, 1000]``."""
    half = freq_dim // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, device=timestep.device, dtype=torch.float32) / half
    )
    angles = timestep.float()[:, None] * freqs[None]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
