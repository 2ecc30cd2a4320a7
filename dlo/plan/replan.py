"""Re-planning a DiT's streamed blocks between its forwards, from measured memory. Pure.

[Note: re-plan between forwards]
Enable sizes the resident blocks before anything ran, keeping ``FREE_MEMORY_HEADROOM`` of the
room for activations it cannot know. The forwards tell: at each forward of a DiT whose
resident count the policy chose (``resident_layers`` unset or ``"auto"``), when its first
block enters (its prologue ran, no block has), the ring may *pin* streamed blocks (each gets
a device buffer of its own and loads nothing per forward) or *unpin* them, and resize the
slots to the largest block still streamed (none when nothing streams). Pinned blocks stay in
the ring: they run its hooks, so writes into them are kept or refused exactly as when they
stream, and the order, the lock-step check and every output bit are unchanged. The blocks
enable made resident are never touched, nor is an explicit setting.

The memory model, with the device's allocator statistics at three points of every forward
(nothing is reset: the peak is the process's since its last reset, by the user or nobody):

* ``M``: the movable bytes, the pinned blocks' buffers plus the slots (the only bytes a
  re-plan changes); the *rest* is everything else the process holds.
* The forward's growth ``g = peak at its last block's exit - allocated at its first block's
  entry`` (the first and last blocks are learned from the first forward): an upper bound on what the forward added (exact when the peak rose during it).
  It is predicted for an input of ``e`` elements (the floating-point elements of the first
  block's inputs: hidden states, text states, rotary tables; they scale with the tokens) as
  the most any forward at least that large added, else linearly from the largest forward
  seen, as a DiT's activations grow.
* Between forwards (text encoders, the VAE, the user's tensors): ``o = peak - M`` at each
  re-plan point bounds the rest at any time since the last one (the movable bytes did not
  change in between); the largest is kept. Where the peak rose after the forward's last
  block, the work after it rose ``b`` above what stayed at the forward's end (less what the
rings sharing the slots pinned since; a VAE decode): kept
  per input size and, for a larger input, scaled linearly, at most ``FREE_MEMORY_HEADROOM``
  of the limit (a 480p x 81-frame Wan decode after 1-frame calls ran out of memory under a
  24 GiB cap when only the 1-frame decode was known, H100, 2026-12-06).

The room for movable bytes is ``limit - margin - max(rest now + max(g(e), b(e)), o) - reserve``,
where the limit is what the allocator may hold (the budget's cap, or the device's free memory
plus what the process holds) and the margin ``max(REPLAN_MARGIN x limit, REPLAN_MARGIN_MIN)``
absorbs fragmentation. Blocks are pinned while the room holds them; the blocks that stream
are chosen smallest first (so the slots are as small as they can be), spread evenly over
the ring's order among blocks of one size (a streamed block's copy then overlaps the
compute of the pinned blocks before it), the ring's first block last: it runs in every
forward, also where a step cache skips the rest, its copy has only the previous forward's
tail to hide behind, and streamed it keeps one of the slots the others stream through (it
streamed first before 2026-12-07). Before a forward larger than any seen, pinned blocks are
unpinned until it fits, and where streaming every block does not fit either, they stream
through one slot (no prefetch) until the room comes back. A forward that cannot fit even so
is refused before its first block runs (:class:`Refusal`), but only on a growth
measured exactly (a bound is not evidence that it cannot fit).

What no measurement covers yet is kept free too, ``INPUT_RESERVE`` of the limit on top of
the rest: a larger input and its prologue (both allocated before the first block enters,
that is before the re-plan point can see them), and work between forwards that has not run
yet (the first VAE decode runs after the first forwards).

A peak is evidence only where it changed since the last re-plan point (rose in the
interval, or fell: the user reset it); one that stayed may predate enable or belong to an
interval with other movable bytes.

Known limits: a peak from before enable (the model once whole on the device) that no forward
reaches hides the activations until the peak is reset; a DiT that FSDP2's ``fully_shard``
owns (HSDP) is not re-planned (its hooks are FSDP's); the re-plan point is inside the DiT's
call, after its prologue, so an input whose prologue alone does not fit fails there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from dlo.config.fields import MIB
from dlo.plan.policy_model import FREE_MEMORY_HEADROOM, _size

REPLAN_MARGIN = 0.03
"""Of the limit, kept free of every planned byte (allocator fragmentation)."""

REPLAN_MARGIN_MIN = 256 * MIB

HYSTERESIS = 0.01
"""Of the limit: more blocks are pinned only when they fit with this much more to spare."""

INPUT_RESERVE = 0.05
"""Of the limit, kept free beyond every measured need (see the Note)."""


@dataclass(frozen=True)
class ForwardSample:
    """One forward of the ring's component, as the allocator saw it."""

    elements: int
    start_nbytes: int
    """Allocated when its first block entered."""
    peak_at_start: int
    peak_at_end: int
    """The peak when its last block exited (the process's peak: never below the start's
    unless the user reset it in between)."""
    end_nbytes: int | None = None
    """Allocated when its last block exited: what stays while the work after it runs."""

    @property
    def growth(self) -> int | None:
        """What the forward added at most (None if the peak was reset during it)."""
        if self.peak_at_end < self.peak_at_start:
            return None
        return max(0, self.peak_at_end - self.start_nbytes)

    @property
    def exact(self) -> bool:
        """The peak rose during the forward: its growth is measured, not bounded."""
        return self.peak_at_end > self.peak_at_start


