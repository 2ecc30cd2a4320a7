"""The demo decoder: latent tokens to an RGB image (or video) through a small conv stack."""

from __future__ import annotations

import math

import torch
from torch import nn

from dlo.models.presets import Preset


def _groups(channels: int) -> int:
    return math.gcd(channels, 32)


class UpBlock(nn.Module):
    """``GroupNorm -> SiLU -> 2x nearest upsample -> Conv2d(3x3)``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(_groups(channels), channels, eps=1e-6)
        self.act = nn.SiLU()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.up(self.act(self.norm(x))))


class Decoder(nn.Module):
    """Unpatchify latent tokens to a grid and decode it to RGB.

    Args:
        preset: the sizes (``latent_channels``, ``vae_channels``, ``vae_upsamples``, and
            ``grid``, the default token grid).

    Example:
        >>> Decoder(PRESETS["tiny"])(torch.randn(1, 64, 16)).shape
        torch.Size([1, 3, 32, 32])
    """

    def __init__(self, preset: Preset) -> None:
        super().__init__()
        ch = preset.vae_channels
        self.default_grid = preset.grid
        self.conv_in = nn.Conv2d(preset.latent_channels, ch, 3, padding=1)
        self.ups = nn.ModuleList(UpBlock(ch) for _ in range(preset.vae_upsamples))
        self.norm_out = nn.GroupNorm(_groups(ch), ch, eps=1e-6)
        self.act = nn.SiLU()
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)

    def resolve_grid(self, num_tokens: int, grid: tuple[int, ...] | None) -> tuple[int, ...]:
        """The token grid: ``grid``, else the preset's when it fits, else a square.

        Raises:
            ValueError: ``grid`` does not hold ``num_tokens`` tokens, or none was given and
                ``num_tokens`` is neither the preset's grid nor a square.
        """
        if grid is None:
            if math.prod(self.default_grid) == num_tokens:
                return self.default_grid
            side = math.isqrt(num_tokens)
            if side * side != num_tokens:
                raise ValueError(
                    f"{num_tokens} tokens is not a square grid; pass grid=(h, w) or (f, h, w)"
                )
            return (side, side)
        if len(grid) not in (2, 3) or math.prod(grid) != num_tokens:
            raise ValueError(
                f"grid={grid!r} does not hold {num_tokens} tokens as (h, w) or (f, h, w)"
            )
        return tuple(grid)

    def forward(self, latents: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """Decode ``latents`` ``[B, tokens, C]`` (tokens row-major over ``grid``).

        Returns:
            ``[B, 3, H, W]`` for a 2-D grid, ``[B, 3, F, H, W]`` for a 3-D one, with
            ``H, W = 2**vae_upsamples * (h, w)``, in the model dtype.
        """
        batch, num_tokens, channels = latents.shape
        dims = self.resolve_grid(num_tokens, grid)
        frames = dims[0] if len(dims) == 3 else 1
        h, w = dims[-2], dims[-1]
        x = latents.to(self.conv_in.weight.dtype).reshape(batch, frames, h, w, channels)
        x = x.permute(0, 1, 4, 2, 3).reshape(batch * frames, channels, h, w)
        x = self.conv_in(x)
        for up in self.ups:
            x = up(x)
        x = self.conv_out(self.act(self.norm_out(x)))
        x = x.unflatten(0, (batch, frames))  # [B, F, 3, H, W]
        return x[:, 0] if len(dims) == 2 else x.transpose(1, 2)
