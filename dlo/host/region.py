"""Host storage: one exact-size region per rank holding its shards of every block.

[Note: exact pinned bytes]
``Tensor.pin_memory()`` goes through the caching host allocator, which rounds every request
up to a power of two: pinning a 340 MB block costs 512 MB. dlo instead maps one private
anonymous, page-aligned region sized to the sum of this rank's shards (each block's shard
starting on a page boundary), with transparent huge pages asked for (filling it touches
every page first; 2 MiB faults made Wan 14B's 28 GB fill 2.5x faster), and page-locks each
block's exact byte range in place with the platform's ``register_host``
(``cudaHostRegister``). dlo's own :data:`LEDGER` counts registered bytes,
because ``torch.cuda.host_memory_stats()`` does not see registered memory.

Pinning is per block so that a budget or a failed registration can leave some blocks
pageable (``pin_failure_policy="whole_block_fallback"``): those blocks are still correct,
only their host-to-device copies are slower.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from dlo import faults
from dlo.errors import OffloadError
from dlo.io.files import not_own
from dlo.journal import atomic
from dlo.plan.layers import charged_nbytes
from dlo.plan.layout import round_up
from dlo.platform.device import Platform
from dlo.platform.env import page_size

logger = logging.getLogger(__name__)


class PinLedger:
    """Process-wide count of host bytes dlo holds, and of those pinned (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.host_nbytes = 0
        self.pinned_nbytes = 0

    def add(self, *, host: int = 0, pinned: int = 0) -> None:
        with self._lock:
            self.host_nbytes += host
            self.pinned_nbytes += pinned
            assert self.host_nbytes >= 0 and self.pinned_nbytes >= 0, "ledger underflow"


LEDGER = PinLedger()
"""The ledger of this process; tests read it to prove nothing is left pinned."""


@dataclass
class PinReport:
    """What happened when a region was pinned."""

    requested_blocks: int = 0
    pinned_blocks: list[int] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)
    over_budget_blocks: list[int] = field(default_factory=list)

    @property
    def unpinned_blocks(self) -> list[int]:
        return sorted(self.failed_blocks + self.over_budget_blocks)