@dataclass(frozen=True)
class Observed:
    """What a ring learned from its forwards so far (immutable; :func:`observe` extends it)."""

    samples: tuple[ForwardSample, ...] = ()
    between_nbytes: int = 0
    """The most the rest held at any time between two re-plan points (``o``)."""
    after: tuple[tuple[int, int], ...] = ()
    """``(elements, bytes)``: the most the work after a forward of that size rose above
    what stayed allocated (``b``: a VAE decode), where it rose above the forward's peak."""


def observe(
    seen: Observed,
    sample: ForwardSample | None,
    peak: int | None,
    movable: int,
    allocated: int | None = None,
    *,
    moved: int = 0,
) -> Observed:
    """``seen`` plus the forward that ended (if its end was seen) and the interval that ends
    now, at a re-plan point where the peak is ``peak`` (None: no evidence, a peak no later
    than enable's or a refused forward's), ``allocated`` is held, and the movable bytes
    since the last one were ``movable`` (``moved``: how much the movable bytes of every ring
    sharing the slots grew since the sampled forward ended, another DiT's pins say). Per
    input size the latest exact growth is kept, else the smallest bound: every bound holds
    the same growth from above, and one grows by whatever the ring unpinned before its
    forward (the process's peak stays where more was pinned while the forward starts
    lower), so the largest would unpin a block more at every forward of that size (Wan
    2.1-14B at 480p x 81 frames under 24 GiB went 19, 18, 17, 16 pinned, H100,
    2026-12-06). A first forward's one-off allocations (a library's workspace) stay
    allocated: the later, smaller bound is right to leave them to the rest."""
    samples, after = seen.samples, seen.after
    if sample is not None and sample.growth is not None:
        same = [s for s in samples if s.elements == sample.elements]
        exact = [s for s in [*same, sample] if s.exact]
        best = exact[-1] if exact else min([*same, sample], key=lambda s: s.growth or 0)
        samples = (*(s for s in samples if s.elements != sample.elements), best)
    if peak is None:
        return Observed(samples, seen.between_nbytes, after)
    if sample is not None and allocated is not None and peak > sample.peak_at_end:
        stays = (sample.end_nbytes + moved) if sample.end_nbytes is not None else allocated
        rise = max(0, peak - stays)  # the work after the forward rose above its own peak
        known = dict(after)
        known[sample.elements] = max(known.get(sample.elements, 0), rise)
        after = tuple(sorted(known.items()))
    return Observed(samples, max(seen.between_nbytes, peak - movable, 0), after)


