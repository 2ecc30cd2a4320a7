"""The demo text encoder: token and position embeddings, a stack of encoder blocks, a norm.

Its ``layers`` are the encoder ring declared in the pipeline's ``_offload_plan``.
"""

from __future__ import annotations

import torch
from torch import nn

from dlo.models.blocks import TextEncoderBlock
from dlo.models.presets import Preset


class TextEncoder(nn.Module):
    """Bidirectional transformer encoder over token ids.

    Args:
        preset: the sizes (``vocab``, ``text_dim``, ``text_heads``, ``text_ffn``,
            ``text_layers``, ``text_len``).

    Example:
        >>> enc = TextEncoder(PRESETS["tiny"])
        >>> enc(torch.zeros(1, 16, dtype=torch.long)).shape
        torch.Size([1, 16, 32])
    """

    def __init__(self, preset: Preset) -> None:
        super().__init__()
        self.embed = nn.Embedding(preset.vocab, preset.text_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, preset.text_len, preset.text_dim))
        self.layers = nn.ModuleList(
            TextEncoderBlock(preset.text_dim, preset.text_heads, preset.text_ffn)
            for _ in range(preset.text_layers)
        )
        self.norm = nn.LayerNorm(preset.text_dim, eps=1e-6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Encode ``ids`` ``[B, T]`` (``T <= text_len``) to ``[B, T, text_dim]``.

        Raises:
            ValueError: more tokens than the position table holds.
        """
        num_tokens = ids.shape[1]
        if num_tokens > self.pos_embed.shape[1]:
            raise ValueError(
                f"ids has {num_tokens} tokens, more than text_len={self.pos_embed.shape[1]}"
            )
        x = self.embed(ids) + self.pos_embed[:, :num_tokens]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)
