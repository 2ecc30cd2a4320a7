"""The re-plan model's decisions ([Note: re-plan between forwards] in dlo.plan.replan): pure."""

from __future__ import annotations

import itertools

import pytest

from dlo.config.fields import GIB, MIB
from dlo.plan import replan
from dlo.plan.replan import Block, ForwardSample, Observed, Plan, Room

FLUX = [Block(f"double.{i}", 680 * MIB) for i in range(19)] + [
    Block(f"single.{i}", 280 * MIB) for i in range(38)
]


def test_spread_order_prefixes_are_even() -> None:
    order = replan.spread_order(8)
    assert sorted(order) == list(range(8))
    assert order[:2] == [0, 4] and sorted(order[:4]) == [0, 2, 4, 6]
    assert replan.spread_order(0) == [] and replan.spread_order(1) == [0]


def test_streaming_order_spreads_and_streams_the_first_block_of_each_size_last() -> None:
    """The ring's first block runs in every forward, a step cache's skipped ones included:
    it is the last of its size to stream; the others spread as :func:`spread_order`."""
    blocks = [Block(f"b{i}", 100) for i in range(8)]
    assert replan.streaming_order(blocks) == [1, 5, 3, 7, 2, 6, 4, 0]
    order = replan.streaming_order(FLUX)  # the singles first (single.0 too), double.0 last
    assert order[0] == 19 and order[-1] == 0 and sorted(order) == list(range(57))
    assert {FLUX[i].name.split(".")[0] for i in order[:38]} == {"single"}
    small_first = [Block("big", 300), *(Block(f"s{i}", 100) for i in range(3))]
    assert replan.streaming_order(small_first) == [1, 3, 2, 0]  # block 0 last, however small
    assert replan.streaming_order([Block("only", 1)]) == [0]
    plan = replan.choose(blocks, 600, num_slots=2, floor_slot_nbytes=0)  # 4 pins + 2 slots
    assert plan.pinned == {"b0", "b2", "b4", "b6"}


def test_choose_streams_the_smallest_blocks_spread_out_and_the_slots_shrink() -> None:
    total = sum(b.nbytes for b in FLUX)
    everything = replan.choose(FLUX, total, num_slots=2, floor_slot_nbytes=0)
    assert everything == Plan(frozenset(b.name for b in FLUX), 0, 0)
    # 2 GiB short: single blocks stream (the slot is a single block's), spread over them
    plan = replan.choose(FLUX, total - 2 * GIB, num_slots=2, floor_slot_nbytes=0)
    streamed = [b.name for b in FLUX if b.name not in plan.pinned]
    assert all(n.startswith("single.") for n in streamed)
    assert (plan.num_slots, plan.slot_nbytes) == (2, 280 * MIB)
    assert plan.movable(FLUX) <= total - 2 * GIB
    gaps = sorted(int(n.split(".")[1]) for n in streamed)
    assert len(streamed) == 10 and max(b - a for a, b in itertools.pairwise(gaps)) <= 6
    # fewer room, more streamed: the streamed sets are nested (no block is pinned back)
    tighter = replan.choose(FLUX, total - 4 * GIB, num_slots=2, floor_slot_nbytes=0)
    assert tighter.pinned < plan.pinned
    nothing = replan.choose(FLUX, 0, num_slots=2, floor_slot_nbytes=0)
    assert nothing == Plan(frozenset(), 1, 680 * MIB)  # not even two slots: one
    assert replan.choose(FLUX, 2 * 680 * MIB, num_slots=2, floor_slot_nbytes=0).num_slots == 2


def test_one_slot_is_a_last_resort_and_two_come_back_with_the_room() -> None:
    blocks = [Block(f"b{i}", 100 * MIB) for i in range(4)]
    limit = 10 * GIB
    two = Plan(frozenset(), 2, 100 * MIB)
    one = replan.next_plan(
        two, blocks, Room(150 * MIB, None, limit), num_slots=2, floor_slot_nbytes=0
    )
    assert one == Plan(frozenset(), 1, 100 * MIB)
    back = Room(200 * MIB + int(replan.HYSTERESIS * limit), None, limit)
    assert replan.next_plan(one, blocks, back, num_slots=2, floor_slot_nbytes=0) == two