class HostRegion:
    """Page-aligned host memory holding one byte range per block.

    Args:
        nbytes: bytes of each block's shard on this rank (exact; 0 allowed).
        path: map this file (created if missing, sized with ``posix_fallocate`` so a full
            tmpfs fails here instead of at the first write) shared with the other processes
            that map it, instead of anonymous private memory (see [Note: node-shared host
            copy] in :mod:`dlo.host.node_share`).
        share_ranks: ranks that share the region; each is charged ``1/share_ranks`` of a
            block against the pin budget.
        header_nbytes: bytes before the first block (its own pages, never pinned), for the
            sharers' marks (:meth:`header`).
    """

    def __init__(
        self,
        nbytes: Sequence[int],
        *,
        path: str | None = None,
        share_ranks: int = 1,
        header_nbytes: int = 0,
    ) -> None:
        faults.check("host_allocation")
        page = page_size()
        self.block_nbytes = [int(n) for n in nbytes]
        self.block_offsets: list[int] = []
        self.share_ranks = share_ranks
        self.header_nbytes = header_nbytes
        total = round_up(header_nbytes, page)
        for n in self.block_nbytes:
            self.block_offsets.append(total)
            total += round_up(n, page)
        self.nbytes = total
        self._mmap: mmap.mmap | None = (
            None if not total else _anonymous(total) if path is None else _map_file(path, total)
        )
        self._buffer: torch.Tensor | None = (
            torch.frombuffer(self._mmap, dtype=torch.uint8)
            if self._mmap is not None
            else torch.empty(0, dtype=torch.uint8)
        )
        self._platform: Platform | None = None
        self._pinned: list[bool] = [False] * len(self.block_nbytes)
        LEDGER.add(host=self.nbytes)

    # ------------------------------------------------------------------ access
    def view(self, index: int) -> torch.Tensor:
        """The uint8 tensor over block ``index``'s shard (a view of the region)."""
        assert self._buffer is not None, "host region already released"
        start = self.block_offsets[index]
        return self._buffer[start : start + self.block_nbytes[index]]

    def header(self) -> torch.Tensor:
        """The uint8 tensor over the header bytes."""
        assert self._buffer is not None, "host region already released"
        return self._buffer[: self.header_nbytes]

    def is_pinned(self, index: int) -> bool:
        return self._pinned[index]

    @property
    def pinned_nbytes(self) -> int:
        return sum(n for n, p in zip(self.block_nbytes, self._pinned) if p)

    @property
    def closed(self) -> bool:
        return self._buffer is None

    # ------------------------------------------------------------------ pinning
    def pin(
        self,
        platform: Platform,
        *,
        budget_nbytes: int | None = None,
        num_workers: int = 4,
        blocks: Sequence[int] | None = None,
    ) -> PinReport:
        """Page-lock every block's range (or those of ``blocks``) until the budget is used:
        :meth:`pin_as_filled` with every block already filled."""
        return self.pin_as_filled(
            platform, budget_nbytes=budget_nbytes, num_workers=num_workers, blocks=blocks
        ).finish()

    def pin_as_filled(
        self,
        platform: Platform,
        *,
        budget_nbytes: int | None = None,
        num_workers: int = 4,
        blocks: Sequence[int] | None = None,
    ) -> RegionPins:
        """Start pinning the blocks (all, or ``blocks``) that fit the budget, each as soon as
        the caller says it is filled (:meth:`RegionPins.filled`), on ``num_workers`` threads:
        registration is mostly kernel page walking, which overlaps the filling of the next
        blocks. :meth:`RegionPins.finish` waits and returns the report; the caller must call
        it, or :meth:`RegionPins.cancel` on failure, before closing the region."""
        return RegionPins(self, platform, budget_nbytes, num_workers, blocks)

    def _charge(self, index: int) -> int:
        """What pinning block ``index`` costs this rank's budget: its share of the bytes."""
        return charged_nbytes(self.block_nbytes[index], self.share_ranks)

    @property
    def charged_pinned_nbytes(self) -> int:
        """This rank's share of the pinned bytes (all of them unless the region is shared)."""
        return sum(self._charge(i) for i, p in enumerate(self._pinned) if p)

    def _register_one(self, index: int) -> bool:
        assert self._platform is not None
        faults.check("pin_allocation")
        return self._platform.register_host(self.view(index))

    def _record(
        self, blocks: Sequence[int], outcomes: dict[int, bool | BaseException], report: PinReport
    ) -> list[int]:
        """Record the registrations of ``blocks`` (``outcomes``: True, False for a refusal,
        or the exception raised; a block without one was not tried); returns those that
        failed, or raises the first exception once every success is recorded (``close()``
        unregisters them)."""
        failed: list[int] = []
        error: BaseException | None = None
        for i in blocks:
            ok = outcomes.get(i)
            if ok is True:
                self._pinned[i] = True
                LEDGER.add(pinned=self.block_nbytes[i])
                report.pinned_blocks.append(i)
            elif ok is False:
                report.failed_blocks.append(i)
                failed.append(i)
            elif ok is not None and error is None:
                error = ok
        if error is not None:
            raise error
        return failed

    def unpin(self, blocks: Sequence[int] | None = None) -> None:
        """Unregister the pinned ``blocks`` (default: all); idempotent."""
        for i, pinned in enumerate(self._pinned):
            if pinned and (blocks is None or i in blocks):
                assert self._platform is not None
                self._platform.unregister_host(self.view(i))
                self._pinned[i] = False
                LEDGER.add(pinned=-self.block_nbytes[i])

    def close(self) -> None:
        """Unpin and release the region (idempotent); the memory is returned once the last
        view of it is gone."""
        if self._buffer is None:
            return
        self.unpin()
        self._buffer = None
        LEDGER.add(host=-self.nbytes)
        # No explicit munmap: every view (a ring's shard, a state_dict entry handed to the
        # user) keeps the mapping alive through torch.frombuffer's reference, and the pages
        # go back to the OS when the last view dies. Closing here would leave views dangling.
        self._mmap = None


