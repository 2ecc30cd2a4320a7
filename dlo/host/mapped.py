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

A block that ``host_budget_gb`` leaves in its file (see [Note: host budget tiers] in
:mod:`dlo.plan.host_tiers`) is a :class:`MappedBlock` whose ``reads`` go around the page
cache ([Note: reads around the page cache] in :mod:`dlo.io.direct`), filled whole into a
read-ahead buffer ([Note: disk read-ahead] in :mod:`dlo.runtime.read_ahead`); at disable its
tensors alias the file again, as :func:`dlo.load_pipeline` left them (a private copy of
every block would need the host memory the budget was set to spare).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from dlo.host.packer import TensorSource, cached_read, fill_ranges
from dlo.host.shards import chunk_copies, gap_ranges, shard_copies
from dlo.io.buffers import bytes_of
from dlo.io.checkpoint import Checkpoint
from dlo.io.direct import DirectReads
from dlo.io.sources import mapped_source
from dlo.plan.layout import BlockLayout


@dataclass(eq=False)
class MappedBlock:
    """The host backing of one block under ``host_backing="mapped"`` (see [Note: mapped host
    backing]): where each tensor of ``layout`` comes from; no private copy of the block."""

    name: str
    layout: BlockLayout
    sources: list[TensorSource]
    reads: DirectReads | None = None
    """The disk tier's reads around the page cache (None: ``pread`` through it)."""
    rank: int = 0
    """This rank's place in the block's weight group: :meth:`fill` writes its slices."""
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
    def read_nbytes(self) -> int:
        """Bytes :meth:`fill` writes: this rank's host shard."""
        return self.layout.shard_nbytes

    @property
    def shard_mapped_nbytes(self) -> int:
        """Bytes of this rank's shard served from the checkpoint file (its 1/N under
        AllGather; the whole block's file bytes in a group of one)."""
        return sum(
            n
            for i, _, n, _ in shard_copies(self.layout, self.rank)
            if not isinstance(self.sources[i], torch.Tensor)
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
        read = self.reads.read_into if self.reads is not None else cached_read
        fill_ranges(dst, copies, self.sources, pool=pool, read=read)

    def fill(self, dst: torch.Tensor, *, pool: ThreadPoolExecutor | None = None) -> None:
        """Write this rank's host shard of the block into ``dst`` (a read-ahead buffer; the
        whole padded block in a group of one): every read of it at once, spread over
        ``pool``."""
        nbytes = self.layout.shard_nbytes
        assert dst.numel() == nbytes
        copies = list(shard_copies(self.layout, self.rank))
        for lo, hi in gap_ranges(copies, nbytes):
            dst[lo:hi].zero_()
        read = self.reads.read_into if self.reads is not None else cached_read
        fill_ranges(dst, copies, self.sources, pool=pool, read=read)

    def tensor(self, i: int) -> torch.Tensor:
        """Tensor ``i`` as ``state_dict`` serves it: a view of the checkpoint's private
        mapping (touching it maps its pages), or the private tensor."""
        src = self.sources[i]
        if isinstance(src, torch.Tensor):
            return src
        return src[0].tensor(src[1])

    def rebuild(self, i: int) -> torch.Tensor:
        """Tensor ``i`` for disable: in memory of its own (``pread`` of a checkpoint range),
        or, on the disk tier, aliasing the file as the loader left it."""
        src = self.sources[i]
        if isinstance(src, torch.Tensor):
            return src
        if self.reads is not None:  # the file unchanged, or aliasing it could fault
            self.reads.file(src[0], src[0].entries[src[1]].file).check()
            return src[0].tensor(src[1])
        spec = self.layout.tensors[i]
        out = torch.empty(spec.shape, dtype=spec.dtype)
        if out.numel():
            src[0].read_into(src[1], 0, bytes_of(out.reshape(-1).view(torch.uint8)))
        return out


_PRIVATE = (
    "(a tensor holds the file's bytes only until a disable gives it private memory, .to() new "
    "memory or an in-place write changes it)"
)


def map_blocks(
    blocks: Sequence[tuple[str, BlockLayout, Sequence[torch.Tensor], int]],
    reads: DirectReads | None,
) -> list[MappedBlock]:
    """The :class:`MappedBlock` of each ``(name, layout, tensors, group rank)``: every
    tensor that aliases a checkpoint is served from it, the others from their own memory;
    ``reads``: the disk tier's reads around the page cache (None: the mapped backing's
    ``pread``).

    Raises:
        ValueError: with ``reads``, a block with no byte in a checkpoint (the disk tier
            cannot leave it in a file); without, no block with one.
    """
    out = [
        MappedBlock(name, layout, [mapped_source(t) or t.data for t in tensors], reads, rank)
        for name, layout, tensors, rank in blocks
    ]
    if reads is not None:  # every file opened now: its stamp is the enable's
        for m in out:
            for src in m.sources:
                if not isinstance(src, torch.Tensor):
                    reads.file(src[0], src[0].entries[src[1]].file)
    unmapped = [m.name for m in out if not m.mapped_nbytes]
    if reads is not None and unmapped:
        raise ValueError(
            f"host_budget_gb leaves {len(out)} blocks in their file, but {unmapped[0]!r} is "
            "not in one: load the model with dlo.load_pipeline or --checkpoint (not "
            f"copy=True, no dtype cast), or raise host_budget_gb {_PRIVATE}"
        )
    if reads is None and len(unmapped) == len(out):
        raise ValueError(
            "host_backing='mapped' serves blocks from the checkpoint they were loaded from, "
            "but no tensor of the streamed blocks aliases a checkpoint: load the model with "
            "dlo.load_pipeline (not copy=True), or use host_backing='region' " + _PRIVATE
        )
    return out


def largest_file(blocks: Sequence[MappedBlock]) -> str | None:
    """The file that serves the most bytes of ``blocks`` (None: none is served by a file)."""
    held: dict[str, int] = {}
    for m in blocks:
        for spec, src in zip(m.layout.tensors, m.sources):
            if not isinstance(src, torch.Tensor):
                path = str(src[0].entries[src[1]].file)
                held[path] = held.get(path, 0) + spec.span_nbytes
    return max(held, key=lambda p: held[p]) if held else None
