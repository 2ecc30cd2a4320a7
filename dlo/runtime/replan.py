"""Re-planning a ring between its forwards: pinning and unpinning its blocks, resizing the
slots ([Note: re-plan between forwards] in :mod:`dlo.plan.replan`, whose pure model decides).

A :class:`Replanner` watches one DiT's ring. When the DiT's forward begins it arms; at the
entry of the forward's first block (a resident one included: enable keeps the leading blocks)
it reads the device allocator, closes the last forward's sample, agrees on the room with the
ranks that load its blocks together (one small collective of the weight group, only where the
ring gathers), and applies the plan the model gives: unpin, resize the slots, pin, with the
device synchronized around it, before the block runs. When the DiT's forward returns it reads
the peak the forward reached. Nothing here runs inside a forward's blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from dlo.errors import OffloadError
from dlo.hooks.dispatch import ModelHook
from dlo.host.shards import shard_view
from dlo.plan import replan
from dlo.platform.device import MemoryNow, Platform
from dlo.runtime.collectives import all_gather_objects
from dlo.runtime.ring import RingScheduler
from dlo.runtime.slots import Slot, resize
from dlo.runtime.streamed import IDLE, LOADED, BlockRing, StreamedBlock

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
        rank: for errors and logs.
    """

    def __init__(
        self,
        platform: Platform,
        scheduler: RingScheduler,
        ring: BlockRing,
        *,
        drain: Callable[[], None],
        rank: int,
    ) -> None:
        self.platform, self.scheduler, self.ring = platform, scheduler, ring
        self.drain, self.rank = drain, rank
        self.blocks = [replan.Block(b.name, b.layout.padded_nbytes) for b in ring.blocks]
        self.by_name = {b.name: b for b in ring.blocks}
        pool = scheduler.pool
        self.num_slots = len(pool.slots)
        self.resizable = pool.base is None  # symmetric slots are one allocation
        self.enable_slot_nbytes = pool.slot_nbytes
        self.plan = replan.Plan(frozenset(), self.num_slots, pool.slot_nbytes)
        gathering = [b.transport for b in ring.blocks if b.transport.group_size > 1]
        self.group = getattr(gathering[0], "group", None) if gathering else None
        self.seen = replan.Observed()
        self.records: list[dict[str, Any]] = []
        self.forwards = 0
        self._start: tuple[int, int, int] | None = None
        """The forward running: (elements, allocated, peak) at its first block's entry."""
        self._sample: replan.ForwardSample | None = None
        self._off = False
        self._armed = False
        ring.replanner = self

    # ------------------------------------------------------------------ events
    def started(self) -> None:
        """The DiT's forward began (its pre-forward hook)."""
        self._armed, self._start = not self._off, None

    def entering(self, args: tuple, kwargs: dict, name: str) -> None:
        """Block ``name`` is entering (streamed or resident): the forward's first re-plans."""
        if not self._armed:
            return
        self._armed = False
        mem = self.platform.memory_now()
        if mem is None:
            self._off = True  # no allocator statistics: enable's plan stays
            return
        elements = input_elements(args, kwargs)
        if self.forwards:
            movable = self.plan.movable(self.blocks)
            self.seen = replan.observe(self.seen, self._sample, mem.peak, movable)
            self._replan(name, elements, mem)
            mem = self.platform.memory_now() or mem
        self._sample = None
        self.forwards += 1
        self._start = (elements, mem.allocated, mem.peak)

    def ended(self) -> None:
        """The DiT's forward returned (its post-forward hook): the peak it reached."""
        self._armed = False
        if self._start is None:
            return
        mem = self.platform.memory_now()
        if mem is not None:
            e, allocated, peak = self._start
            self._sample = replan.ForwardSample(e, allocated, peak, mem.peak)
        self._start = None

    # ------------------------------------------------------------------ deciding
    def _floor(self) -> int:
        """The largest block other rings of the pool still stream."""
        return max(
            (
                b.layout.padded_nbytes
                for r in self.scheduler.rings
                if r is not self.ring
                for b in r.blocks
                if b.own is None
            ),
            default=0,
        )

    def _replan(self, name: str, elements: int, mem: MemoryNow) -> None:
        movable = self.plan.movable(self.blocks)
        room = replan.room(
            self.seen, elements, allocated=mem.allocated, movable=movable, limit=mem.limit
        )
        if self.group is not None:  # the ranks that gather these blocks decide together
            room = replan.worst(all_gather_objects(room, self.group))
        floor = self._floor() if self.resizable else self.scheduler.pool.slot_nbytes
        try:
            replan.check_fits(room, self.blocks, floor)
        except replan.Refusal as e:
            raise OffloadError(str(e), rank=self.rank, block=name) from None
        new = replan.next_plan(
            self.plan, self.blocks, room, num_slots=self.num_slots, floor_slot_nbytes=floor
        )
        if not self.resizable:
            new = replan.Plan(new.pinned, self.num_slots, self.scheduler.pool.slot_nbytes)
        if replan.unchanged(self.plan, new):
            return
        before = self.plan
        self._apply(new)
        record = {
            "forward": self.forwards + 1,
            "elements": elements,
            "pinned": len(new.pinned),
            "streamed": len(self.blocks) - len(new.pinned),
            "num_slots": new.num_slots,
            "slot_nbytes": new.slot_nbytes,
            "movable_room_nbytes": room.movable_room,
            "limit_nbytes": room.limit,
            "action": "pin" if len(new.pinned) > len(before.pinned) else "unpin",
        }
        self.records.append(record)
        (logger.info if self.rank == 0 else logger.debug)(
            "dlo re-plan of %s before forward %d (%d input elements): %d of %d blocks pinned, "
            "%d slot(s) x %.1f MiB, room for them %.2f GiB of a %.2f GiB limit",
            self.ring.name,
            record["forward"],
            elements,
            record["pinned"],
            len(self.blocks),
            new.num_slots,
            new.slot_nbytes / 2**20,
            (room.movable_room or 0) / 2**30,
            room.limit / 2**30,
        )

    # ------------------------------------------------------------------ applying
    def _apply(self, new: replan.Plan) -> None:
        """Unpin, resize the slots, pin: frees before allocations, the device synchronized
        first (every queued reader of a freed buffer done) and last (every pin loaded). A
        failure (an allocation the model misjudged) falls back to enable's plan, else
        poisons the ring; either way re-planning stops."""
        try:
            # the forward may run under inference_mode: buffers made there would be inference
            # tensors, whose in-place writes bump no version counter ([Note: writes into
            # streamed tensors] could not see them)
            with torch.inference_mode(False):
                self._change(new)
        except BaseException as e:
            self._off = True
            try:
                with torch.inference_mode(False):
                    self._change(replan.Plan(frozenset(), self.num_slots, self.enable_slot_nbytes))
            except BaseException:
                self.scheduler.poisoned = f"a re-plan failed and could not be undone ({e!r})"
            raise OffloadError(
                f"re-planning the streamed blocks failed ({e!r}); back to enable's plan, no "
                "further re-plans",
                rank=self.rank,
            ) from e

    def _change(self, new: replan.Plan) -> None:
        pf, pool, scheduler = self.platform, self.scheduler.pool, self.scheduler
        pf.synchronize()
        for b in self.ring.blocks:
            if b.name not in new.pinned and b.own is not None:
                b.own, b.own_views = None, []
        self.ring.num_pinned = sum(b.own is not None for b in self.ring.blocks)
        if (new.num_slots, new.slot_nbytes) != (len(pool.slots), pool.slot_nbytes):
            scheduler.drop_loaded()
            pool.release()
            scheduler.refresh_views()  # no slots: the old buffers' views go too
            resize(pool, new.num_slots, new.slot_nbytes)
            scheduler.refresh_views()
        for b in self.ring.blocks:  # in ring order: the same loads on every rank
            if b.name in new.pinned and b.own is None:
                self._pin(b)
                self.ring.num_pinned += 1
        self.plan = new
        self.drain()
        pf.synchronize()

    def _pin(self, b: StreamedBlock) -> None:
        if b.state == LOADED and b.slot is not None:  # its slot is free for others
            b.slot.owner, b.slot, b.state = None, None, IDLE
        buffer = torch.empty(b.layout.padded_nbytes, dtype=torch.uint8, device=self.platform.device)
        own = Slot(-1, buffer, self.platform.new_event(), self.platform.new_event())
        b.transport.load(
            b.layout, b.shard, buffer, free_event=own.free, ready_event=own.ready, index=b.index
        )
        b.own, b.own_views = own, [shard_view(buffer, spec) for spec in b.layout.tensors]

    def close(self) -> None:
        """Unpin every block (disable; the device synchronized)."""
        self.platform.synchronize()
        for b in self.ring.blocks:
            b.own, b.own_views = None, []
        self.ring.num_pinned = 0
        self.ring.replanner = None


class ComponentHook(ModelHook):
    """On the DiT: arms its re-planner when a forward begins, samples when it returns."""

    def __init__(self, replanner: Replanner) -> None:
        self.replanner = replanner

    def pre_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.replanner.started()
        return None

    def post_forward(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        self.replanner.ended()
        return output


class ResidentBlockHook(ModelHook):
    """On each resident block of the DiT: the forward's first block may be one of them."""

    def __init__(self, replanner: Replanner, name: str) -> None:
        self.replanner, self.name = replanner, name

    def pre_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.replanner.entering(args, kwargs, self.name)
        return None
