"""Reading the disk tier's blocks into page-locked buffers ahead of their loads.

[Note: disk read-ahead]
A block that ``host_budget_gb`` leaves in its file (see [Note: host budget tiers] in
:mod:`dlo.plan.host_tiers`) is read at every use. The ring requests a load only
``num_slots - 1`` blocks ahead, and a disk read is far slower than a copy, so a reader
thread reads further ahead, in the order the ring predicts (its learned execution order, see
[Note: prefetch chain] in :mod:`dlo.runtime.chain`), into ``K`` whole-block page-locked
buffers (:data:`READ_AHEAD_BUFFERS`). The disk stays busy while a kept block is copied and
computed; the host footprint is the budget plus these ``K`` blocks (and the readers'
scratch buffers).

A buffer is FREE, READING (the reader fills it), READY (it holds a block, read and not yet
copied) or IN_USE (the staging filler enqueues its copy into a slot). Protocol:

    compute thread: upcoming(blocks)  the ring's predicted order, the requested loads first
    reader thread:  for the first wanted block without a buffer: take a FREE buffer (else a
                    READY one whose block is not wanted any more: a wasted read); host-wait
                    done[b] (the copy that last read b); fill it; READY
    filler thread:  acquire(block): the block's READY buffer (waits while READING; a block
                    not read ahead is put first and read now), IN_USE
                    copy_stream: slot <- buffer; record(done[b]); release(b): FREE

The block an acquire waits for is read before any other and may take any READY buffer: the
filler serves loads in request order and holds no buffer while it waits, so the reader
always has one to fill and the two never wait on each other (a request the filler never
served, an interrupted load, is dropped when a later one is acquired). A failed read of a
requested block is its acquire's error (the staging filler reports it to the hook that
waits for the block, naming it); the buffer goes back FREE and the block is read again at
its next use. A failed read of a predicted block is forgotten: it is read again if it is
requested.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dlo.errors import OffloadError
from dlo.host.packer import READERS
from dlo.host.region import HostRegion, pin_buffers
from dlo.plan.host_tiers import READ_AHEAD_BUFFERS
from dlo.platform.device import Platform
from dlo.platform.timing import nvtx_range
from dlo.runtime.exit_stop import track, untrack

logger = logging.getLogger(__name__)


FREE, READING, READY, IN_USE = "free", "reading", "ready", "in use"


class DiskShard(Protocol):
    """What the read-ahead reads: a disk-tier block's host shard (raw,
    :class:`~dlo.host.mapped.MappedBlock`; or encoded,
    :class:`~dlo.codec.on_disk.EncodedOnDisk`)."""

    name: str

    @property
    def read_nbytes(self) -> int:
        """The bytes :meth:`fill` writes."""
        ...

    def fill(self, dst: torch.Tensor, *, pool: ThreadPoolExecutor | None = None) -> None:
        """Read the shard into ``dst`` (``read_nbytes`` bytes), spread over ``pool``."""
        ...


@dataclass(eq=False)
class _Buffer:
    index: int
    done: Any
    """The event recorded after the copy that last read this buffer."""
    state: str = FREE
    block: DiskShard | None = None
    error: BaseException | None = None


@dataclass
class ReadAheadStats:
    read_nbytes: int = 0
    """Bytes of blocks read into the buffers."""
    read_s: float = 0.0
    """Time the reader spent reading them."""
    num_reads: int = 0
    num_wasted_reads: int = 0
    """Blocks read ahead and dropped before their load (the prediction was wrong)."""
    num_waits: int = 0
    """Loads whose block was not read yet when the filler came to copy it."""
    wait_s: float = 0.0
    """Time the filler waited for reads."""


class ReadAhead:
    """``num_buffers`` whole-block buffers filled by one reader thread ahead of the loads
    (see [Note: disk read-ahead]).

    Args:
        platform: pinning and events.
        buffer_nbytes: the largest host shard it reads (a whole padded block on a
            rank-local stack, this rank's 1/N of one under AllGather).

        pin: page-lock the buffers where the platform can.
        pin_budget_nbytes: what they may pin (None: unlimited).
        require_pinned: a buffer that cannot be pinned is an error; else it stays pageable.
        rank: for errors.
    """

    def __init__(
        self,
        platform: Platform,
        *,
        buffer_nbytes: int,
        pin: bool,
        rank: int,
        pin_budget_nbytes: int | None = None,
        require_pinned: bool = True,
        num_buffers: int = READ_AHEAD_BUFFERS,
    ) -> None:
        self.platform = platform
        self.rank = rank
        self.pool = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="dlo-read")
        """The readers a fill spreads its reads over, shut down at :meth:`close`."""
        self.region = HostRegion([buffer_nbytes] * num_buffers)
        try:
            if pin and platform.can_pin:
                pin_buffers(
                    self.region,
                    platform,
                    budget_nbytes=pin_budget_nbytes,
                    require=require_pinned,
                    what=f"read-ahead buffers of {buffer_nbytes} bytes (host_budget_gb)",
                    rank=rank,
                )
            self._buffers = [_Buffer(i, platform.new_event()) for i in range(num_buffers)]
        except BaseException:
            self.region.close()
            self.pool.shutdown()
            raise
        self.stats = ReadAheadStats()
        self._pending: list[DiskShard] = []
        """Blocks whose load was requested and not yet acquired, in request order."""
        self._hinted: list[DiskShard] = []
        """The blocks the ring predicts it requests next, in order."""
        self._urgent: DiskShard | None = None
        """The block the filler waits for: read before anything else."""
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="dlo-read-ahead", daemon=True
        )
        self._thread.start()
        track(self)

    @property
    def pinned_nbytes(self) -> int:
        return self.region.pinned_nbytes

    @property
    def buffer_nbytes(self) -> int:
        return self.region.block_nbytes[0]

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    # ------------------------------------------------------------------ compute thread
    def requested(self, block: DiskShard) -> None:
        """A load of ``block`` was requested: the filler acquires it in this order."""
        with self._cond:
            self._pending.append(block)
            self._cond.notify_all()

    def upcoming(self, blocks: list[DiskShard]) -> None:
        """The blocks the ring predicts it requests next, in order."""
        with self._cond:
            self._hinted = list(blocks)
            self._cond.notify_all()

    # ------------------------------------------------------------------ filler thread
    def acquire(self, block: DiskShard) -> torch.Tensor:
        """The host shard bytes of a requested ``block`` in a buffer, once read; the buffer
        is the caller's until :meth:`release`.

        Raises:
            OffloadError: the reader is gone.
            BaseException: the read's error.
        """
        with self._cond:
            # loads are served in request order: requests before this one were never
            # served (an interrupted load) and are dropped; this block is read first
            if any(b is block for b in self._pending):
                while self._pending.pop(0) is not block:
                    pass
            self._hinted = [b for b in self._hinted if b is not block]
            self._urgent = block
            self._cond.notify_all()
            t0 = time.perf_counter()
            if (buf := self._holding(block)) is None or buf.state == READING:
                self.stats.num_waits += 1
            try:
                while (buf := self._holding(block)) is None or buf.state == READING:
                    if self._thread is None or not self._thread.is_alive():
                        raise OffloadError("the read-ahead thread is gone", rank=self.rank)
                    self._cond.wait(timeout=1.0)
            finally:
                self._urgent = None
            self.stats.wait_s += time.perf_counter() - t0
            if buf.error is not None:
                error, buf.error, buf.block, buf.state = buf.error, None, None, FREE
                self._cond.notify_all()
                raise error
            buf.state = IN_USE
        return self.region.view(buf.index)[: block.read_nbytes]

    def release(self, block: DiskShard, copy_stream: Any) -> None:
        """The copy out of ``block``'s buffer is enqueued on ``copy_stream``: the buffer may be
        filled again once it completed."""
        with self._cond:
            buf = next(b for b in self._buffers if b.block is block and b.state == IN_USE)
            buf.done.record(copy_stream)
            buf.state, buf.block = FREE, None
            self._cond.notify_all()

    # ------------------------------------------------------------------ reader thread
    def _holding(self, block: DiskShard) -> _Buffer | None:
        return next((b for b in self._buffers if b.block is block and b.state != FREE), None)

    def _wanted(self) -> list[DiskShard]:
        first = [self._urgent] if self._urgent is not None else []
        seen = set(map(id, first))
        out = list(first)
        for b in self._pending + self._hinted:
            if id(b) not in seen:
                seen.add(id(b))
                out.append(b)
        return out

    def _next(self) -> tuple[DiskShard, _Buffer] | None:
        """The next block to read and the buffer it goes to (the caller holds the lock)."""
        wanted = self._wanted()
        want = next((b for b in wanted if self._holding(b) is None), None)
        if want is None:
            return None
        free = [b for b in self._buffers if b.state == FREE]
        if not free:  # a READY block not wanted any more, else the one wanted last
            ready = [b for b in self._buffers if b.state == READY]
            if not ready:
                return None
            rank = {id(b): i for i, b in enumerate(wanted)}
            victim = max(ready, key=lambda b: rank.get(id(b.block), len(rank)))
            if rank.get(id(victim.block), len(rank)) < rank[id(want)]:
                return None  # every READY block is wanted before this one
            self.stats.num_wasted_reads += 1
            free = [victim]
        buf = free[0]
        buf.state, buf.block, buf.error = READING, want, None
        return want, buf

    def _run(self) -> None:
        with self.platform.device_context():
            while True:
                with self._cond:
                    job = None
                    while job is None:
                        if self._stop:
                            return
                        if (job := self._next()) is None:
                            self._cond.wait()
                block, buf = job
                error: BaseException | None = None
                t0 = time.perf_counter()
                try:
                    buf.done.synchronize()  # the copy that last read this buffer completed
                    with nvtx_range("dlo::disk"):
                        view = self.region.view(buf.index)[: block.read_nbytes]
                        block.fill(view, pool=self.pool)
                except BaseException as e:  # the acquire of this block raises it
                    logger.debug("dlo read-ahead of %s failed: %r", block.name, e)
                    error = e
                with self._cond:
                    self.stats.read_s += time.perf_counter() - t0
                    if error is None:
                        self.stats.read_nbytes += block.read_nbytes
                        self.stats.num_reads += 1
                        buf.state = READY
                    elif block is self._urgent or any(b is block for b in self._pending):
                        buf.state, buf.error = READY, error  # its load raises it
                    else:  # a prediction: forgotten, read again if it is requested
                        buf.state, buf.block = FREE, None
                        self._hinted = [b for b in self._hinted if b is not block]
                    self._cond.notify_all()

    # ------------------------------------------------------------------ teardown
    thread_name = "read-ahead"

    def stop_thread(self, timeout_s: float | None = None) -> bool:
        """Stop the reader after its current read; wait at most ``timeout_s`` (None: until it
        has). Returns whether it has stopped (see [Note: staging filler at exit] in
        :mod:`dlo.runtime.staged`)."""
        thread = self._thread
        if thread is None:
            return True
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread.join(timeout_s)
        return not thread.is_alive()

    def close(self) -> None:
        """Stop the reader, wait for the device, release the buffers (idempotent)."""
        if self._thread is not None:
            self.stop_thread()
            self._thread = None
            untrack(self)
            self.platform.synchronize()  # no copy still reads a buffer
            self.pool.shutdown(wait=True)
        self.region.close()
