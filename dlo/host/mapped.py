"""Rank-local blocks whose host bytes are the checkpoint file: bounded pinned staging.

``host_backing="mapped"`` (issue 10, second part). A rank-local stack loaded with
:func:`dlo.load_pipeline` keeps no private copy of its blocks: their host bytes stay in the
checkpoint file, served by the page cache that every rank of a node shares, and a few
pinned staging buffers carry them to the device.

[Note: mapped host backing]
A :class:`MappedBlock` is the host backing of one block: for every tensor of its layout
either a checkpoint range (the tensor aliased the file after ``load_pipeline``) or a private
CPU tensor (the loader copied it, or a computed non-persistent buffer). The bytes a device
slot receives are exactly the region-backed ones: :func:`fill_chunk` writes chunk ``k`` of
the block's layout into a staging buffer with the loader's range arithmetic
(:func:`~dlo.host.shards.chunk_copies`, the same iterator :func:`~dlo.host.shards.shard_copies` is built
on), reads file ranges with ``pread`` (nothing of the file is mapped into the process, see
[Note: mapped checkpoint tensors]) and zeroes the bytes no tensor covers, as a fresh region
would hold them. Then one H2D copy per chunk. Pinned host memory is only the staging
buffers: ``NUM_STAGING_BUFFERS`` exact-size buffers of the largest chunk, in one
:class:`~dlo.host.region.HostRegion` (counted in the ledger).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from dlo.host.packer import TensorSource, fill_ranges
from dlo.host.shards import chunk_copies, gap_ranges
from dlo.io.checkpoint import Checkpoint, bytes_of
from dlo.plan.layout import BlockLayout


@dataclass(eq=False)
class MappedBlock:
    """The host backing of one block under ``host_backing="mapped"`` (see [Note: mapped host
    backing]): where each tensor of ``layout`` comes from; no private copy of the block."""

    name: str
    layout: BlockLayout
    sources: list[TensorSource]
    _chunks: list[tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]] = field(
        default_factory=list, repr=False
    )

    def __post_init__(self) -> None:
        assert len(self.sources) == len(self.layout.tensors)
        for k in range(self.layout.num_chunks):
            copies = chunk_copies(self.layout, k)
            self._chunks.append((copies, gap_ranges(copies, self.layout.chunk_nbytes)))

    @property
    def mapped_nbytes(self) -> int:
        """Bytes served from the checkpoint file."""
        return sum(
            s.span_nbytes
            for s, src in zip(self.layout.tensors, self.sources)
            if not isinstance(src, torch.Tensor)
        )

    @property
    def private_nbytes(self) -> int:
        """Bytes of private CPU tensors this block keeps (copied or computed tensors)."""
        return sum(
            s.span_nbytes
            for s, src in zip(self.layout.tensors, self.sources)
            if isinstance(src, torch.Tensor)
        )

    @property
    def checkpoints(self) -> list[Checkpoint]:
        out: list[Checkpoint] = []
        for src in self.sources:
            if not isinstance(src, torch.Tensor) and all(src[0] is not c for c in out):
                out.append(src[0])
        return out

    def fill_chunk(
        self, k: int, dst: torch.Tensor, *, pool: ThreadPoolExecutor | None = None
    ) -> None:
        """Write chunk ``k`` of the block (its layout bytes, gaps zero) into ``dst``."""
        assert dst.numel() == self.layout.chunk_nbytes
        copies, gaps = self._chunks[k]
        for lo, hi in gaps:
            dst[lo:hi].zero_()
        fill_ranges(dst, copies, self.sources, pool=pool)

    def tensor(self, i: int) -> torch.Tensor:
        """Tensor ``i`` as ``state_dict`` serves it: a view of the checkpoint's private
        mapping (touching it maps its pages), or the private tensor."""
        src = self.sources[i]
        if isinstance(src, torch.Tensor):
            return src
        return src[0].tensor(src[1])

    def rebuild(self, i: int) -> torch.Tensor:
        """Tensor ``i`` in memory of its own (``pread`` of a checkpoint range), for disable."""
        src = self.sources[i]
        if isinstance(src, torch.Tensor):
            return src
        spec = self.layout.tensors[i]
        out = torch.empty(spec.shape, dtype=spec.dtype)
        if out.numel():
            src[0].read_into(src[1], 0, bytes_of(out.reshape(-1).view(torch.uint8)))
        return out
