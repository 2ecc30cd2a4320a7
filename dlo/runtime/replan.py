"""Re-planning a ring between its forwards: pinning and unpinning its blocks, resizing the
slots ([Note: re-plan between forwards] in :mod:`dlo.plan.replan`, whose pure model decides).

A :class:`Replanner` watches one DiT's blocks (its ring's, and the resident ones enable kept
through :class:`ResidentBlockHook`; no hook goes on the DiT itself, whose ``compile()`` would
then suppress its blocks' hooks). The first block the first forward enters is the DiT's
first block, and the block that exited just before it entered again its last: each later
entry of the first block begins a forward. There it reads the device allocator, closes the
last forward's sample (the peak when its last block exited), agrees on the room with the
ranks that load the blocks together (one small collective of the weight group, only where
the ring gathers), and applies the plan the model gives before the block runs:

1. local and fallible: unpin (free), resize the slots, allocate every new pin's buffer;
2. where the ring gathers, the ranks agree that step 1 succeeded everywhere (one more small
   collective), else every rank falls back to enable's plan and stops re-planning;
3. load the new pins, in ring order (the same loads on every rank), without waiting: a
   pinned block's compute waits for its own buffer's ``ready`` event.

Nothing here runs inside a forward's blocks, nor while another thread's block runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from dlo.errors import ForwardRefused, OffloadError
from dlo.hooks.dispatch import ModelHook
from dlo.host.shards import shard_view
from dlo.plan import replan
from dlo.plan.policy_explain import replan_line
from dlo.platform.device import MemoryNow, Platform
from dlo.runtime.collectives import all_gather_objects
from dlo.runtime.guard import every_claim
from dlo.runtime.ring import RingScheduler
from dlo.runtime.slots import Slot, resize
from dlo.runtime.streamed import LOADED, RUNNING, BlockRing

logger = logging.getLogger(__name__)


def input_elements(args: tuple, kwargs: dict) -> int:
    """The floating-point elements of a block's inputs (nested in tuples, lists and dicts)."""
    total, stack = 0, [*args, *kwargs.values()]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() if x.is_floating_point() else 0
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return total