class RegionPins:
    """Pinning of a region's blocks while the region is filled (see
    :meth:`HostRegion.pin_as_filled`).

    Which blocks fit the budget is decided first, in block order (each block whole). If a
    registration fails, the budget it left unused goes, at :meth:`finish`, to the blocks
    that did not fit, again in block order. Blocks that do not fit the budget or whose
    registration fails stay pageable and are listed in the report; the caller decides
    (alone or group-wide) what that means.
    """

    def __init__(
        self,
        region: HostRegion,
        platform: Platform,
        budget_nbytes: int | None,
        num_workers: int,
        blocks: Sequence[int] | None,
    ) -> None:
        wanted = range(len(region.block_nbytes)) if blocks is None else sorted(blocks)
        self.region = region
        self.budget_nbytes = budget_nbytes
        self.report = PinReport(requested_blocks=len(wanted))
        self.chosen: list[int] = []
        self._used = region.charged_pinned_nbytes
        if platform.can_pin:
            region._platform = platform
            for i in wanted:
                n = region._charge(i)
                if n == 0 or region._pinned[i]:
                    continue
                if budget_nbytes is not None and self._used + n > budget_nbytes:
                    self.report.over_budget_blocks.append(i)
                    continue
                self.chosen.append(i)
                self._used += n
        self._wanted = set(self.chosen)
        self._futures: dict[int, Future[bool]] = {}
        self._outcomes: dict[int, bool | BaseException] = {}
        self._pool = (
            ThreadPoolExecutor(max_workers=min(num_workers, len(self.chosen)))
            if num_workers > 1 and len(self.chosen) > 1
            else None
        )
        self._done = False

    def filled(self, index: int) -> None:
        """Block ``index`` holds its bytes: register it (on a worker thread, or here with one
        worker; with one worker nothing more is tried after a registration raised)."""
        if self._done or index not in self._wanted:
            return
        self._wanted.discard(index)
        if self._pool is not None:
            self._futures[index] = self._pool.submit(self.region._register_one, index)
        elif not any(isinstance(o, BaseException) for o in self._outcomes.values()):
            try:
                self._outcomes[index] = self.region._register_one(index)
            except BaseException as e:
                self._outcomes[index] = e

    def _wait(self) -> None:
        for i, f in self._futures.items():  # all of them: nothing registered behind our back
            try:
                self._outcomes[i] = f.result()
            except BaseException as e:
                self._outcomes[i] = e
        self._futures.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def finish(self) -> PinReport:
        """Register the chosen blocks not yet filled, wait for every registration and return
        the report (raises the first registration error, with every success recorded)."""
        assert not self._done, "pinning already finished"
        for i in list(self.chosen):
            self.filled(i)
        region, report = self.region, self.report
        # waited for and recorded as one step: an interrupt can neither be taken for a
        # registration's outcome nor leave a registration unrecorded (close() would miss it)
        with atomic():
            self._wait()
            try:
                failed = region._record(self.chosen, self._outcomes, report)
            finally:
                self._done = True
        self._used -= sum(region._charge(i) for i in failed)
        retry, report.over_budget_blocks = report.over_budget_blocks, []
        for i in retry:  # only after a failed registration freed some budget
            n = region._charge(i)
            if self.budget_nbytes is not None and self._used + n > self.budget_nbytes:
                report.over_budget_blocks.append(i)
                continue
            with atomic():
                try:
                    outcome: bool | BaseException = region._register_one(i)
                except BaseException as e:
                    outcome = e
                if not region._record([i], {i: outcome}, report):
                    self._used += n
        report.pinned_blocks.sort()
        report.failed_blocks.sort()
        return report

    def cancel(self) -> None:
        """Stop: registrations not started are dropped, running ones waited for, and every
        success recorded (so ``close()`` unregisters it). Idempotent; a no-op after
        :meth:`finish`."""
        if self._done:
            return
        with atomic():
            for f in self._futures.values():
                f.cancel()
            self._wait()
            with contextlib.suppress(BaseException):
                self.region._record(self.chosen, self._outcomes, PinReport())
            self._done = True


def _anonymous(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory, transparent huge pages asked for: filling a
    region first-touches every page, and a 2 MiB fault zeroes as much as 512 faults of
    4 KiB (Python's default anonymous mapping is shared: shmem, which takes no huge pages
    and faults slower). Measured in docs/benchmarks.md (pipeline folders)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # huge pages where the kernel has them; and no copy into a forked child: the kernel
    # copies pinned private pages eagerly at fork (tens of GB for a DataLoader worker),
    # so a child does not get the region at all (dlo's host shards are the parent's)
    for name in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        advice = getattr(mmap, name, None)
        if advice is not None:
            with contextlib.suppress(OSError):
                m.madvise(advice)
    return m


def _map_file(path: str, nbytes: int) -> mmap.mmap:
    """``nbytes`` of the shared-memory file at ``path`` (a node-shared memfd offered as
    ``/proc/PID/fd/N``, sized here if smaller), mapped shared.

    Raises:
        OffloadError: ``path`` is not a regular file owned by this process's user with no
            group or other permission bits (another local user's file: mapping it would let
            them read or rewrite the weights). Nothing is written.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        why = not_own(os.fstat(fd), forbidden=0o077)  # [Note: own files] in dlo.io.files
        if why:
            raise OffloadError(
                f"node-shared memory {path} is not dlo's own ({why}; dlo's is mode 600): refused"
            )
        faults.check("host_share")
        os.posix_fallocate(fd, 0, nbytes)  # idempotent: every sharer sizes it, none truncates
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def pin_buffers(
    region: HostRegion,
    platform: Platform,
    *,
    budget_nbytes: int | None,
    require: bool,
    what: str,
    rank: int,
) -> None:
    """Page-lock every buffer of ``region`` within the budget; one that cannot be pinned
    (failed, over budget) is an error with ``require``, else stays pageable with a warning
    naming ``what`` (staging and read-ahead buffers)."""
    report = region.pin(platform, budget_nbytes=budget_nbytes, num_workers=1)
    if report.unpinned_blocks:
        msg = (
            f"{len(report.unpinned_blocks)} of {len(region.block_nbytes)} {what} could not be "
            f"pinned (failed: {len(report.failed_blocks)}, over pin_budget_gb: "
            f"{len(report.over_budget_blocks)})"
        )
        if require:
            raise OffloadError(msg, rank=rank)
        logger.warning("dlo: %s; they stay pageable", msg)