def test_choose_keeps_the_slots_other_rings_stream_through() -> None:
    blocks = [Block("a", 10), Block("b", 10)]
    plan = replan.choose(blocks, 1000, num_slots=3, floor_slot_nbytes=50)
    assert plan == Plan(frozenset({"a", "b"}), 3, 50)


def test_next_plan_grows_only_with_hysteresis_and_shrinks_at_once() -> None:
    blocks = [Block(f"b{i}", 100 * MIB) for i in range(10)]
    limit = 10 * GIB
    none = Plan(frozenset(), 2, 100 * MIB)
    exact = Room(10 * 100 * MIB, None, limit)  # every block, without the hysteresis
    some = replan.next_plan(none, blocks, exact, num_slots=2, floor_slot_nbytes=0)
    assert len(some.pinned) == 6 and some.num_slots == 2  # what fits with it to spare
    # the same room again: no flapping up to every block and back
    assert replan.next_plan(some, blocks, exact, num_slots=2, floor_slot_nbytes=0) is some
    roomy = Room(10 * 100 * MIB + int(replan.HYSTERESIS * limit), None, limit)
    grown = replan.next_plan(none, blocks, roomy, num_slots=2, floor_slot_nbytes=0)
    assert len(grown.pinned) == 10 and grown.num_slots == 0
    # the room shrinks by two blocks: unpinned at once, with the slots back
    small = Room(8 * 100 * MIB, None, limit)
    shrunk = replan.next_plan(grown, blocks, small, num_slots=2, floor_slot_nbytes=0)
    assert len(shrunk.pinned) == 6 and shrunk.num_slots == 2
    unknown = Room(None, None, limit)
    assert replan.next_plan(grown, blocks, unknown, num_slots=2, floor_slot_nbytes=0) is grown


def test_growth_is_a_bound_exact_only_when_the_peak_rose() -> None:
    rose = ForwardSample(elements=100, start_nbytes=10, peak_at_start=50, peak_at_end=60)
    assert rose.growth == 50 and rose.exact
    flat = ForwardSample(elements=100, start_nbytes=10, peak_at_start=60, peak_at_end=60)
    assert flat.growth == 50 and not flat.exact
    reset = ForwardSample(elements=100, start_nbytes=10, peak_at_start=60, peak_at_end=20)
    assert reset.growth is None


def test_prediction_uses_larger_forwards_as_they_are_and_scales_above_them() -> None:
    seen = Observed()
    small = ForwardSample(100, 0, 0, 1000)  # exact, 10 bytes per element
    seen = replan.observe(seen, small, peak=1000, movable=0)
    assert replan.predicted_growth(seen, 50) == 1000  # never below a larger forward's
    assert replan.predicted_growth(seen, 300) == 3000  # linear above the largest
    big = ForwardSample(1000, 0, 1000, 5000)  # 5 per element
    seen = replan.observe(seen, big, peak=5000, movable=0)
    assert replan.predicted_growth(seen, 500) == 5000
    assert replan.predicted_growth(seen, 2000) == 10000
    # a bound (the peak did not rise) predicts, but is not evidence for a refusal
    bound = replan.observe(Observed(), ForwardSample(10, 0, 900, 900), peak=900, movable=0)
    assert replan.predicted_growth(bound, 10) == 900
    assert replan.predicted_growth(bound, 10, exact_only=True) is None
    assert replan.predicted_growth(Observed(), 10) is None


def test_observe_keeps_the_largest_rest_between_forwards() -> None:
    s = ForwardSample(10, 100, 100, 200)
    seen = replan.observe(Observed(), s, peak=200, movable=50)
    assert seen.between_nbytes == 150
    # the peak rose after the forward ended: work between forwards (a VAE decode)
    seen = replan.observe(seen, ForwardSample(10, 100, 200, 200), peak=900, movable=50)
    assert seen.between_nbytes == 850
    seen = replan.observe(seen, None, peak=900, movable=500)  # more pinned: less rest
    assert seen.between_nbytes == 850


