"""The transport of blocks whose host backing is the checkpoint file (see [Note: mapped host
backing] in :mod:`dlo.host.mapped`): a filler thread reads each chunk into one of a few
pinned staging buffers and enqueues its host-to-device copy. Under ``host_budget_gb`` it
serves a whole stack in request order: a kept block is copied from its host region, a block
left in its file from the read-ahead buffer its read went to (see [Note: disk read-ahead]
in :mod:`dlo.runtime.read_ahead`); one queue keeps every copy into a slot in order.

[Note: staging filler]
Filling a staging buffer is host work (``pread`` from the page cache), and a buffer may be
refilled only after the H2D copy that read it has completed. Neither may block the compute
thread, so one filler thread per backend does both. Per load request (issued by the ring's
``_load`` on the compute thread, in order):

    compute thread: copy_stream.wait_event(S.free); append request; ticket[S] = seq
    filler thread:  for chunk k: buffer b = next in turn; host-wait done[b] (the copy that
                    last read b); fill b; copy_stream: S[chunk k] <- b; record(done[b])
                    then copy_stream: record(S.ready); publish "seq enqueued"

``S.free`` is waited on at request time, from the compute thread, because the ring may
re-record ``S.free`` (eviction) before the filler reaches the request; the filler's copies
are enqueued later on the same copy stream, so they are ordered after that wait.

[Note: staged ready]
The compute stream must not wait on ``S.ready`` before the filler recorded it for this load:
waiting on an event is a snapshot of its last record, so an early wait would see the record
of the slot's previous load (or none: a no-op) and run the block on stale bytes. So the
ring calls :meth:`StagedTransport.wait_enqueued` between the two: a host wait on the
filler's "enqueued" ticket for the slot, which returns at once unless the filler is behind
(then the data is not even read yet, and the wait is the real exposed latency; it falls
inside the exposed-wait timer pair). It cannot deadlock: every copy the filler enqueues
waits only on ``S.free`` records already on the compute stream (recorded before the request
was issued), and a request for the block being entered was issued before the wait. Requests
are served first in, first out, so after ticket ``seq`` the slot's last ``ready`` record is
that load's (a later load into the same slot is issued only after this block's exit or
eviction). On a platform without streams (CPU) the filler's copy is synchronous, so
"enqueued" means "done": the same code path, ordered on the host.

[Note: staging filler at exit]
A program may exit with the backend still enabled, and the ring's last load (the prefetch of
the next forward's first block) is not waited for: the filler can still be serving it when
the main thread finalizes the interpreter. The filler calls torch with the GIL released
(the slot copy, the gaps' ``zero_``), and a thread that comes back for the GIL once
finalization has begun is ended by CPython with ``pthread_exit``, whose unwind crosses
torch's ``noexcept`` frames: ``std::terminate``, "terminate called without an active
exception", exit -6 after output that was correct. So every live transport stops its filler
from an ``atexit`` handler, while the interpreter is still whole: the filler serves what is
queued (a fill whose reader pool is already shut down fails at once and is dropped) and
returns; the join is bounded (:data:`~dlo.runtime.exit_stop.EXIT_JOIN_S`) so a filler
stuck on the device cannot hold the exit. The staging buffers stay allocated (the process is ending); a load issued
after the handler, from a later ``atexit`` handler, raises that the staging thread is gone.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from dlo import faults
from dlo.errors import OffloadError
from dlo.host.mapped import MappedBlock
from dlo.host.packer import READERS
from dlo.host.region import HostRegion, pin_buffers
from dlo.plan.layout import BlockLayout
from dlo.platform.device import Platform
from dlo.platform.timing import nvtx_range
from dlo.runtime.exit_stop import track, untrack
from dlo.runtime.read_ahead import ReadAhead

logger = logging.getLogger(__name__)


NUM_STAGING_BUFFERS = 2
"""Pinned staging buffers per backend: one is filled while the other's copy runs."""


@dataclass(eq=False)
class _Request:
    seq: int
    name: str
    block: MappedBlock | torch.Tensor
    """A block backed by its file, or a kept block's host bytes (``host_budget_gb``)."""
    slot: torch.Tensor
    ready_event: Any