class Replanner:
    """Re-plans ``ring`` of ``scheduler`` (see the module docstring).

    Args:
        drain: waits until every enqueued load was issued (the staged transport's), or
            nothing.
        keep_slots: the slot count was given explicitly: the slots are never resized.
        rank: for errors and logs.
    """

    def __init__(
        self,
        platform: Platform,
        scheduler: RingScheduler,
        ring: BlockRing,
        *,
        drain: Callable[[], None],
        keep_slots: bool,
        rank: int,
    ) -> None:
        self.platform, self.scheduler, self.ring = platform, scheduler, ring
        self.drain, self.rank = drain, rank
        self.blocks = [replan.Block(b.name, b.layout.padded_nbytes) for b in ring.blocks]
        pool = scheduler.pool
        self.num_slots, self.enable_slot_nbytes = len(pool.slots), pool.slot_nbytes
        self.symmetric = pool.base is not None  # one allocation, outside the allocator
        self.resizable = not self.symmetric and not keep_slots
        self.plan = replan.Plan(frozenset(), self.num_slots, pool.slot_nbytes)
        gathering = [b.transport for b in ring.blocks if b.transport.group_size > 1]
        self.group = getattr(gathering[0], "group", None) if gathering else None
        self.seen = replan.Observed()
        self.records: list[dict[str, Any]] = []
        self.late: Any = None
        """The ring's :class:`~dlo.runtime.late_codec.LateCodec`, if its codec may be turned
        on by measurement."""
        self.forwards = 0
        self.first: str | None = None
        self.last: str | None = None
        self._last_exit: str | None = None
        self._start: tuple[int, int, int] | None = None
        """The forward running: (elements, allocated, peak) at its first block's entry."""
        self._sample: replan.ForwardSample | None = None
        self._end_movable = 0
        """Every ring's movable bytes when the sampled forward ended."""
        mem = platform.memory_now()
        self._off = mem is None  # no allocator statistics: enable's plan stays
        self._peak_base = mem.peak if mem is not None else 0
        """The peak at the last re-plan point (at enable first): a peak that did not rise
        above it in the interval since is no evidence (it may predate enable, or another
        interval's movable bytes); a lower one means the user reset it."""
        ring.replanner = self

    def pin_initial(self, names: frozenset[str]) -> None:
        """At enable: pin as many of the ring's blocks as the bytes of those among ``names``
        (the blocks the policy chose to keep on the device) and their slots allow, chosen as
        a re-plan chooses them (:func:`dlo.plan.replan.choose`: spread over the ring, so a
        streamed block's copy overlaps the compute of the pinned ones before it, and a later
        re-plan that pins more keeps these and loads only the new ones); the slots sized for
        the others (none where none streams)."""
        kept = frozenset(b.name for b in self.blocks if b.name in names)
        if not kept:
            return
        assert self.resizable, "pins at enable only where the slots follow them (replan_setup)"
        largest = self._largest(kept)
        room = replan.Plan(kept, self.num_slots if largest else 0, largest).movable(self.blocks)
        plan = replan.choose(
            self.blocks, room, num_slots=self.num_slots, floor_slot_nbytes=self._floor()
        )
        if not plan.pinned:
            return
        with torch.inference_mode(False):
            self._allocate(plan)
            self._load_pins(plan)
        self.plan = plan
        mem = self.platform.memory_now()
        if mem is not None:  # the pins' loads are no forward's evidence
            self._peak_base = mem.peak

    # ------------------------------------------------------------------ events
    def entering(self, args: tuple, kwargs: dict, name: str, key: Any = None) -> None:
        """Block ``name`` enters (``key``: its ring claim, if it streams); the first block of
        a forward re-plans."""
        if self._off and self.late is None:
            return
        if self.first is None:
            self.first = name  # the first forward's first block
        elif name != self.first:
            return
        elif self.last is None:
            self.last = self._last_exit
        sched, me = self.scheduler, self if key is None else None
        # a resident first block holds no ring claim: the re-plan takes one of its own
        if sched.poisoned is not None or (
            me is not None and sched.guard.claim(me, name, every_claim)
        ):
            self._start = None  # poisoned, or another thread's block runs: no re-plan
            return
        try:
            if any(c.key is not key and c.key is not me for c in sched.guard.claims):
                self._start = None
                return
            self._at_first_block(args, kwargs, name)
        finally:
            if me is not None:
                sched.guard.release(me)

    def _at_first_block(self, args: tuple, kwargs: dict, name: str) -> None:
        if self.late is None:
            self._plan_forward(args, kwargs, name)
            return
        with self.late.device_lock:  # the late codec's encode holds no device memory now
            self._plan_forward(args, kwargs, name)

    def _plan_forward(self, args: tuple, kwargs: dict, name: str) -> None:
        # [Note: codec turned on by measurement]: its encode's and switch's device memory
        # is no forward's evidence
        quiet = self.late is None or self.late.forward_starts(self.forwards + 1)
        mem = self.platform.memory_now()
        if self._off or mem is None:
            self.forwards += 1
            return
        elements = input_elements(args, kwargs)
        if self.forwards:
            seen = self.seen
            if quiet:
                peak = mem.peak if mem.peak != self._peak_base else None
                # what the pool's rings pinned or sized since this forward ended is no work
                # after it
                moved = self._movable(self.scheduler.rings) - self._end_movable
                seen = replan.observe(
                    self.seen, self._sample, peak, self._movable(), mem.allocated, moved=moved
                )
            self._replan(name, elements, mem, seen)
            mem = self.platform.memory_now() or mem
        self._sample = None
        self.forwards += 1
        self._start = (elements, mem.allocated, mem.peak)
        self._peak_base = mem.peak

    def exited(self, name: str, *, failed: bool = False) -> None:
        """Block ``name`` exited (``failed``: its forward raised): the forward's last block
        samples its peak (every block of the first forward, whose last block is not known
        yet). A forward that raised gives no sample, and a first one that raised teaches
        nothing: the next forward is the first again."""
        if failed:
            if self.late is not None:
                self.late.timings.abort()
            self._start, self._sample = None, None
            if self.last is None:
                self.first, self.forwards, self._last_exit = None, 0, None
            return
        self._last_exit = name
        if self.late is not None and name == self.last:
            self.late.forward_ends()
        if self._start is None or (self.last is not None and name != self.last):
            return
        mem = self.platform.memory_now()
        if mem is not None:
            e, allocated, peak = self._start
            self._sample = replan.ForwardSample(e, allocated, peak, mem.peak, mem.allocated)
            self._end_movable = self._movable(self.scheduler.rings)
        if self.last is not None:
            self._start = None

    # ------------------------------------------------------------------ deciding
    def _movable(self, rings: list[BlockRing] | None = None) -> int:
        """The device bytes a re-plan changes, read from what is allocated: the pinned
        buffers of this ring (or of ``rings``: every ring of the pool, another DiT's pins
        too) and the slots (unless symmetric: outside the allocator)."""
        own = sum(
            b.layout.padded_nbytes
            for r in (rings if rings is not None else [self.ring])
            for b in r.blocks
            if b.own is not None
        )
        return own + (0 if self.symmetric else self.scheduler.pool.nbytes)

    def _largest(self, pinned: frozenset[str]) -> int:
        """The slot size the ring needs with ``pinned`` pinned: its largest other block, or
        what other rings of the pool still stream."""
        return max([self._floor(), *(b.nbytes for b in self.blocks if b.name not in pinned)])

    def _floor(self) -> int:
        """The largest block other rings of the pool still stream."""
        others = [r for r in self.scheduler.rings if r is not self.ring]
        return max(
            (b.layout.padded_nbytes for r in others for b in r.blocks if b.own is None),
            default=0,
        )

    def _replan(self, name: str, elements: int, mem: MemoryNow, seen: replan.Observed) -> None:
        pool = self.scheduler.pool
        # another DiT's re-plan may have resized the shared slots
        self.plan = replan.Plan(self.plan.pinned, len(pool.slots), pool.slot_nbytes)
        room = replan.room(
            seen, elements, allocated=mem.allocated, movable=self._movable(), limit=mem.limit
        )
        if self.group is not None:  # the ranks that gather these blocks decide together
            with self.platform.device_context():
                room = replan.worst(all_gather_objects(room, self.group))
        floor = self._floor()
        fixed = 0 if self.resizable or self.symmetric else pool.nbytes
        least = max([floor, *(b.nbytes for b in self.blocks)]) if self.resizable else fixed
        try:
            replan.check_fits(room, least)
        except replan.Refusal as e:
            self._peak_base = mem.peak  # its prologue's peak is no evidence either
            raise ForwardRefused(str(e), rank=self.rank, block=name) from None
        self.seen = seen
        if room.movable_room is not None and fixed:
            room = replan.Room(room.movable_room - fixed, room.refuse_need, room.limit)
        if self.resizable:
            new = replan.next_plan(
                self.plan, self.blocks, room, num_slots=self.num_slots, floor_slot_nbytes=floor
            )
            if room.refuse_need is None and not new.pinned and new.num_slots < self.num_slots:
                new = replan.Plan(frozenset(), self.num_slots, self._largest(frozenset()))
            need = self._largest(new.pinned)  # a block that streams fits its slot
            if need > new.slot_nbytes:
                new = replan.Plan(new.pinned, new.num_slots or self.num_slots, need)
        else:  # the slots stay as they are: only pins change
            fixed_plan = replan.Plan(self.plan.pinned, 0, 0)
            new = replan.next_plan(fixed_plan, self.blocks, room, num_slots=0, floor_slot_nbytes=0)
            new = replan.Plan(new.pinned, len(pool.slots), pool.slot_nbytes)
        if not replan.unchanged(self.plan, new):
            record = self._record(elements, room, self.plan, new)
            t0 = time.perf_counter()
            if self.late is not None:
                self.late.replanned()
            self._apply(new)
            record["ms"] = (time.perf_counter() - t0) * 1e3  # to apply it: loads issued, not done
            (logger.info if self.rank == 0 else logger.debug)("%s", replan_line(record))

    def _record(
        self, elements: int, room: replan.Room, before: replan.Plan, new: replan.Plan
    ) -> dict[str, Any]:
        more, fewer = len(new.pinned) > len(before.pinned), len(new.pinned) < len(before.pinned)
        record = {
            "component": self.ring.name,
            "forward": self.forwards + 1,
            "elements": elements,
            "pinned": len(new.pinned),
            "streamed": len(self.blocks) - len(new.pinned),
            "num_slots": new.num_slots,
            "slot_nbytes": new.slot_nbytes,
            "movable_room_nbytes": room.movable_room,
            "limit_nbytes": room.limit,
            "action": "pin" if more else "unpin" if fewer else "slots",
        }
        self.records.append(record)
        return record

    # ------------------------------------------------------------------ applying
    def _apply(self, new: replan.Plan) -> None:
        """Steps 1-3 of the module docstring. Buffers are made outside inference_mode (the
        forward may run under it; an inference tensor's in-place writes bump no version
        counter, and [Note: writes into streamed tensors] could not see them)."""
        ok, error = True, None
        try:
            with torch.inference_mode(False):
                self._allocate(new)
        except Exception as e:  # an allocation the model misjudged, on this rank
            ok, error = False, e
        except BaseException:  # ^C: a gathering group is out of step
            if self.group is not None:
                self.scheduler.poisoned = "interrupted while re-planning a gathering ring"
            raise
        if self.group is not None:
            with self.platform.device_context():
                ok = all(all_gather_objects(ok, self.group))
        if not ok:
            self._fall_back(error)
            return
        try:
            with torch.inference_mode(False):
                self._load_pins(new)
        except BaseException as e:
            self.platform.synchronize()  # no copy still writes a buffer dropped below
            for b in self.ring.blocks:  # pins without their bytes: stream them again
                if b.own is not None and not b.own_views:
                    b.own = None
            self.ring.num_pinned = sum(b.own is not None for b in self.ring.blocks)
            pinned = frozenset(b.name for b in self.ring.blocks if b.own is not None)
            pool = self.scheduler.pool
            self.plan = replan.Plan(pinned, len(pool.slots), pool.slot_nbytes)
            if self.group is not None:
                self.scheduler.poisoned = f"loading re-planned blocks failed ({e!r})"
            raise
        self.plan = new

    def _load_pins(self, new: replan.Plan) -> None:
        """Issue the new pins' loads (every one enqueued: a staged transport's drained); their
        views (what makes the ring use them) only once every load is issued. Nothing waits
        here: a pinned block's compute waits for its buffer's ``ready`` (the ring's step 2),
        so the loads overlap the forward's first blocks instead of stalling before them."""
        loaded = []
        for b in self.ring.blocks:  # in ring order: the same loads on every rank
            if b.own is not None and b.name in new.pinned and not b.own_views:
                b.transport.load(
                    b.layout,
                    b.shard,
                    b.own.buffer,
                    free_event=b.own.free,
                    ready_event=b.own.ready,
                    index=b.index,
                )
                loaded.append(b)
        self.drain()
        for b in loaded:
            assert b.own is not None
            b.own_views = [shard_view(b.own.buffer, spec) for spec in b.layout.tensors]

    def _allocate(self, new: replan.Plan) -> None:
        """Free what ``new`` unpins, re-create the slots, allocate (not load) new pins."""
        pf, pool, sched = self.platform, self.scheduler.pool, self.scheduler
        resized = (new.num_slots, new.slot_nbytes) != (len(pool.slots), pool.slot_nbytes)
        unpinned = [b for b in self.ring.blocks if b.name not in new.pinned and b.own is not None]
        self.drain()  # every staged load issued (a failed prefetch raises here, not later)
        if unpinned or resized or self.group is not None:
            pf.synchronize()  # every queued reader of a buffer freed here is done
            # every rank's ring in the same state whatever it allocated (prefetched blocks
            # load again): the fallback after another rank failed must match. Where only
            # pins are added on a ring of its own, the loaded blocks keep their slots and
            # nothing waits: the device goes on with the last forward's tail meanwhile
            sched.drop_loaded()
        for b in unpinned:
            b.own, b.own_views = None, []
        self.ring.num_pinned = sum(b.own is not None for b in self.ring.blocks)
        if resized:
            pool.release()
            sched.refresh_views()  # no slots: the old buffers' views go too
        if unpinned or resized:  # whole segments back to the device before anything new is
            pf.empty_cache()  # made: under a cap any size may use them
        if resized:
            resize(pool, new.num_slots, new.slot_nbytes)
            sched.refresh_views()
        for b in self.ring.blocks:
            if b.name in new.pinned and b.own is None and b.state != RUNNING:
                if b.state == LOADED and b.slot is not None:  # its slot is free for others
                    # after its load (maybe in flight: nothing synchronized) or its last run
                    sched.evict(b.slot)
                buffer = torch.empty(b.layout.padded_nbytes, dtype=torch.uint8, device=pf.device)
                b.own = Slot(-1, buffer, pf.new_event(), pf.new_event())
                # [free] producer: the compute stream, now: the buffer may be memory its
                # queued kernels just freed, and the load waits on this before writing it
                b.own.free.record(pf.current_stream())
                self.ring.num_pinned += 1

    def _fall_back(self, error: BaseException | None) -> None:
        """Some rank could not allocate the plan: every rank streams every block of the ring
        (no pins, enable's slots: the kept blocks enable pinned too, the plan that surely
        fits) and stops re-planning."""
        self._off = True
        logger.warning(
            "dlo: a re-plan of %s could not allocate on %s (%r): back to enable's plan, no "
            "further re-plans",
            self.ring.name or "the model",
            "this rank" if error is not None else "another rank",
            error,
        )
        slot = max(self.enable_slot_nbytes, self._largest(frozenset()))  # every block streams
        try:
            with torch.inference_mode(False):
                self._allocate(replan.Plan(frozenset(), self.num_slots, slot))
        except BaseException as e:
            self.scheduler.poisoned = f"a re-plan failed and could not be undone ({e!r})"
            raise OffloadError(self.scheduler.poisoned, rank=self.rank) from e
        self.plan = replan.Plan(frozenset(), len(self.scheduler.pool.slots), slot)

    def close(self) -> None:
        """Unpin every block (disable; the device synchronized)."""
        self.platform.synchronize()
        for b in self.ring.blocks:
            b.own, b.own_views = None, []
        self.ring.num_pinned = 0
        self.ring.replanner = None


class ResidentBlockHook(ModelHook):
    """On each resident block of the DiT: the forward's first (or last) block may be one."""

    def __init__(self, replanner: Replanner, name: str) -> None:
        self.replanner, self.name = replanner, name

    def pre_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.replanner.entering(args, kwargs, self.name)
        return None

    def post_forward(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        self.replanner.exited(self.name, failed=output is None)
        return output