def test_room_keeps_a_reserve_beyond_every_measured_need() -> None:
    limit = 20 * GIB
    seen = replan.observe(Observed(), ForwardSample(10, GIB, GIB, 2 * GIB), 2 * GIB, 0)
    r = replan.room(seen, 10, allocated=GIB, movable=0, limit=limit)
    reserve = int(replan.INPUT_RESERVE * limit)
    assert r.movable_room == limit - replan.margin(limit) - (2 * GIB + reserve)
    assert r.refuse_need == 2 * GIB
    after = Observed(seen.samples, between_nbytes=3 * GIB)  # a VAE decode needed more
    r = replan.room(after, 10, allocated=GIB, movable=0, limit=limit)
    assert r.movable_room == limit - replan.margin(limit) - 3 * GIB - reserve
    assert replan.room(Observed(), 10, allocated=GIB, movable=0, limit=limit).movable_room is None


def test_worst_takes_the_least_room_and_the_neediest_refusal() -> None:
    a, b = Room(100, 50, 1000), Room(70, 990, 1000)
    assert replan.worst([a, b]) == Room(70, 990, 1000)
    assert replan.worst([a, Room(None, None, 1000)]).movable_room is None


def test_a_forward_that_cannot_fit_the_least_slots_is_refused_naming_both_sizes() -> None:
    replan.check_fits(Room(0, 7 * GIB, 9 * GIB), 2 * GIB)  # 9 GiB: just fits
    with pytest.raises(replan.Refusal, match=r"9\.00 GiB on the device .*2\.00 GiB\).*8\.00 GiB"):
        replan.check_fits(Room(0, 7 * GIB, 8 * GIB), 2 * GIB)
    replan.check_fits(Room(0, None, 1), 2 * GIB)  # nothing exact: never refused


def test_the_latest_exact_growth_of_a_size_is_kept() -> None:
    first = ForwardSample(10, 100, 100, 300)  # exact, with a one-off allocation
    later = ForwardSample(10, 150, 300, 310)  # exact, less growth
    seen = replan.observe(Observed(), first, peak=300, movable=0)
    seen = replan.observe(seen, later, peak=310, movable=0)
    assert seen.samples == (later,)
    bound = ForwardSample(10, 150, 310, 310)  # a bound does not replace exact evidence
    assert replan.observe(seen, bound, peak=310, movable=0).samples == (later,)
    assert replan.observe(seen, None, peak=None, movable=0).between_nbytes == 310


def test_work_after_a_forward_is_kept_per_size_and_scaled_for_a_larger_input() -> None:
    """A decode after the last forward raises the peak above the forward's: its rise over
    what stays allocated is kept for that size, and predicted for a larger input linearly,
    at most enable's headroom of the limit."""
    fwd = ForwardSample(100, 10 * MIB, 10 * MIB, 20 * MIB)
    # the peak stayed at the forward's: the work after it was smaller, nothing learned
    seen = replan.observe(Observed(), fwd, 20 * MIB, 0, allocated=10 * MIB)
    assert seen.after == () and replan.predicted_after(seen, 100, GIB) == 0
    # a decode rose to 42 MiB over the 10 MiB that stays: 32 MiB after forwards of 100
    seen = replan.observe(Observed(), fwd, 42 * MIB, 0, allocated=10 * MIB)
    assert seen.after == ((100, 32 * MIB),)
    assert replan.predicted_after(seen, 50, GIB) == 32 * MIB  # a smaller input: as measured
    assert replan.predicted_after(seen, 300, GIB) == 96 * MIB  # larger: linear
    cap = int(replan.FREE_MEMORY_HEADROOM * 200 * MIB)
    assert replan.predicted_after(seen, 300, 200 * MIB) == cap  # at most the headroom
    # it takes room before a larger forward as the growth does: the larger of the two
    base = replan.room(seen, 300, allocated=10 * MIB, movable=0, limit=GIB)
    bare = replan.room(Observed(seen.samples), 300, allocated=10 * MIB, movable=0, limit=GIB)
    assert bare.movable_room is not None and base.movable_room is not None
    assert bare.movable_room - base.movable_room == 96 * MIB - 30 * MIB  # growth 10 -> 30 MiB
    assert base.refuse_need == bare.refuse_need  # never a refusal: only the growth refuses


