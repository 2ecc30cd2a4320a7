"""The ring: streamed blocks taking turns in a few shared device slots.

[Note: ring protocol]
Each component's streamed blocks, across all its stacks, are a ring (the block after the
last is the first), in the order they run: learned on the component's first forward (see
[Note: prefetch chain] in :mod:`dlo.runtime.chain`). All rings of a pipeline share one
:class:`~dlo.runtime.slots.SlotPool` and one pair of streams. A block is IDLE (its tensors
are empty placeholders; its bytes live only in host shards), LOADED (a slot holds it, or a
load into that slot is enqueued) or RUNNING (its forward is executing with its tensors
rebound to views of the slot).

``enter(block)``, from the block's pre-forward hook:
  1. if IDLE, take a slot (a free one, else evict the least recently loaded LOADED block)
     and enqueue its load (a demand load: the producer that should have prefetched it was
     skipped, or this is the first block after a different ring ran);
  2. the compute stream waits on the slot's ``ready`` event (bracketed by two timing events
     on the compute stream: the gap is the exposed wait, measured without a host sync);
  3. the block's Parameters and buffers are rebound to views of the slot (``.data``
     assignment: the same Python objects, new storage);
  4. prefetch: the next ``num_slots - 1`` blocks of the same ring (in its learned order;
     across the seam between two stacks) are loaded into free (or evictable) slots, never
     evicting the running block or the window itself.

``exit(block)``, from the post-forward hook (also called when forward raised):
  rebind placeholders, record the slot's ``free`` event on the compute stream; the block stays
  LOADED in its slot (see [Note: kept after exit]). The copy stream waits on ``free`` before
  overwriting the slot, so a slot is never reused while kernels reading it are queued.

[Note: kept after exit]
A block that ran keeps its slot until a load needs it: eviction takes the least recently
used slot, those whose block ran first (a prefetched block that has not run yet is the next
forward's), so in a plain denoise loop the slots turn over exactly as if the block were
released at exit. What it saves is the load of a block that runs again before its slot is
taken: a step cache's first block (FirstBlockCache runs block 0 every step and skips the
rest on most: block 0 is then loaded once, not once a step), and a ring no longer than the
slots (loaded once). The evicted slot's ``free`` is the compute stream's event of its exit;
a prefetched block evicted before it ran (the forward skipped it) is counted as a wasted
load and its slot's ``free`` is recorded on its writer stream, after that load. A kept block
that runs again waits on its slot's ``free`` first (its last run may have been on another
stream, whose kernels the next load into the slot would otherwise not wait for), and a block
whose in-place writes could not be kept gives its slot up at exit (it loads again from the
host, as before the write).

Every decision depends only on the sequence of hook calls, so ranks that run the same block
sequence issue the same loads (and collectives) in the same order. No step waits on the
host: hooks only enqueue work and make streams wait on events.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch import nn

from dlo import faults
from dlo.errors import BackendPoisonedError, ForwardRefused, InjectedFault, OffloadError
from dlo.hooks.dispatch import ModelHook
from dlo.host.shards import placeholder, shard_view, written_tensors
from dlo.io.header_checks import CheckpointError
from dlo.plan.host_tiers import READ_AHEAD_BUFFERS as READ_AHEAD
from dlo.platform.device import Platform
from dlo.platform.timing import StreamTimer, nvtx_range
from dlo.runtime.chain import learn
from dlo.runtime.guard import Guard, every_claim
from dlo.runtime.slots import Slot, SlotPool
from dlo.runtime.streamed import IDLE, LOADED, RUNNING, BlockRing, StreamedBlock

logger = logging.getLogger(__name__)


class _BlockHook(ModelHook):
    def __init__(self, scheduler: RingScheduler, block: StreamedBlock) -> None:
        self.scheduler = scheduler
        self.block = block

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.scheduler.enter(self.block, args, kwargs)
        return None

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        lost = self.scheduler.exit(self.block, failed=output is None)
        if lost:
            raise OffloadError(
                f"the block wrote its streamed tensor(s) {', '.join(lost)} in place, and "
                "this backend cannot keep the write (with AllGather each rank holds only a "
                "slice of the block; host_backing='mapped' streams from the read-only "
                "checkpoint; with node-shared the node's other ranks stream the same host "
                "copy; with a codec the host copy is encoded): keep such state out of the "
                "block's parameters and buffers, keep the block resident (resident_layers), "
                "or use transfer='rank-local' with codec='none'",
                rank=self.scheduler.rank,
                block=self.block.name,
            )
        return output


class RingScheduler:
    """Runs the ring protocol for every ring of one backend (see [Note: ring protocol])."""

    def __init__(
        self,
        platform: Platform,
        pool: SlotPool,
        *,
        rank: int,
    ) -> None:
        self.platform = platform
        self.pool = pool
        self.rank = rank
        self.rings: list[BlockRing] = []
        self.guard = Guard(platform, rank=rank, what="block", on_stale=self._release_stale)
        """One block runs at a time (see :mod:`dlo.runtime.guard`)."""
        self._clock = 0
        self.poisoned: str | None = None
        self.caches: Any = None
        """The step caches its ring hooks follow (:class:`dlo.hooks.step_caches.StepCaches`)."""

    # ------------------------------------------------------------------ setup
    def add_ring(self, ring: BlockRing) -> None:
        for b in ring.blocks:
            b.views = self._all_views(b)
            b.placeholders = [placeholder(t, self.platform.device) for t in b.tensors]
            b.wait = StreamTimer(self.platform)
        self.rings.append(ring)

    def refresh_views(self) -> None:
        """Every block's views of the pool's slots, after the pool was resized."""
        for ring in self.rings:
            for b in ring.blocks:
                b.views = self._all_views(b)

    def _all_views(self, block: StreamedBlock) -> list[list[torch.Tensor]]:
        """``block``'s views of every slot; none where it is larger than a slot (a re-plan
        pins such a block: it never loads into one)."""
        if block.layout.padded_nbytes > self.pool.slot_nbytes:
            return []
        return [self._views(block, slot) for slot in self.pool.slots]

    def _views(self, block: StreamedBlock, slot: Slot) -> list[torch.Tensor]:
        return [shard_view(slot.buffer, spec) for spec in block.layout.tensors]

    def hook_for(self, block: StreamedBlock) -> ModelHook:
        return _BlockHook(self, block)

    def preload(self) -> None:
        """Load the first block of each ring while free slots last (block 0 is on the
        device before the first forward)."""
        for ring in self.rings:
            first = next((b for b in ring.blocks if b.own is None), None)
            if first is None:
                continue
            slot = self._free_slot()
            if slot is None:
                break
            if first.state == IDLE:
                self._load(first, slot)

    def unbind_all(self) -> None:
        """Return every block to IDLE with placeholders (teardown; device synchronized)."""
        for ring in self.rings:
            for b in ring.blocks:
                if b.state == RUNNING:
                    self._rebind(b, b.placeholders)
                b.state, b.slot = IDLE, None
        for s in self.pool.slots:
            s.owner = None
        self.guard.clear()

    def close(self) -> None:
        """Teardown after :meth:`unbind_all`: drop every block's slot views and placeholders
        and its back-reference to its ring. A ring and its blocks reference each other, so
        without this the views would keep the slots' device memory until the garbage
        collector ran, long after the pool released its buffers."""
        for ring in self.rings:
            ring.replanner = None
            for b in ring.blocks:
                b.views, b.placeholders, b.ring, b.own, b.own_views = [], [], None, None, []
        self.guard.on_stale = None  # a bound method of this scheduler
        self.caches = None

    # ------------------------------------------------------------------ hot path
    def enter(self, block: StreamedBlock, args: tuple, kwargs: dict) -> None:
        self._claim(block, args, kwargs)
        try:
            self._activate(block, args, kwargs)
            faults.check("block_forward")  # tests: a failure inside the block, prefetch in flight
        except BaseException as e:
            # this hook's own post-forward will not run (its pre-forward did not complete):
            # release the block here so the ring stays sound for the next forward
            self._abandon(block, e)
            if isinstance(e, (OffloadError, InjectedFault)) or not isinstance(e, Exception):
                raise  # InjectedFault: an injected "user error inside the block"
            raise OffloadError(f"loading failed: {e!r}", rank=self.rank, block=block.name) from e

    def _claim(self, block: StreamedBlock, args: tuple, kwargs: dict) -> None:
        """Claim the ring for ``block``'s forward through the guard, or refuse it."""
        if self.poisoned is not None:
            raise BackendPoisonedError(self.poisoned, rank=self.rank, block=block.name)
        busy = self.guard.claim(block, block.name, conflicts=every_claim)
        if self.poisoned is not None:  # a released stale claim poisoned a gathering ring
            self.guard.release(block)
            raise BackendPoisonedError(self.poisoned, rank=self.rank, block=block.name)
        if busy:
            running = busy[0]
            where = (
                "re-entrant call" if running.thread == threading.get_ident() else "another thread"
            )
            raise OffloadError(
                f"forward of this block started while block {running.name!r} is still "
                f"running ({where}); dlo's ring serves one forward at a time",
                rank=self.rank,
                block=block.name,
            )
        try:
            self.guard.refuse_unsupported(block.name, block.tensors, args, kwargs)
        except BaseException:
            self.guard.release(block)
            raise

    def _activate(self, block: StreamedBlock, args: tuple, kwargs: dict) -> None:
        """Steps 1-4 of [Note: ring protocol]: load on demand, wait, rebind, prefetch (a
        pinned block is on the device already)."""
        ring = block.ring
        assert ring is not None
        learn(ring.order, block, block.transport.agree, ring.name)
        if ring.replanner is not None:
            ring.replanner.entering(args, kwargs, block.name, key=block)
        if block.own is not None:
            # [ready] producer: the transport, at the pin's load (a re-plan's, not waited
            # for there); consumer: compute stream. Recorded once: later waits are free
            self.platform.current_stream().wait_event(block.own.ready)
            self._rebind(block, block.own_views)
        else:
            if block.state == IDLE:
                block.num_demand_loads += 1
                slot = self._acquire(block, protect=())
                assert slot is not None, "no slot to evict while nothing runs"
                self._load(block, slot)
            slot = block.slot
            assert slot is not None
            if slot.used:  # kept after its last run, maybe on another stream: after it
                self.platform.current_stream().wait_event(slot.free)
            self._wait(block, slot, self.platform.current_stream())
            self._rebind(block, block.views[slot.index])
        block.versions = [t._version for t in block.tensors]
        block.state = RUNNING
        block.num_runs += 1
        self._prefetch(block)

    def _abandon(self, block: StreamedBlock, e: BaseException) -> None:
        """Release ``block`` after ``e`` ended its enter; poison the ring where the group may
        be out of step."""
        if block.state == RUNNING:
            self.exit(block)
        else:
            self.guard.release(block)
        if block.state == LOADED and block.slot is not None:
            # its load failed (or was never waited for): the slot holds nothing usable
            block.slot.owner, block.slot, block.state = None, None, IDLE
        if not isinstance(e, Exception):
            # KeyboardInterrupt (or another BaseException) inside dlo's own loading: a
            # prefetch may be half enqueued, and a rank of a gathering group has left the
            # group's collective sequence midway
            self.drop_loaded()
            if self.gathers():
                self.poisoned = (
                    f"interrupted ({type(e).__name__}) while loading weights with a "
                    "collective; the group is out of step: recreate the worker"
                )
        elif not isinstance(e, (InjectedFault, ForwardRefused)) and block.transport.group_size > 1:
            # the group may be misaligned now: no further weight collective is safe
            self.poisoned = f"a transfer failed after startup ({e}); recreate the worker"

    def drop_loaded(self) -> None:
        """Forget every loaded (not running) block: its slot is free and it loads again."""
        for ring in self.rings:
            for b in ring.blocks:
                if b.state == LOADED and b.slot is not None:
                    b.num_wasted_loads += not b.slot.used
                    b.slot.owner, b.slot, b.state = None, None, IDLE

    def gathers(self) -> bool:
        """Whether any block's load takes part in a collective (group size > 1)."""
        return any(b.transport.group_size > 1 for ring in self.rings for b in ring.blocks)

    def _release_stale(self, running: StreamedBlock) -> None:
        """Release the block of a stale claim (see :class:`~dlo.runtime.guard.Guard`) as
        after an exception (the guard holds its lock). A ring that gathers is poisoned: ranks
        interrupted at different blocks no longer load in lock step (their prefetched blocks
        differ)."""
        lost = self._unload(running)
        if lost:
            logger.warning(
                "dlo: the interrupted block %s wrote %s in place; not kept", running.name, lost
            )
        if self.gathers():
            self.poisoned = (
                f"block {running.name!r} was interrupted inside its forward while the ranks "
                "gather weights; the group is out of step: recreate the worker"
            )

    def begin_disable(self) -> None:
        """Refused while another thread runs a block (see
        :meth:`~dlo.runtime.guard.Guard.begin_disable`); then every later forward is."""
        self.guard.begin_disable()

    def exit(self, block: StreamedBlock, *, failed: bool = False) -> list[str]:
        """Release the running ``block``; returns the names of tensors it wrote in place that
        could not be kept (see [Note: writes into streamed tensors])."""
        if not self.guard.held_by_me(block):
            return []  # this call's enter refused or never ran
        lost = self._unload(block)
        self.guard.release(block)
        if block.ring is not None and block.ring.replanner is not None:
            block.ring.replanner.exited(block.name, failed=failed)
        return lost

    def _unload(self, block: StreamedBlock) -> list[str]:
        """:meth:`exit`'s work on the block and its slot, for the claim's owner or for a
        stale claim."""
        lost = self._keep_writes(block)
        self._rebind(block, block.placeholders)
        if block.own is not None:  # [free]: as a slot's, before a re-plan frees the buffer
            block.own.free.record(self.platform.current_stream())
            block.state = IDLE
            return lost
        slot = block.slot
        assert slot is not None
        # [free] producer: compute stream, after the block's kernels; consumer: copy stream
        slot.free.record(self.platform.current_stream())
        self._clock += 1
        if lost:  # the slot holds writes no host copy has: it loads again from the host
            slot.owner, slot.stamp = None, self._clock
            block.slot, block.state = None, IDLE
            return lost
        slot.stamp, slot.used = self._clock, True
        block.state = LOADED  # [Note: kept after exit]
        return lost

    def _keep_writes(self, block: StreamedBlock) -> list[str]:
        """Copy the tensors ``block`` wrote in place back into its whole-block host shard;
        returns the names of written tensors that have no such shard to go to."""
        written = written_tensors(block.layout.tensors, block.tensors, block.versions)
        return block.keep_writes(written) if written else []

    # ------------------------------------------------------------------ internals
    def _rebind(self, block: StreamedBlock, tensors: list[torch.Tensor]) -> None:
        for t, new in zip(block.tensors, tensors):
            t.data = new

    def _wait(self, block: StreamedBlock, slot: Slot, compute: Any) -> None:
        assert block.wait is not None
        block.wait.begin(compute)
        with nvtx_range("dlo::wait"):
            # a staged load records ready from its filler thread: wait (on the host, only
            # when the filler is behind) until it has (see [Note: staged ready])
            block.transport.wait_enqueued(slot.index, block.name)
            # [ready] producer: transport writer stream; consumer: compute stream
            compute.wait_event(slot.ready)
        block.wait.end(compute)

    def harvest_all(self) -> None:
        """Collect every pending wait measurement (setup/stats path: may block)."""
        for ring in self.rings:
            for b in ring.blocks:
                assert b.wait is not None
                b.wait.harvest(block_host=True)

    def _free_slot(self) -> Slot | None:
        free = [s for s in self.pool.slots if s.owner is None]
        return min(free, key=lambda s: s.stamp) if free else None

    def _acquire(self, block: StreamedBlock, protect: tuple[StreamedBlock, ...]) -> Slot | None:
        slot = self._free_slot()
        if slot is not None:
            return slot
        victims = [
            s
            for s in self.pool.slots
            if s.owner is not None and s.owner.state == LOADED and s.owner not in protect
        ]
        if not victims:
            return None
        slot = min(victims, key=lambda s: (not s.used, s.stamp))  # blocks that ran first
        logger.debug("evict %s from slot %d for %s", slot.owner.name, slot.index, block.name)
        self.evict(slot)
        return slot

    def evict(self, slot: Slot) -> None:
        """Free ``slot`` of its LOADED block (see [Note: kept after exit])."""
        evicted: StreamedBlock = slot.owner
        if not slot.used:  # a load that never ran
            evicted.num_wasted_loads += 1
            # [free] producer: the evicted load's writer stream; consumer: the next load
            slot.free.record(evicted.transport.writer_stream)
        evicted.state, evicted.slot = IDLE, None
        slot.owner = None

    def _load(self, block: StreamedBlock, slot: Slot) -> None:
        self._clock += 1
        slot.owner, slot.stamp, slot.used = block, self._clock, False
        block.slot, block.state = slot, LOADED
        try:
            block.transport.load(
                block.layout,
                block.shard,
                slot.buffer,
                free_event=slot.free,
                ready_event=slot.ready,
                index=block.index,
                slot_index=slot.index,
            )
        except (OffloadError, CheckpointError, OSError) as e:  # its disk read failed
            slot.owner, block.slot, block.state = None, None, IDLE
            if block.transport.group_size > 1:  # its peers gather it: out of step now
                self.poisoned = f"a transfer of {block.name} failed ({e}); recreate the worker"
            raise OffloadError(f"loading failed: {e!r}", rank=self.rank, block=block.name) from e

    def _prefetch(self, block: StreamedBlock) -> None:
        ring = block.ring
        assert ring is not None
        size = len(self.pool.slots) - 1
        # the next blocks that stream, past the pinned ones: loaded into free slots, read
        # further ahead by a disk tier (see [Note: disk read-ahead]: past the window, evicted)
        ahead = [b for b in ring.order.after(block, len(ring.blocks)) if b.own is None]
        window = ahead[: max(size, 0)]
        soon = [b for b in window if b.state == IDLE] + ahead[len(window) : size + READ_AHEAD]
        for t in {id(b.transport): b.transport for b in ring.blocks}.values():  # each its own
            t.upcoming([b.shard for b in soon if b.transport is t])
        protect = (block, *window)
        for nxt in window:
            if nxt.state != IDLE:
                continue
            slot = self._acquire(nxt, protect)
            if slot is None:
                return
            self._load(nxt, slot)
