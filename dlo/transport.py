"""Moving a block's bytes: host-to-device copies and the AllGather that rebuilds it.

The only dlo module that calls collectives. Everything here only *enqueues* work on the
streams it is given; nothing waits on the host.

[Note: chunk pipeline]
For a block with layout L loaded into device slot S by rank r of a group of G:

    copy_stream:  wait(S.free); for k: copy host slice k -> S[L.slice_range(k, r)];
                  record(chunk_event[k])
    comm_stream:  for k: wait(chunk_event[k]); all_gather(S[L.chunk_range(k)],
                  input=S[L.slice_range(k, r)]); then record(S.ready)

Producer/consumer pairs: ``S.free`` is recorded by the compute stream after the last block
that read S (consumer) and waited on by the copy stream before the first byte is written
(producer); ``chunk_event[k]`` hands slice k from the copy stream to the comm stream;
``S.ready`` hands the whole block from the comm stream to the compute stream. The gather of
chunk k overlaps the copy of chunk k+1. The gather's input is rank r's own range of the
slot, so the gather writes in place and the block needs no staging buffer. With G == 1 the
shard is the whole padded block: one copy, no collective, ``S.ready`` on the copy stream.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlo.ce_gather import CopyEngineGather
from dlo.errors import OffloadError
from dlo.layout import BlockLayout
from dlo.platform import Platform, nvtx_range

logger = logging.getLogger(__name__)

_all_gather_single = getattr(dist, "all_gather_single", None)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """AllGather ``input`` of every rank into ``output`` (``all_gather_single`` where torch
    has it, else ``all_gather_into_tensor``; no deprecation warning on either)."""
    if _all_gather_single is not None:
        _all_gather_single(output, input, group=group)
    else:
        dist.all_gather_into_tensor(output, input, group=group)


def all_gather_objects(obj: Any, group: Any) -> list[Any]:
    """Gather one picklable object from every rank of ``group`` (setup path only)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class SequenceCheck:
    """Checks that every rank of a group gathers the same block at the same time.

    [Note: lock-step check]
    AllGather rebuilds a block from the slices of every rank, so every rank must load the
    same block sequence. Before the chunk gathers of a block, the group gathers each rank's
    block index and slot index (two int64 per rank, on the comm stream; the copy-engine
    gather pulls from the peers' copies of the same slot). On a host-ordered device (CPU,
    gloo) the result is compared at once. On CUDA the comparison must not stall the host:
    the gathered indices are copied to pinned host memory with an event, and checked at a
    later load once the event has completed (non-blocking ``query``), so a divergence is
    reported, naming the block and what every rank was loading, one or two blocks after it
    happened. When the diverging blocks also differ in size, the gathers themselves no
    longer match and only the collective timeout ends the run (see docs/design.md).
    """

    def __init__(
        self,
        platform: Platform,
        group: Any,
        group_rank: int,
        group_size: int,
        names: Sequence[str],
        *,
        depth: int = 64,
    ) -> None:
        self.platform = platform
        self.group = group
        self.group_rank = group_rank
        self.names = list(names)
        dev = platform.device
        self._mine = torch.zeros(2, dtype=torch.int64, device=dev)
        self._free: deque[tuple[torch.Tensor, torch.Tensor, Any]] = deque()
        self._pending: deque[tuple[torch.Tensor, torch.Tensor, Any, tuple[int, int]]] = deque()
        pin = platform.has_streams
        for _ in range(depth if pin else 1):
            gathered = torch.zeros(2 * group_size, dtype=torch.int64, device=dev)
            host = torch.zeros(2 * group_size, dtype=torch.int64, pin_memory=pin)
            self._free.append((gathered, host, platform.new_event()))

    def issue(self, index: int, stream: Any, *, slot: int = -1) -> None:
        """Gather ``(index, slot)`` from every rank on ``stream`` (the comm stream)."""
        gathered, host, event = self.take()
        with self.platform.stream(stream):
            self._mine[0].fill_(index)
            self._mine[1].fill_(slot)
            all_gather_into(gathered, self._mine, self.group)
            host.copy_(gathered, non_blocking=True)
            event.record(stream)
        self._pending.append((gathered, host, event, (index, slot)))
        if not self.platform.has_streams:
            self.poll()

    def read(
        self, tags: torch.Tensor, stream: Any, index: int, *, slot: int, entry: Any = None
    ) -> None:
        """Compare against tags every rank already placed on this device (2 int64 per rank,
        ``(block, slot)``; the copy-engine gather's [Note: lock-step tags]): a copy to
        pinned host memory on ``stream``, checked like a gathered result. ``entry``: one
        :meth:`take` returned before the load enqueued anything (so a divergence found
        while taking it is raised before any barrier of this block is on a stream)."""
        gathered, host, event = entry if entry is not None else self.take()
        with self.platform.stream(stream):
            host.copy_(tags, non_blocking=True)
            event.record(stream)
        self._pending.append((gathered, host, event, (index, slot)))

    def take(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """A free (device, pinned host, event) entry, checking finished ones first (and
        waiting for the oldest when all ``depth`` are in flight)."""
        self.poll()
        if not self._free:
            self.poll(block_host=True)
        return self._free.popleft()

    def poll(self, *, block_host: bool = False) -> None:
        """Check every completed gather (the oldest one waits if ``block_host``)."""
        while self._pending:
            gathered, host, event, (index, slot) = self._pending[0]
            if block_host:
                event.synchronize()
                block_host = False
            elif not event.query():
                return
            self._pending.popleft()
            self._free.append((gathered, host, event))
            flat = host.tolist()
            seen = list(zip(flat[0::2], flat[1::2]))
            if any(v != (index, slot) for v in seen):
                loading = ", ".join(
                    f"rank {r}: {self.names[v] if 0 <= v < len(self.names) else v} (slot {sl})"
                    for r, (v, sl) in enumerate(seen)
                )
                raise OffloadError(
                    "ranks of an AllGather group loaded different blocks or slots (they must "
                    f"run the same block sequence in lock step): {loading}",
                    rank=self.group_rank,
                    block=self.names[index],
                )


@dataclass
class TransferCounters:
    h2d_nbytes: int = 0
    allgather_nbytes: int = 0
    num_loads: int = 0


class BlockTransport:
    """Loads blocks of one group size into device slots (see [Note: chunk pipeline]).

    Args:
        platform: device, streams and events.
        group: the weight-collective process group (None when ``group_size == 1``).
        group_rank, group_size: this rank's place in ``group``.
        copy_stream, comm_stream: the streams owned by the ring.
        max_chunks: the largest ``num_chunks`` of the blocks this transport loads.
        ce_gather: gather into slots with copy engines instead of NCCL kernels ([Note:
            copy-engine gather]); destinations outside its symmetric buffer use ``group``.
    """

    def __init__(
        self,
        platform: Platform,
        *,
        group: Any,
        group_rank: int,
        group_size: int,
        copy_stream: Any,
        comm_stream: Any,
        max_chunks: int,
        counters: TransferCounters,
        sequence_check: SequenceCheck | None = None,
        ce_gather: CopyEngineGather | None = None,
    ) -> None:
        assert (group is None) == (group_size == 1)
        self.ce_gather = ce_gather
        self.platform = platform
        self.group = group
        self.group_rank = group_rank
        self.group_size = group_size
        self.copy_stream = copy_stream
        self.comm_stream = comm_stream
        self.counters = counters
        self.sequence_check = sequence_check
        self._chunk_events = [
            platform.new_event() for _ in range(max_chunks if group_size > 1 else 0)
        ]

    @property
    def writer_stream(self) -> Any:
        """The stream that performs the last write of a load."""
        return self.comm_stream if self.group_size > 1 else self.copy_stream

    def wait_enqueued(self, slot_index: int, block: str) -> None:
        """Nothing: every load is enqueued by the time :meth:`load` returns (a staged
        transport's is not; see [Note: staged ready])."""
        return None

    def load(
        self,
        layout: BlockLayout,
        shard: torch.Tensor,
        slot: torch.Tensor,
        *,
        free_event: Any,
        ready_event: Any,
        index: int = -1,
        slot_index: int = -1,
    ) -> None:
        """Enqueue the load of block ``index`` into ``slot`` (slot ``slot_index`` of the
        pool; -1 for a buffer outside it) and record ``ready_event``."""
        assert layout.group_size == self.group_size
        if layout.num_chunks == 0:  # a block without tensors: nothing moves on any rank
            ready_event.record(self.copy_stream)
            return
        pf = self.platform
        if self.group_size == 1:
            with nvtx_range("dlo::h2d"), pf.stream(self.copy_stream):
                self.copy_stream.wait_event(free_event)
                slot[: layout.padded_nbytes].copy_(shard, non_blocking=True)
                ready_event.record(self.copy_stream)
            self.counters.h2d_nbytes += layout.shard_nbytes
            self.counters.num_loads += 1
            return
        r = self.group_rank
        ce = self.ce_gather if self.ce_gather is not None and self.ce_gather.covers(slot) else None
        check = self.sequence_check
        tags = check is not None and ce is not None and ce.has_tags
        if check is not None and not tags:
            check.issue(index, self.comm_stream, slot=slot_index)
        if tags:
            assert ce is not None and check is not None
            entry = check.take()  # may raise a divergence: before anything is enqueued
            ce.post_tag(self.comm_stream, index, slot_index)  # [Note: lock-step tags]
        with pf.stream(self.copy_stream):
            self.copy_stream.wait_event(free_event)
        for k, (start, end, shard_off) in enumerate(layout.shard_ranges(r)):
            mine = slot[start:end]
            with nvtx_range("dlo::h2d"), pf.stream(self.copy_stream):
                mine.copy_(shard[shard_off : shard_off + layout.slice_nbytes], non_blocking=True)
                self._chunk_events[k].record(self.copy_stream)
            c0, c1 = layout.chunk_range(k)
            with nvtx_range("dlo::allgather"), pf.stream(self.comm_stream):
                self.comm_stream.wait_event(self._chunk_events[k])
                if ce is not None:
                    ce.wait_chunk(self.comm_stream, layout.name)
                    if tags and k == 0:
                        assert check is not None
                        check.read(ce.tags, self.comm_stream, index, slot=slot_index, entry=entry)
                    ce.pull_chunk(slot, layout, k)
                else:
                    all_gather_into(slot[c0:c1], mine, self.group)
        with pf.stream(self.comm_stream):
            if ce is not None:
                ce.finish(self.comm_stream, layout.name)
            ready_event.record(self.comm_stream)
        self.counters.h2d_nbytes += layout.shard_nbytes
        self.counters.allgather_nbytes += layout.padded_nbytes
        self.counters.num_loads += 1