def test_explain_prints_every_replan_with_its_numbers() -> None:
    from dlo.plan.policy_explain import replans_explained

    record = {
        "component": "transformer",
        "forward": 2,
        "elements": 4096,
        "pinned": 8,
        "streamed": 6,
        "num_slots": 2,
        "slot_nbytes": 283 * MIB,
        "movable_room_nbytes": 3 * GIB,
        "limit_nbytes": 24 * GIB,
        "action": "pin",
    }
    text = replans_explained({"replans": [record, {**record, "forward": 9, "action": "unpin"}]})
    assert text.splitlines() == [
        "dlo re-plan of transformer before forward 2 (4096 input elements): pin, 8 of 14 blocks "
        "pinned, 2 slot(s) x 283.0 MiB, room for them 3.00 GiB of a 24.00 GiB limit",
        "dlo re-plan of transformer before forward 9 (4096 input elements): unpin, 8 of 14 "
        "blocks pinned, 2 slot(s) x 283.0 MiB, room for them 3.00 GiB of a 24.00 GiB limit",
    ]
    assert replans_explained(None).startswith("dlo re-plans: none")


def test_the_work_after_a_forward_is_measured_against_what_stayed_and_never_shrinks() -> None:
    # what stayed at the forward's end (12 MiB), not what the next forward allocated (30)
    fwd = ForwardSample(100, 10 * MIB, 10 * MIB, 20 * MIB, end_nbytes=12 * MIB)
    seen = replan.observe(Observed(), fwd, 42 * MIB, 0, allocated=30 * MIB)
    assert seen.after == ((100, 30 * MIB),)
    # a measured rise above the cap is kept for larger inputs too: never below the measured
    big = Observed(after=((100, 6 * GIB),))
    assert replan.predicted_after(big, 100, 24 * GIB) == 6 * GIB
    assert replan.predicted_after(big, 101, 24 * GIB) == 6 * GIB


def test_another_dits_pins_since_the_forward_ended_are_no_work_after_it() -> None:
    """Two DiTs share the slots: the other one pinned 3 MiB after this one's forward ended;
    the decode's rise over what stayed is measured without them."""
    fwd = ForwardSample(100, 10 * MIB, 10 * MIB, 20 * MIB, end_nbytes=12 * MIB)
    seen = replan.observe(Observed(), fwd, 42 * MIB, 0, allocated=30 * MIB, moved=3 * MIB)
    assert seen.after == ((100, 27 * MIB),)


def test_bounds_of_one_size_keep_the_tightest_so_unpinning_converges() -> None:
    """The forwards of one size under a peak no forward reaches: each unpin lowers the next
    forward's start, which raises its bound by the unpinned block. Keeping the largest bound
    unpinned one block more at every forward (a ratchet); the smallest holds the plan."""
    limit, block = 24 * GIB, 700 * MIB
    blocks = [Block(f"b{i}", block) for i in range(40)]
    peak = 23 * GIB  # the process's peak, set by an earlier, smaller input with more pins
    act = 3 * GIB  # what each forward of this size really adds
    rest = 2 * GIB
    plan = Plan(frozenset(f"b{i}" for i in range(19)), 2, block)
    seen, counts = Observed(), []
    for _ in range(6):
        movable = plan.movable(blocks)
        start = rest + movable
        assert start + act < peak  # no forward reaches the peak: every sample is a bound
        sample = ForwardSample(1000, start, peak, peak, start)
        seen = replan.observe(seen, sample, peak=None, movable=movable)
        r = replan.room(seen, 1000, allocated=start, movable=movable, limit=limit)
        plan = replan.next_plan(plan, blocks, r, num_slots=2, floor_slot_nbytes=0)
        counts.append(len(plan.pinned))
    assert len(set(counts[1:])) == 1, counts  # one re-plan at most, then it holds
