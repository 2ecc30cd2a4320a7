"""Byte-range arithmetic between a block's tensors and its host shard (see [Note: block
layout] and [Note: chunks and shards] in :mod:`dlo.plan.layout`): packing, unpacking, views,
and copying in-place writes back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from dlo.plan.layout import BlockLayout, TensorSpec, extent_numel


def placeholder(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The empty tensor a streamed tensor ``t`` holds while its block is not loaded: no
    element, ``t``'s dtype and number of dimensions (a wrapper subclass rebuilt around its
    placeholders, as torch's ``state_dict`` does with ``detach``, keeps the ranks its
    checks expect; see [Note: tensor subclasses])."""
    return torch.empty((0,) * max(t.dim(), 1), dtype=t.dtype, device=device)


# ----------------------------------------------------------------------------- packing
def span_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of the memory a tensor addresses, from its first to its last element."""
    t = tensor.detach()
    n = extent_numel(tuple(t.shape), tuple(t.stride()))
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return torch.as_strided(t, (n,), (1,), t.storage_offset()).view(torch.uint8)


def range_copies(
    layout: BlockLayout, ranges: Iterable[tuple[int, int, int]]
) -> Iterator[tuple[int, int, int, int]]:
    """``(tensor_index, tensor_byte_start, nbytes, dst_byte_start)`` of every piece of a
    tensor that lies in one of ``ranges`` (``(block_start, block_end, dst_offset)``: the
    block bytes ``[block_start, block_end)`` go to ``dst[dst_offset:]``). Bytes of a range
    that no tensor covers (alignment gaps, padding) are not listed (:func:`gap_ranges`)."""
    for block_start, block_end, dst_off in ranges:
        for i, spec in enumerate(layout.tensors):
            lo, hi = max(block_start, spec.offset), min(block_end, spec.end)
            if lo < hi:
                yield i, lo - spec.offset, hi - lo, dst_off + lo - block_start


def shard_copies(layout: BlockLayout, rank: int) -> Iterator[tuple[int, int, int, int]]:
    """:func:`range_copies` of ``rank``'s slices: the only bytes that rank reads."""
    return range_copies(layout, layout.shard_ranges(rank))


def chunk_copies(layout: BlockLayout, k: int) -> list[tuple[int, int, int, int]]:
    """:func:`range_copies` of chunk ``k`` of a block, into a buffer that holds that chunk
    alone (offset 0): what one staging buffer receives."""
    c0, c1 = layout.chunk_range(k)
    return list(range_copies(layout, [(c0, c1, 0)]))


def gap_ranges(copies: Iterable[tuple[int, int, int, int]], nbytes: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` byte ranges of ``[0, nbytes)`` that none of ``copies`` writes (the
    bytes a reused buffer must zero to match a fresh, zeroed one)."""
    out: list[tuple[int, int]] = []
    pos = 0
    for _i, _src, n, dst in sorted(copies, key=lambda c: c[3]):
        if dst > pos:
            out.append((pos, dst))
        pos = max(pos, dst + n)
    if pos < nbytes:
        out.append((pos, nbytes))
    return out


def pack_shard(
    dst: torch.Tensor, layout: BlockLayout, rank: int, sources: Sequence[torch.Tensor]
) -> None:
    """Copy ``rank``'s slices of a block from its source tensors into ``dst`` (its shard).

    Only the bytes of this rank's slices are read (:func:`shard_copies`), so no rank builds
    a full block, and a source that aliases a mapped checkpoint has only those pages read.
    Padding and alignment gaps stay as they are in ``dst`` (zero in a fresh region).
    """
    assert dst.numel() == layout.shard_nbytes and len(sources) == len(layout.tensors)
    spans = [span_bytes(s) for s in sources]
    for i, src_lo, n, dst_lo in shard_copies(layout, rank):
        dst[dst_lo : dst_lo + n].copy_(spans[i][src_lo : src_lo + n])


def unpack_tensor(shard: torch.Tensor, spec: TensorSpec, device: torch.device) -> torch.Tensor:
    """Rebuild one tensor (same shape, strides, dtype, bytes) from a full-block shard."""
    base = torch.empty(spec.extent_numel, dtype=spec.dtype, device=device)
    base.view(torch.uint8).copy_(shard[spec.offset : spec.end])
    return base.as_strided(spec.shape, spec.stride)


def shard_view(shard: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A tensor of ``spec``'s shape/strides/dtype aliasing a full-block byte buffer."""
    flat = shard[spec.offset : spec.end].view(spec.dtype)
    return flat.as_strided(spec.shape, spec.stride)


def written_tensors(
    specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor], versions: Sequence[int]
) -> list[tuple[TensorSpec, torch.Tensor]]:
    """The ``(spec, tensor)`` pairs of ``tensors`` written in place since their version
    counters read ``versions`` (see [Note: writes into streamed tensors] in dlo.runtime.streamed)."""
    return [(spec, t) for spec, t, v in zip(specs, tensors, versions) if t._version != v]


def copy_back(shard: torch.Tensor, written: Sequence[tuple[TensorSpec, torch.Tensor]]) -> None:
    """Copy each written tensor into its place in the full-block host ``shard``
    (synchronous: after the kernels that wrote it)."""
    for spec, t in written:
        shard_view(shard, spec).copy_(t.data)