def predicted_after(seen: Observed, elements: int, limit: int) -> int:
    """What the work after a forward of ``elements`` may add (``b``): the most measured
    after one at least as large, else the largest measured scaled linearly, at most
    enable's headroom of the limit (a decode's memory grows with its frames, but chunked
    decoders grow slower); 0 where none was measured."""
    if not seen.after:
        return 0
    larger = [b for e, b in seen.after if e >= elements]
    if larger:
        return max(larger)
    e, b = max(seen.after)
    scaled = int(b * elements / max(1, e))
    return min(scaled, max(b, int(FREE_MEMORY_HEADROOM * limit)))  # never below the measured


def predicted_growth(seen: Observed, elements: int, *, exact_only: bool = False) -> int | None:
    """The growth predicted for a forward of ``elements``: the most any forward at least as
    large added, else the largest forward's growth scaled linearly (see the Note); None
    when no (exact, with ``exact_only``) forward was measured."""
    pool = [s for s in seen.samples if s.growth is not None and (s.exact or not exact_only)]
    if not pool:
        return None
    larger = [s.growth or 0 for s in pool if s.elements >= elements]
    if larger:
        return max(larger)
    top = max(pool, key=lambda s: (s.elements, s.growth or 0))
    return int((top.growth or 0) * elements / max(1, top.elements))


def margin(limit: int) -> int:
    return max(int(REPLAN_MARGIN * limit), REPLAN_MARGIN_MIN)


@dataclass(frozen=True)
class Room:
    """One rank's view of the next forward (combined over a weight group by :func:`worst`)."""

    movable_room: int | None
    """Bytes the pinned blocks and the slots may take during the next forward (None: no
    forward measured yet, the plan stays)."""
    refuse_need: int | None
    """With every block streamed through one slot, what the forward needs in all (exact
    growth only), None when unknown."""
    limit: int


def room(seen: Observed, elements: int, *, allocated: int, movable: int, limit: int) -> Room:
    """The room for movable bytes before a forward of ``elements`` (see the Note)."""
    rest = max(0, allocated - movable)
    growth = predicted_growth(seen, elements)
    if growth is None:
        return Room(None, None, limit)
    need = rest + max(growth, predicted_after(seen, elements, limit))
    need = max(need, seen.between_nbytes) + int(INPUT_RESERVE * limit)
    exact = predicted_growth(seen, elements, exact_only=True)
    refuse = None if exact is None else rest + exact
    return Room(limit - margin(limit) - need, refuse, limit)


def worst(rooms: Sequence[Room]) -> Room:
    """The group's room: the least room, and the refusal of the rank that needs most over
    its limit (ranks that load together decide together)."""
    known = [r.movable_room for r in rooms if r.movable_room is not None]
    least = min(known) if len(known) == len(rooms) else None
    over = [r for r in rooms if r.refuse_need is not None]
    pick = max(over, key=lambda r: r.refuse_need - r.limit) if over else rooms[0]  # type: ignore[operator]
    return Room(least, pick.refuse_need if over else None, pick.limit)


@dataclass(frozen=True)
class Block:
    name: str
    nbytes: int
    """Padded bytes: its own buffer's size, and the slot size it needs."""


@dataclass(frozen=True)
class Plan:
    """Which blocks of a ring are pinned, and the slots the others need."""

    pinned: frozenset[str]
    num_slots: int
    slot_nbytes: int

    def movable(self, blocks: Sequence[Block]) -> int:
        pinned = sum(b.nbytes for b in blocks if b.name in self.pinned)
        return pinned + self.num_slots * self.slot_nbytes


class Refusal(ValueError):
    """A forward that cannot fit with every block streamed through one slot."""


def spread_order(n: int) -> list[int]:
    """0..n-1 in an order whose every prefix is spread evenly (van der Corput)."""

    def key(i: int) -> float:
        out, f = 0.0, 0.5
        while i:
            out, i, f = out + f * (i & 1), i >> 1, f / 2
        return out

    return sorted(range(n), key=lambda i: (key(i), i))


