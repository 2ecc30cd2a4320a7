"""Byte views of CPU tensors, for reads into them and writes out of them."""

from __future__ import annotations

import torch


def flat_uint8(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 CPU tensor, any dtype (bf16 and fp8 have no numpy
    type); a view where it is one already."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU uint8 tensor."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
