"""Filling host shards: from tensors, or with ``pread`` straight from a checkpoint file for
tensors that alias it (see [Note: loading from a checkpoint] in :mod:`dlo.io.materialize`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from dlo.host.shards import pack_shard, shard_copies, span_bytes
from dlo.io.buffers import bytes_of
from dlo.io.checkpoint import Checkpoint
from dlo.io.sources import mapped_source
from dlo.plan.layout import BlockLayout
from dlo.platform.env import cpu_share


def pack_block(
    dst: torch.Tensor, layout: BlockLayout, rank: int, sources: Sequence[torch.Tensor]
) -> None:
    """:func:`~dlo.host.shards.pack_shard`, reading tensors that alias a checkpoint straight from
    the file with ``pread`` (same ranges, :func:`~dlo.host.shards.shard_copies`): the file's pages
    are never mapped into this process, so they never count in its RSS."""
    files = [mapped_source(t) for t in sources]
    if not any(files):
        pack_shard(dst, layout, rank, sources)
        return
    assert dst.numel() == layout.shard_nbytes and len(sources) == len(layout.tensors)
    fill_ranges(
        dst, shard_copies(layout, rank), [t if f is None else f for t, f in zip(sources, files)]
    )


READERS = max(8, min(16, cpu_share()))
"""Concurrent ``pread`` calls of one fill (a fast disk or the page cache copy in parallel):
this process's share of the node's CPUs, 8 to 16."""


READ_PIECE_NBYTES = 8 << 20
"""Large file ranges are read in pieces of this size, so they spread over the readers."""


TensorSource = torch.Tensor | tuple[Checkpoint, str]
"""Where one tensor's bytes come from: a CPU tensor, or ``(checkpoint, name)``."""

FileRead = Callable[[Checkpoint, str, int, memoryview], None]
"""``read(checkpoint, name, offset, out)``: how a checkpoint range is read (``pread``
through the page cache, or around it: :class:`~dlo.io.direct.DirectReads`)."""


def cached_read(ckpt: Checkpoint, name: str, offset: int, out: memoryview) -> None:
    """A checkpoint range read with ``pread`` through the page cache."""
    ckpt.read_into(name, offset, out)


def fill_ranges(
    dst: torch.Tensor,
    copies: Iterable[tuple[int, int, int, int]],
    sources: Sequence[TensorSource],
    *,
    pool: ThreadPoolExecutor | None = None,
    read: FileRead = cached_read,
) -> None:
    """Copy the byte ranges ``copies`` (``(tensor_index, src_start, nbytes, dst_start)``, from
    :func:`~dlo.host.shards.range_copies`) of ``sources`` into the uint8 tensor ``dst``.

    Tensor sources are copied from their span; checkpoint sources are read with ``read``
    (``pread``; several at a time, on ``pool`` or a pool of this call), never through the
    mapping.
    """
    out: memoryview | None = None
    spans: dict[int, torch.Tensor] = {}
    reads: list[tuple[Checkpoint, str, int, memoryview]] = []
    for i, src_lo, n, dst_lo in copies:
        src = sources[i]
        if isinstance(src, torch.Tensor):
            span = spans.get(i)
            if span is None:
                span = spans[i] = span_bytes(src)
            dst[dst_lo : dst_lo + n].copy_(span[src_lo : src_lo + n])
            continue
        if out is None:
            out = bytes_of(dst)
        ckpt, name = src
        for off in range(0, n, READ_PIECE_NBYTES):
            m = min(READ_PIECE_NBYTES, n - off)
            reads.append((ckpt, name, src_lo + off, out[dst_lo + off : dst_lo + off + m]))
    if len(reads) == 1:
        read(*reads[0])
    elif reads and pool is not None:
        _read_all(pool, reads, read)
    elif reads:
        with ThreadPoolExecutor(max_workers=min(READERS, len(reads))) as own:
            _read_all(own, reads, read)


def _read_all(
    pool: ThreadPoolExecutor, reads: list[tuple[Checkpoint, str, int, memoryview]], read: FileRead
) -> None:
    """Run ``reads`` on ``pool``; on a failure, cancel the ones not started and wait for the
    running ones before raising the first error: no read of this fill may still be writing
    into ``dst`` once the caller reuses it (a staging buffer holds the next block soon)."""
    futures = [pool.submit(read, c, n, lo, buf) for c, n, lo, buf in reads]
    try:
        for fut in futures:
            fut.result()
    except BaseException:
        for fut in futures:
            fut.cancel()
        wait(futures)
        raise