class StagedTransport:
    """Loads rank-local :class:`MappedBlock` s into device slots through a few pinned
    staging buffers filled by one thread (see [Note: staging filler], [Note: staged ready]).

    Has the load interface of :class:`~dlo.runtime.transport.BlockTransport` (group size 1).

    Args:
        platform: device, streams, events, pinning.
        copy_stream: the ring's copy stream.
        chunk_nbytes: size of each staging buffer (the largest chunk it will carry).
        counters: the backend's transfer counters.
        pin: page-lock the staging buffers where the platform can.
        pin_budget_nbytes: the rank's pin budget (None: unlimited).
        require_pinned: a buffer that cannot be pinned (failed, over budget) is an error;
            else it stays pageable (slower copies) with a warning.
        rank: for errors.
        num_buffers: chunk staging buffers (0: no block reads its file through them).
        ahead: the disk tier's reader (see [Note: disk read-ahead]; closed by its owner).
    Raises:
        OffloadError: the staging buffers could not be pinned and ``require_pinned``.
    """

    group_size = 1

    def __init__(
        self,
        platform: Platform,
        *,
        copy_stream: Any,
        chunk_nbytes: int,
        counters: Any,
        pin: bool,
        rank: int,
        pin_budget_nbytes: int | None = None,
        require_pinned: bool = True,
        num_buffers: int = NUM_STAGING_BUFFERS,
        ahead: ReadAhead | None = None,
    ) -> None:
        faults.check("staging_allocation")
        self.ahead = ahead
        self.platform = platform
        self.copy_stream = copy_stream
        self.counters = counters
        self.rank = rank
        self.buffer_nbytes = chunk_nbytes
        self.region = HostRegion([chunk_nbytes] * num_buffers)
        try:
            if pin and platform.can_pin and num_buffers:
                pin_buffers(
                    self.region,
                    platform,
                    budget_nbytes=pin_budget_nbytes,
                    require=require_pinned,
                    what=f"staging buffers of {chunk_nbytes} bytes (host_backing='mapped')",
                    rank=rank,
                )
            # done[b]: producer copy_stream (after the copy that reads buffer b); consumer
            # the filler thread (host wait before b is refilled)
            self._done = [platform.new_event() for _ in range(num_buffers)]
            self._turn = 0
            self._readers = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="dlo-read")
        except BaseException:
            self.region.close()
            raise
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request | None] = collections.deque()
        self._issued = 0
        self._enqueued = 0
        self._errors: dict[int, tuple[str, BaseException]] = {}
        """seq -> (block name, error) of the requests that failed."""
        self._tickets: dict[int, int] = {}
        self.host_wait_s = 0.0
        """Time the compute thread waited for the filler (see [Note: staged ready])."""
        self.num_host_waits = 0
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="dlo-staging", daemon=True
        )
        self._thread.start()
        track(self)

    @property
    def writer_stream(self) -> Any:
        return self.copy_stream

    @property
    def pinned_nbytes(self) -> int:
        """The staging buffers' pinned bytes."""
        return self.region.pinned_nbytes

    @property
    def num_buffers(self) -> int:
        return len(self.region.block_nbytes)

    # ------------------------------------------------------------------ compute thread
    def load(
        self,
        layout: BlockLayout,
        shard: MappedBlock | torch.Tensor,
        slot: torch.Tensor,
        *,
        free_event: Any,
        ready_event: Any,
        index: int = -1,
        slot_index: int = -1,
    ) -> None:
        """Enqueue the load of ``shard`` into ``slot``: the copy stream's wait on
        ``free_event`` now, the fill, copies and ``ready_event`` by the filler."""
        assert self._thread is not None
        assert layout is shard.layout if isinstance(shard, MappedBlock) else shard.is_cpu
        with self.platform.stream(self.copy_stream):
            # [free] producer: compute (or the evicted load's copy stream); consumer: the
            # filler's copies, enqueued after this wait on the same stream
            self.copy_stream.wait_event(free_event)
        if self.ahead is not None and isinstance(shard, MappedBlock) and shard.reads is not None:
            self.ahead.requested(shard)
        with self._cond:
            self._issued += 1
            self._queue.append(_Request(self._issued, layout.name, shard, slot, ready_event))
            if slot_index >= 0:
                self._tickets[slot_index] = self._issued
            self._cond.notify_all()
        self.counters.h2d_nbytes += layout.padded_nbytes
        self.counters.num_loads += 1

    def agree(self, value: int, describe: str) -> None:
        """Nothing: the mapped backing streams whole blocks (a group of one)."""
        return None

    def upcoming(self, shards: list[Any]) -> None:
        """The shards the ring predicts it loads next, in order: the disk tier's are read
        ahead (see [Note: disk read-ahead])."""
        if self.ahead is not None:
            mine = [s for s in shards if isinstance(s, MappedBlock) and s.reads is not None]
            self.ahead.upcoming([s for s in mine if s.layout.group_size == 1])

    def wait_enqueued(self, slot_index: int, block: str) -> None:
        """Return once the last load into slot ``slot_index`` has its copies and ``ready``
        record enqueued (see [Note: staged ready]); raise its error if it failed."""
        seq = self._tickets.get(slot_index, 0)
        self._wait(seq, block)

    def drain(self) -> None:
        """Wait until every request so far is enqueued, and raise the first error of any
        (setup: the resident blocks' loads)."""
        self._wait(self._issued, "")
        with self._cond:
            errors, self._errors = list(self._errors.values()), {}
        if errors:
            name, error = errors[0]
            raise OffloadError(
                f"staging from the checkpoint failed: {error!r}", rank=self.rank, block=name
            ) from error

    def _wait(self, seq: int, block: str) -> None:
        with self._cond:
            if self._enqueued < seq:
                t0 = time.perf_counter()
                while self._enqueued < seq:
                    if self._thread is None or not self._thread.is_alive():
                        raise OffloadError(
                            "the staging thread is gone", rank=self.rank, block=block
                        )
                    self._cond.wait(timeout=1.0)
                self.host_wait_s += time.perf_counter() - t0
                self.num_host_waits += 1
            failed = self._errors.pop(seq, None) if block else None
        error = failed[1] if failed is not None else None
        if error is not None:
            raise OffloadError(
                f"staging from the checkpoint failed: {error!r}", rank=self.rank, block=block
            ) from error

    # ------------------------------------------------------------------ filler thread
    def _run(self) -> None:
        pf = self.platform
        with pf.device_context():  # a new thread starts on device 0
            while True:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    req = self._queue.popleft()
                if req is None:
                    return
                error: BaseException | None = None
                try:
                    self._serve(req)
                except BaseException as e:  # reported to the hook that waits for it
                    logger.debug("dlo staging of %s failed: %r", req.name, e)
                    error = e
                with self._cond:
                    self._enqueued = req.seq
                    if error is not None:
                        self._errors[req.seq] = (req.name, error)
                    self._cond.notify_all()

    def _serve(self, req: _Request) -> None:
        pf, block = self.platform, req.block
        if isinstance(block, torch.Tensor) or block.reads is not None:
            self._copy_whole(req)
            return
        layout = block.layout
        for k in range(layout.num_chunks):
            b = self._turn
            self._turn = (b + 1) % len(self._done)
            self._done[b].synchronize()  # the copy that last read buffer b has completed
            buf = self.region.view(b)[: layout.chunk_nbytes]
            with nvtx_range("dlo::stage"):
                block.fill_chunk(k, buf, pool=self._readers)
            c0, c1 = layout.chunk_range(k)
            with nvtx_range("dlo::h2d"), pf.stream(self.copy_stream):
                req.slot[c0:c1].copy_(buf, non_blocking=True)
                self._done[b].record(self.copy_stream)
        with pf.stream(self.copy_stream):
            # [ready] producer: copy_stream, after the block's last copy; consumer: compute,
            # after wait_enqueued (see [Note: staged ready])
            req.ready_event.record(self.copy_stream)

    def _copy_whole(self, req: _Request) -> None:
        """A kept block from its host region, a disk-tier block from its read-ahead buffer:
        one copy into the slot, then ``ready``."""
        pf, block = self.platform, req.block
        if isinstance(block, torch.Tensor):
            src = block
        else:
            assert self.ahead is not None
            src = self.ahead.acquire(block)
        try:
            with nvtx_range("dlo::h2d"), pf.stream(self.copy_stream):
                req.slot[: src.numel()].copy_(src, non_blocking=True)
                # [ready] producer: copy_stream; consumer: compute, after wait_enqueued
                req.ready_event.record(self.copy_stream)
        finally:
            if isinstance(block, MappedBlock):
                assert self.ahead is not None
                self.ahead.release(block, self.copy_stream)

    # ------------------------------------------------------------------ teardown
    thread_name = "staging"

    def stop_thread(self, timeout_s: float | None = None) -> bool:
        """Let the filler serve what is queued and return; wait at most ``timeout_s`` (None:
        until it has). Returns whether it has stopped. Later loads fail: :meth:`close`
        still releases the buffers."""
        thread = self._thread
        if thread is None:
            return True
        with self._cond:
            if None not in self._queue:
                self._queue.append(None)
            self._cond.notify_all()
        thread.join(timeout_s)
        return not thread.is_alive()

    def close(self) -> None:
        """Serve what is queued, stop the filler, wait for the device, release the staging
        buffers (idempotent)."""
        if self._thread is not None:
            self.stop_thread()
            self._thread = None
            untrack(self)
            self.platform.synchronize()  # no copy still reads a staging buffer
            self._readers.shutdown(wait=True)
        self.region.close()