def streaming_order(blocks: Sequence[Block]) -> list[int]:
    """The indices of ``blocks`` in the order :func:`choose` streams them: smallest first,
    spread evenly over the ring's order among blocks of one size, the ring's first block
    after every other (it runs in every forward, a step cache's skipped ones included, and
    its copy has no pinned block of the same forward to hide behind). The plans of one ring
    are therefore nested: one that streams fewer blocks pins every block another pins."""
    by_size: dict[int, list[int]] = {}
    for i, b in enumerate(blocks):
        if i:
            by_size.setdefault(b.nbytes, []).append(i)
    order = [
        group[j]
        for size in sorted(by_size)
        for group in [by_size[size]]
        for j in spread_order(len(group))
    ]
    return [*order, 0] if blocks else order


def choose(
    blocks: Sequence[Block], movable_room: int, *, num_slots: int, floor_slot_nbytes: int
) -> Plan:
    """The plan with the fewest streamed blocks whose movable bytes fit ``movable_room``
    (``blocks`` in the ring's order; ``floor_slot_nbytes``: what other rings still stream
    through the shared slots); when even streaming every block does not fit, every block
    streams through one slot (no prefetch: the forward's last resort before a refusal)."""
    order = streaming_order(blocks)
    total = sum(b.nbytes for b in blocks)
    streamed_nbytes, largest = 0, floor_slot_nbytes
    for k in range(len(blocks) + 1):
        if k:
            b = blocks[order[k - 1]]
            streamed_nbytes += b.nbytes
            largest = max(largest, b.nbytes)
        slots = num_slots if largest else 0
        if total - streamed_nbytes + slots * largest <= movable_room:
            return Plan(frozenset(blocks[i].name for i in order[k:]), slots, largest)
        if k == len(blocks):
            return Plan(frozenset(), min(slots, 1), largest)
    raise AssertionError("unreachable")


def check_fits(r: Room, least_slots_nbytes: int) -> None:
    """Refuse a forward that cannot fit even with every block streamed through the least
    slots the ring can run with (one slot of the largest block where the slots are resized;
    the fixed slots otherwise): its need against the limit itself (the margin is the
    planner's, not the device's)."""
    if r.refuse_need is None:
        return
    need = r.refuse_need + least_slots_nbytes
    if need > r.limit:
        raise Refusal(
            f"this forward needs about {_size(need)} on the device with every block streamed "
            f"through the least slots ({_size(least_slots_nbytes)}) and its activations "
            f"predicted from the forwards measured so far, but {_size(r.limit)} is available "
            "(the device budget or the free device memory): use a smaller input (resolution, "
            "frames, batch), or a larger device_budget_gb or device"
        )


def next_plan(
    current: Plan, blocks: Sequence[Block], r: Room, *, num_slots: int, floor_slot_nbytes: int
) -> Plan:
    """The plan for the next forward: fewer pinned blocks at once when the room requires it,
    more only when they fit with ``HYSTERESIS`` more to spare (no flapping between two
    plans on a few bytes), else ``current``."""
    if r.movable_room is None:
        return current
    keep = choose(blocks, r.movable_room, num_slots=num_slots, floor_slot_nbytes=floor_slot_nbytes)
    if len(keep.pinned) < len(current.pinned) or current.movable(blocks) > r.movable_room:
        return keep
    grow = choose(
        blocks,
        r.movable_room - int(HYSTERESIS * r.limit),
        num_slots=num_slots,
        floor_slot_nbytes=floor_slot_nbytes,
    )
    more = (len(grow.pinned), grow.num_slots) > (len(current.pinned), current.num_slots)
    if more and grow.movable(blocks) <= r.movable_room:
        return grow
    if current.slot_nbytes < floor_slot_nbytes or (current.num_slots == 0 and floor_slot_nbytes):
        return keep  # another ring streams a larger block now
    return current


def unchanged(old: Plan, new: Plan) -> bool:
    return dataclasses.astuple(old) == dataclasses.astuple(new)
