"""The automatic policy's decision model (dlo.plan.policy) and its config knobs. Pure: no process
group, no device, no clock."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo.config.fields import MIB
from dlo.config.offload import LayerOptions, OffloadConfig
from dlo.plan.layout import ALIGN
from dlo.plan.policy import decide
from dlo.plan.policy_model import (
    FREE_MEMORY_HEADROOM,
    GIB,
    SHARED_MEMORY_HEADROOM,
    Measurements,
    PolicyInput,
    StackSpec,
    block_times,
    padded_nbytes,
    slots_needed,
)

H = 50e9  # host-to-device, bytes/s


def _stack(
    sizes: tuple[int, ...] = (64 * MIB,),
    *,
    transfer: str = "auto",
    group_size: int = 2,
    name: str = "dit.blocks",
    component: str = "dit",
    dit_path: str = "dit",
    num_resident: int = 0,
    eligible: bool = True,
) -> StackSpec:
    return StackSpec(
        name=name,
        component=component,
        dit_path=dit_path,
        block_nbytes=sizes,
        transfer=transfer,
        group_axis="data" if group_size > 1 else "local",
        group_size=group_size,
        num_resident=num_resident,
        resident_eligible=eligible,
    )


def _input(
    *stacks: StackSpec,
    h2d: float = H,
    ag: float | None = 500e9,
    chunk: int = 64 * MIB,
    free: int | None = None,
    shm: int | None = None,
    **kw: Any,
) -> PolicyInput:
    return PolicyInput(
        stacks=stacks or (_stack(),),
        chunk_nbytes=chunk,
        measured=Measurements(
            h2d_bps=h2d,
            allgather_bps={"data": ag} if ag is not None else {},
            free_device_nbytes=free,
            shared_memory_nbytes=shm,
            num_ranks=2,
        ),
        **kw,
    )


# ----------------------------------------------------------------------------- the time model
def test_block_times_rank_local_is_one_copy() -> None:
    lat, occ = block_times(
        100 * MIB, group_size=1, chunk_nbytes=64 * MIB, h2d_bps=H, allgather_bps=1.0
    )
    assert lat == occ == pytest.approx(padded_nbytes(100 * MIB, 1, 64 * MIB) / H)


def test_block_times_allgather_is_a_two_stage_pipeline() -> None:
    # 4 chunks of 64 MiB, G = 2: copy c = 32 MiB / h, gather g = 64 MiB / a
    lat, occ = block_times(
        256 * MIB, group_size=2, chunk_nbytes=64 * MIB, h2d_bps=H, allgather_bps=525e9
    )
    c, g = 32 * MIB / H, 64 * MIB / 525e9
    assert occ == pytest.approx(4 * max(c, g))
    assert lat == pytest.approx(c + g + 3 * max(c, g))
    assert lat == pytest.approx(occ + min(c, g))


@pytest.mark.parametrize("g", [2, 3, 4, 8])
def test_crossover_where_allgather_starts_to_win(g: int) -> None:
    """One chunk: AllGather wins iff C/G/h + C/a < C/h, i.e. a > h * G / (G - 1)."""
    size = 24 * MIB  # a multiple of G * ALIGN for every G here: same padding for both
    assert size % (g * ALIGN) == 0
    crossover = H * g / (g - 1)
    above = decide(_input(_stack((size,), group_size=g), ag=crossover * 1.01))
    below = decide(_input(_stack((size,), group_size=g), ag=crossover * 0.99))
    assert above.stacks[0].transfer == "allgather"
    assert (above.stacks[0].group_axis, above.stacks[0].group_size) == ("data", g)
    assert below.stacks[0].transfer == "rank-local"
    assert (below.stacks[0].group_axis, below.stacks[0].group_size) == ("local", 1)


@pytest.mark.parametrize("h2d", [10e9, 25e9, 54e9, 200e9])
def test_crossover_moves_with_host_bandwidth(h2d: float) -> None:
    # G = 2, one chunk: the crossover is a = 2h; the same AllGather flips with h
    inp = _input(_stack((8 * MIB,)), h2d=h2d, ag=2 * 54e9 * 1.01)
    expected = "allgather" if h2d <= 54e9 else "rank-local"
    assert decide(inp).stacks[0].transfer == expected


@pytest.mark.parametrize("shm, expected", [(None, "rank-local"), (GIB, "node-shared")])
def test_tie_goes_to_whole_blocks(shm: int | None, expected: str) -> None:
    # G = 2, one chunk, a = 2h exactly: c + g == C / h bit for bit; whole blocks are
    # node-shared where the shared memory is known to hold them, else rank-local
    d = decide(_input(_stack((MIB,)), h2d=1e9, ag=2e9, shm=shm))
    s = d.stacks[0]
    assert s.rank_local_ms == s.allgather_ms
    assert s.transfer == expected and (s.group_axis, s.group_size) == ("local", 1)


def test_h200_reference_numbers_pick_allgather_with_three_slots() -> None:
    """2 x H200: ~54 GB/s H2D per rank with both copying, ~525 GB/s AllGather."""
    d = decide(_input(_stack((340 * MIB,) * 40), h2d=54e9, ag=525e9, num_slots="auto"))
    s = d.stacks[0]
    assert s.transfer == "allgather"
    assert s.allgather_ms is not None and s.allgather_ms < s.rank_local_ms / 1.8
    assert d.num_slots == 3


def test_one_rank_axis_is_rank_local_without_a_gather_measurement() -> None:
    d = decide(_input(_stack(group_size=1), ag=None))
    s = d.stacks[0]
    assert (s.transfer, s.group_size, s.allgather_ms) == ("rank-local", 1, None)
    assert "one rank" in s.reason


@pytest.mark.parametrize("transfer", ["rank-local", "allgather"])
@pytest.mark.parametrize("ag", [1e9, 5000e9])
def test_explicit_transfer_is_kept_whatever_the_model_says(transfer: str, ag: float) -> None:
    d = decide(_input(_stack(transfer=transfer), ag=ag))
    s = d.stacks[0]
    assert (s.transfer, s.requested, s.reason) == (transfer, transfer, "explicit")
    assert s.group_size == (2 if transfer == "allgather" else 1)


def test_stacks_decide_independently() -> None:
    """Per stack: a stack with no peers stays rank-local beside one that gathers."""
    dit = _stack((64 * MIB,) * 4)
    enc = _stack((MIB,) * 2, name="enc.layers", component="encoder", dit_path="enc", group_size=1)
    d = decide(_input(dit, enc))
    assert [s.transfer for s in d.stacks] == ["allgather", "rank-local"]


# ----------------------------------------------------------------------------- node-shared
SMALL_AG = 10e9  # H = 50 GB/s: whole blocks win by far (G = 2)


def _shared_need(*stacks: StackSpec, chunk: int = 64 * MIB) -> int:
    """One node's copy of ``stacks``: their padded whole-block bytes."""
    return sum(padded_nbytes(b, 1, chunk) for s in stacks for b in s.block_nbytes)


def test_whole_blocks_are_node_shared_where_the_shared_memory_holds_them() -> None:
    stack = _stack((64 * MIB,) * 3)
    need = _shared_need(stack)
    free = math.ceil(need / (1 - SHARED_MEMORY_HEADROOM)) + 1
    d = decide(_input(stack, ag=SMALL_AG, shm=free, num_slots="auto"))
    s = d.stacks[0]
    assert (s.transfer, s.requested, s.group_axis, s.group_size) == (
        "node-shared",
        "auto",
        "local",
        1,
    )
    assert s.reason.startswith("auto: ") and "rank-local:" not in s.reason
    assert "share one host copy" in s.reason and "free in shared memory" in s.reason, s.reason
    assert d.num_slots == 2  # whole blocks: L == P
    assert "-> node-shared" in d.explanation and "free shared memory" in d.explanation


@pytest.mark.parametrize("compute_s", [None, 10.0])
def test_a_host_budget_never_takes_node_shared(compute_s: float | None) -> None:
    """The disk tier reads blocks per rank (no node copy): where auto would share whole
    blocks, it takes what sharing's fallback takes, AllGather where faster, else rank-local."""
    stack = _stack((64 * MIB,) * 3)
    free = math.ceil(_shared_need(stack) / (1 - SHARED_MEMORY_HEADROOM)) + 1
    kw: dict[str, Any] = dict(shm=free, num_slots="auto", block_compute_s=compute_s)
    shared = decide(_input(stack, ag=SMALL_AG, **kw)).stacks[0]
    assert shared.transfer == "node-shared"  # without a budget
    s = decide(_input(stack, ag=SMALL_AG, host_budget=True, **kw)).stacks[0]
    assert s.transfer in ("rank-local", "allgather") and "host_budget_gb" in s.reason
    fast = decide(_input(stack, ag=500e9, host_budget=True, **kw)).stacks[0]
    assert fast.transfer in ("rank-local", "allgather") and fast.transfer != "node-shared"


def test_a_host_budget_with_a_codec_never_takes_allgather() -> None:
    """Encoded checkpoints hold whole blocks ([Note: encoded blocks on disk]): where auto
    would gather, a codec under a budget reads whole encoded blocks per rank instead."""
    stack = _stack((64 * MIB,) * 3)
    assert decide(_input(stack, ag=500e9, host_budget=True)).stacks[0].transfer == "allgather"
    coded = dataclasses.replace(stack, codec="ans")
    s = decide(_input(coded, ag=500e9, host_budget=True)).stacks[0]
    assert (s.transfer, s.group_size) == ("rank-local", 1) and "codec 'ans'" in s.reason
    assert decide(_input(coded, ag=500e9)).stacks[0].transfer == "allgather"  # no budget


@pytest.mark.parametrize("short", [1, 64 * MIB])
def test_too_little_shared_memory_is_rank_local_saying_why(short: int) -> None:
    # headroom: the copy must fit in (1 - SHARED_MEMORY_HEADROOM) of the free bytes
    stack = _stack((64 * MIB,) * 3)
    need = _shared_need(stack)
    free = math.floor(need / (1 - SHARED_MEMORY_HEADROOM)) - short
    assert free > need or short > 1  # the headroom, not the bytes alone, refuses it
    d = decide(_input(stack, ag=SMALL_AG, shm=free))
    s = d.stacks[0]
    assert (s.transfer, s.requested, s.group_size) == ("rank-local", "auto", 1)
    assert "shared memory" in s.reason and "192.00 MiB" in s.reason, s.reason
    assert f"{free / MIB:.2f} MiB free" in s.reason, s.reason
    assert "shared memory" in d.explanation and "-> rank-local" in d.explanation


def test_unknown_shared_memory_is_rank_local() -> None:
    d = decide(_input(_stack(), ag=SMALL_AG, shm=None))
    s = d.stacks[0]
    assert s.transfer == "rank-local" and "unknown" in s.reason and "shared memory" in s.reason
    assert d.as_dict()["measured"]["shared_memory_nbytes"] is None


@pytest.mark.parametrize("shm", [None, 0, 100 * GIB])
def test_explicit_and_gathering_stacks_ignore_the_shared_memory(shm: int | None) -> None:
    local = _stack(name="l.blocks", dit_path="l", transfer="rank-local")
    gathered = _stack(name="g.blocks", dit_path="g", transfer="allgather")
    winner = _stack(name="w.blocks", dit_path="w")  # auto, AllGather is faster
    one = _stack(name="o.blocks", dit_path="o", group_size=1)  # auto, nothing to share with
    d = decide(_input(local, gathered, winner, one, ag=5000e9, shm=shm))
    got = [(s.transfer, s.reason) for s in d.stacks]
    assert got[0] == ("rank-local", "explicit") and got[1] == ("allgather", "explicit")
    assert got[2][0] == "allgather" and "shared memory" not in got[2][1]
    assert got[3][0] == "rank-local" and "one rank" in got[3][1]
    assert "shared memory" not in got[3][1]


def test_stacks_that_fit_alone_but_not_together_are_all_rank_local() -> None:
    a = _stack((64 * MIB,) * 2, name="a.blocks", dit_path="a")
    b = _stack((64 * MIB,) * 2, name="b.blocks", dit_path="b")
    explicit = _stack((64 * MIB,) * 8, name="e.blocks", dit_path="e", transfer="rank-local")
    one = math.ceil(_shared_need(a) / (1 - SHARED_MEMORY_HEADROOM)) + 1
    both = math.ceil(_shared_need(a, b) / (1 - SHARED_MEMORY_HEADROOM)) + 1
    assert [s.transfer for s in decide(_input(a, ag=SMALL_AG, shm=one)).stacks] == ["node-shared"]
    d = decide(_input(a, b, explicit, ag=SMALL_AG, shm=one))
    assert [s.transfer for s in d.stacks] == ["rank-local"] * 3
    assert all("256.00 MiB" in s.reason for s in d.stacks[:2]), d.stacks
    assert d.stacks[2].reason == "explicit"  # not counted in the node's copy
    d = decide(_input(a, b, explicit, ag=SMALL_AG, shm=both))
    assert [s.transfer for s in d.stacks] == ["node-shared", "node-shared", "rank-local"]


def test_explicit_node_shared_stacks_count_in_the_node_copy() -> None:
    # one file holds every node-shared stack: an automatic one must fit beside the explicit
    explicit = _stack((64 * MIB,) * 3, name="d.blocks", dit_path="d", transfer="node-shared")
    explicit = dataclasses.replace(explicit, group_axis="local", group_size=1)
    auto = _stack((64 * MIB,), name="e.blocks", dit_path="e")
    alone = math.ceil(_shared_need(auto) / (1 - SHARED_MEMORY_HEADROOM)) + 1
    both = math.ceil(_shared_need(auto, explicit) / (1 - SHARED_MEMORY_HEADROOM)) + 1
    d = decide(_input(explicit, auto, ag=SMALL_AG, shm=max(alone, both - 2)))
    assert [s.transfer for s in d.stacks] == ["node-shared", "rank-local"]
    assert "256.00 MiB" in d.stacks[1].reason and d.stacks[0].reason == "explicit"
    d = decide(_input(explicit, auto, ag=SMALL_AG, shm=both))
    assert [s.transfer for s in d.stacks] == ["node-shared", "node-shared"]


def test_a_node_holding_several_weight_groups_needs_a_copy_for_each() -> None:
    stack = _stack((64 * MIB,) * 3)
    fits_one = math.ceil(_shared_need(stack) / (1 - SHARED_MEMORY_HEADROOM)) + 1
    assert decide(_input(stack, ag=SMALL_AG, shm=fits_one)).stacks[0].transfer == "node-shared"
    d = decide(_input(stack, ag=SMALL_AG, shm=fits_one, shared_copies_per_node=2))
    assert d.stacks[0].transfer == "rank-local"
    assert "the node's 2 copies need 384.00 MiB" in d.stacks[0].reason, d.stacks[0].reason
    d = decide(_input(stack, ag=SMALL_AG, shm=2 * fits_one, shared_copies_per_node=2))
    assert d.stacks[0].transfer == "node-shared"


def test_copies_per_node_counts_the_groups_with_a_rank_on_the_fullest_node() -> None:
    from dlo.runtime.measure import RankMeasurement, copies_per_node

    def recs(*hosts: str) -> list[RankMeasurement]:
        return [RankMeasurement(r, host=h) for r, h in enumerate(hosts)]

    data_of_dp2_sp2 = [[0, 2], [1, 3]]  # two data groups, interleaved with the sequence axis
    assert copies_per_node(recs("a", "a", "a", "a"), data_of_dp2_sp2) == 2
    assert copies_per_node(recs("a", "a", "b", "b"), data_of_dp2_sp2) == 2  # each node: both
    assert copies_per_node(recs("a", "b", "a", "b"), data_of_dp2_sp2) == 1
    assert copies_per_node(recs("a", "a", "a", "a"), [[0, 1, 2, 3]]) == 1
    assert copies_per_node(recs("a", "a", "b", "b"), [[0, 1], [2, 3]]) == 1


def test_shared_memory_is_reported_and_combined_as_the_minimum() -> None:
    from dlo.runtime.measure import RankMeasurement, combine

    d = decide(_input(_stack(), ag=SMALL_AG, shm=3 * GIB))
    as_dict = json.loads(json.dumps(d.as_dict()))
    assert as_dict["measured"]["shared_memory_nbytes"] == 3 * GIB
    assert as_dict["stacks"]["dit.blocks"]["transfer"] == "node-shared"
    assert "free shared memory 3.00 GiB" in d.explanation

    def rec(rank: int, shm: int | None) -> RankMeasurement:
        return RankMeasurement(rank, h2d_bps=H, shared_memory_nbytes=shm)

    assert combine([rec(0, 5 * GIB), rec(1, 2 * GIB), rec(2, 7 * GIB)]).shared_memory_nbytes == (
        2 * GIB
    )
    assert combine([rec(0, 5 * GIB), rec(1, None)]).shared_memory_nbytes is None
    assert combine([rec(0, None)]).shared_memory_nbytes is None
    assert combine([rec(0, 0), rec(1, GIB)]).shared_memory_nbytes == 0


# ----------------------------------------------------------------------------- slots
def test_slots_needed_formula() -> None:
    assert slots_needed(1.0, 1.0, None) == 2  # rank-local: L == P
    assert slots_needed(1.2, 1.0, None) == 3  # AllGather: P < L <= 2P
    assert slots_needed(1.2, 1.0, 10.0) == 2  # compute dominates: the cycle is hidden
    assert slots_needed(3.5, 1.0, 0.5) == 4  # long latency, short compute: capped at 4
    assert slots_needed(0.0, 0.0, None) == 2  # an empty block


@pytest.mark.parametrize(
    "stack, ag, expected",
    [
        (_stack(transfer="rank-local"), 500e9, 2),
        (_stack(group_size=1), None, 2),
        (_stack(), 500e9, 3),  # auto -> allgather
        (_stack(), 10e9, 2),  # auto -> rank-local
        (_stack(transfer="allgather"), 10e9, 3),
    ],
)
def test_auto_slots(stack: StackSpec, ag: float | None, expected: int) -> None:
    assert decide(_input(stack, ag=ag, num_slots="auto")).num_slots == expected


def test_a_known_compute_never_gives_fewer_slots_than_without_it() -> None:
    # the model with the real t_c says two AllGather slots hide a long compute, but a third
    # measured faster where the model is near its edge (4096 tokens): the hint adds, never
    # removes (no shared memory: AllGather stays)
    d = decide(_input(_stack(), num_slots="auto", block_compute_s=1.0))
    assert d.stacks[0].transfer == "allgather" and d.num_slots == 3
    without = decide(_input(_stack(), num_slots="auto"))
    assert without.stacks[0].transfer == "allgather" and without.num_slots == 3
    # with room in shared memory the long compute takes node-shared: whole blocks, L = P
    d = decide(_input(_stack(), num_slots="auto", block_compute_s=1.0, shm=100 * GIB))
    assert d.stacks[0].transfer == "node-shared" and d.num_slots == 2
    assert "hides every whole-block copy" in d.stacks[0].reason


@pytest.mark.parametrize(
    ("compute_ms", "expected"),
    [(None, "allgather"), (1.0, "allgather"), (50.0, "node-shared")],
)
def test_node_shared_over_a_faster_allgather_only_when_compute_hides_whole_copies(
    compute_ms: float | None, expected: str
) -> None:
    # 64 MiB at H: one whole-block copy takes about 1.3 ms at 50 GB/s
    stack = _stack((64 * MIB,) * 4)
    t_c = compute_ms / 1e3 if compute_ms is not None else None
    d = decide(_input(stack, block_compute_s=t_c, shm=100 * GIB))
    assert d.stacks[0].transfer == expected
    assert d.stacks[0].group_size == (2 if expected == "allgather" else 1)


def test_compute_hinted_node_shared_without_room_falls_back_to_allgather() -> None:
    stack = _stack((64 * MIB,) * 4)
    d = decide(_input(stack, block_compute_s=0.05, shm=MIB))
    c = d.stacks[0]
    assert (c.transfer, c.group_axis, c.group_size) == ("allgather", "data", 2)
    assert "allgather: the node's copy needs" in c.reason, c.reason


@pytest.mark.parametrize("n", [1, 2, 5])
def test_explicit_slots_are_kept(n: int) -> None:
    assert decide(_input(_stack(), num_slots=n)).num_slots == n


def _budget(weights: int, held: int = 0) -> float:
    """The device_budget_gb whose room holds ``weights`` of slots and resident blocks beside
    ``held`` bytes already on the device and the activation headroom ([Note: device
    budget])."""
    return (held + math.ceil(weights / (1 - FREE_MEMORY_HEADROOM)) + 1024) / GIB


def test_auto_slots_shrink_to_fit_the_budget() -> None:
    slot = padded_nbytes(64 * MIB, 2, 64 * MIB)
    budget = _budget(2 * slot + MIB)  # room for two slots, not three
    d = decide(_input(_stack((64 * MIB,) * 4), num_slots="auto", device_budget_gb=budget))
    assert d.num_slots == 2 and d.resident_layers == 0


# ----------------------------------------------------------------------------- resident blocks
@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_budget_keeps_as_many_leading_blocks_as_fit(k: int) -> None:
    n, size, non_block = 10, 16 * MIB, 5 * MIB
    p = padded_nbytes(size, 2, 64 * MIB)
    budget = _budget(2 * p + k * p + p // 2, held=non_block)
    d = decide(
        _input(
            _stack((size,) * n),
            resident_layers="auto",
            device_budget_gb=budget,
            non_block_nbytes=non_block,
        )
    )
    assert d.resident_layers == k
    assert d.stacks[0].num_resident == k
    assert d.device_weight_nbytes == non_block + 2 * p + k * p
    assert d.device_weight_nbytes <= budget * GIB


def test_all_blocks_resident_frees_the_slots() -> None:
    """The cost is not monotonic: once every block is resident no slot is needed."""
    sizes = (4 * MIB, MIB, MIB, MIB)
    pad = [padded_nbytes(s, 1, 64 * MIB) for s in sizes]
    stack = _stack(sizes, transfer="rank-local")
    # r=0: 2*4 = 8; r=1: 4+2 = 6; r=2: 5+2 = 7; r=3: 6+2 = 8; r=4: 7 + 0 slots
    everything = sum(pad)
    d = decide(_input(stack, resident_layers="auto", device_budget_gb=_budget(everything)))
    assert d.resident_layers == 4 and d.slot_nbytes == 0
    d = decide(_input(stack, resident_layers="auto", device_budget_gb=_budget(pad[0] + 2 * pad[1])))
    assert d.resident_layers == 1 and d.slot_nbytes == pad[1]


def test_resident_auto_from_free_memory_leaves_headroom() -> None:
    size = 16 * MIB
    p = padded_nbytes(size, 2, 64 * MIB)
    to_place = 3 * MIB
    free = int((to_place + 2 * p + 3 * p + p // 2) / (1 - FREE_MEMORY_HEADROOM)) + 1
    d = decide(
        _input(
            _stack((size,) * 10),
            resident_layers="auto",
            free=free,
            non_block_nbytes=to_place,
            non_block_to_place_nbytes=to_place,
        )
    )
    assert d.resident_layers == 3


def test_resident_auto_without_any_capacity_keeps_none() -> None:
    d = decide(_input(_stack((MIB,) * 4), resident_layers="auto", free=None))
    assert d.resident_layers == 0 and "unknown" in d.explanation


def test_resident_split_per_dit_over_its_stacks_and_eligibility() -> None:
    a1 = _stack((MIB,) * 2, name="a.blocks", dit_path="a", transfer="rank-local")
    a2 = _stack((MIB,) * 3, name="a.single", dit_path="a", transfer="rank-local")
    b = _stack((MIB,) * 4, name="b.blocks", dit_path="b", transfer="rank-local")
    c = _stack((MIB,) * 4, name="c.blocks", dit_path="c", transfer="rank-local", eligible=False)
    enc = _stack(
        (MIB,) * 4, name="e.layers", component="encoder", dit_path="e", transfer="rank-local"
    )
    d = decide(_input(a1, a2, b, c, enc, resident_layers="auto", device_budget_gb=1.0))
    # every eligible DiT keeps the same count, capped by the smallest eligible DiT (b: 4)
    assert d.resident_layers == 4
    assert [s.num_resident for s in d.stacks] == [2, 2, 4, 0, 0]


def test_explicit_resident_is_kept() -> None:
    d = decide(_input(_stack((MIB,) * 4, num_resident=2), resident_layers=2, free=GIB))
    assert d.resident_layers == 2 and d.stacks[0].num_resident == 2


def test_budget_too_small_names_the_field_and_value() -> None:
    with pytest.raises(ValueError, match=r"device_budget_gb=0\.001 cannot hold"):
        decide(_input(_stack((64 * MIB,)), device_budget_gb=0.001, non_block_nbytes=MIB))


# ----------------------------------------------------------------------------- determinism, output
def test_decision_is_deterministic_and_plain() -> None:
    inp = _input(_stack((64 * MIB,) * 6), num_slots="auto", resident_layers="auto", free=GIB)
    a, b = decide(inp), decide(inp)
    assert a == b and a.explanation == b.explanation
    d = json.loads(json.dumps(a.as_dict()))
    assert d["num_slots"] == a.num_slots
    assert d["stacks"]["dit.blocks"]["transfer"] == "allgather"
    assert d["measured"]["h2d_GBps"] == pytest.approx(50.0)
    assert "GB/s" in d["explanation"] and "allgather" in d["explanation"]


@settings(max_examples=200, deadline=None)
@given(
    h2d=st.floats(1e8, 1e12),
    ag=st.floats(1e8, 1e13),
    g=st.integers(2, 8),
    sizes=st.lists(st.integers(1, 512 * MIB), min_size=1, max_size=4),
    chunk_mb=st.sampled_from([1, 16, 64]),
)
def test_auto_picks_the_smaller_modeled_time(
    h2d: float, ag: float, g: int, sizes: list[int], chunk_mb: int
) -> None:
    inp = _input(_stack(tuple(sizes), group_size=g), h2d=h2d, ag=ag, chunk=chunk_mb * MIB)
    s = decide(inp).stacks[0]
    assert s.allgather_ms is not None
    best = min(s.rank_local_ms, s.allgather_ms)
    chosen = s.allgather_ms if s.transfer == "allgather" else s.rank_local_ms
    assert chosen == best
    assert (s.transfer == "allgather") == (s.allgather_ms < s.rank_local_ms)
    assert decide(inp) == decide(inp)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "change, exc, needles",
    [
        ({"measured": Measurements(h2d_bps=0.0)}, ValueError, ["h2d_bps=0.0"]),
        ({"measured": Measurements(h2d_bps=math.nan)}, ValueError, ["h2d_bps=nan"]),
        (
            {"measured": Measurements(h2d_bps=H, allgather_bps={"data": -1.0})},
            ValueError,
            ["allgather_bps['data']=-1.0"],
        ),
        ({"num_slots": "three"}, TypeError, ["num_slots", "'three'"]),
        ({"num_slots": 0}, ValueError, ["num_slots", "got 0"]),
        ({"resident_layers": -1}, ValueError, ["resident_layers", "got -1"]),
        ({"resident_layers": True}, TypeError, ["resident_layers", "True"]),
        ({"device_budget_gb": 0}, ValueError, ["device_budget_gb", "got 0"]),
        ({"chunk_nbytes": 0}, ValueError, ["chunk_nbytes", "got 0"]),
        ({"stacks": (_stack(transfer="nccl"),)}, ValueError, ["transfer='nccl'"]),
    ],
)
def test_bad_input_is_rejected_naming_the_field(
    change: dict[str, Any], exc: type[Exception], needles: list[str]
) -> None:
    import dataclasses

    inp = dataclasses.replace(_input(_stack()), **change)
    with pytest.raises(exc) as info:
        decide(inp)
    assert all(n in str(info.value) for n in needles), (str(info.value), needles)


@pytest.mark.parametrize("transfer", ["auto", "allgather"])
def test_gathering_stack_without_a_measurement_is_an_error(transfer: str) -> None:
    # an explicit AllGather stack's slots are sized by the gather's time too: a guessed
    # bandwidth gave 2 slots where 3 are needed
    with pytest.raises(ValueError, match="no AllGather measurement for axis 'data'"):
        decide(_input(_stack(transfer=transfer), ag=None, num_slots="auto"))


# ----------------------------------------------------------------------------- config knobs
def test_config_accepts_auto_and_budget() -> None:
    cfg = OffloadConfig(
        transfer="auto", resident_layers="auto", num_slots="auto", device_budget_gb=40.0
    )
    assert cfg.resident_layers_for("dit") == "auto" and cfg.num_slots == "auto"
    assert OffloadConfig(device_budget_gb=8).device_budget_gb == 8
    opts = OffloadConfig(layer_options={"dit": {"resident_layers": "auto"}})
    assert opts.resident_layers_for("dit") == "auto"
    assert OffloadConfig.from_dict(
        {"mode": "layer", "num_slots": "auto", "resident_layers": "auto", "device_budget_gb": 2}
    ) == OffloadConfig(num_slots="auto", resident_layers="auto", device_budget_gb=2)


@pytest.mark.parametrize(
    "kwargs, exc, needles",
    [
        ({"num_slots": "Auto"}, TypeError, ["num_slots", "'Auto'"]),
        ({"resident_layers": "all"}, TypeError, ["resident_layers", "'all'"]),
        ({"device_budget_gb": 0}, ValueError, ["device_budget_gb", "0"]),
        ({"device_budget_gb": math.inf}, ValueError, ["device_budget_gb", "inf"]),
        ({"device_budget_gb": "40"}, TypeError, ["device_budget_gb", "'40'"]),
        ({"device_budget_gb": True}, TypeError, ["device_budget_gb", "True"]),
        ({"mode": "module", "num_slots": "auto"}, ValueError, ["num_slots='auto'", "module"]),
        (
            {"mode": "module", "resident_layers": "auto"},
            ValueError,
            ["resident_layers='auto'", "module"],
        ),
        ({"mode": "module", "device_budget_gb": 8.0}, ValueError, ["device_budget_gb=8.0"]),
        (
            {"components": ("encoder",), "resident_layers": "auto"},
            ValueError,
            ["resident_layers=auto", "('encoder',)"],
        ),
        (
            {
                "components": ("dit", "encoder"),
                "layer_options": {"encoder": {"resident_layers": "auto"}},
            },
            ValueError,
            ["layer_options['encoder'].resident_layers=auto"],
        ),
    ],
)
def test_config_rejects_bad_policy_knobs(
    kwargs: dict[str, Any], exc: type[Exception], needles: list[str]
) -> None:
    with pytest.raises(exc) as info:
        OffloadConfig(**kwargs)
    for n in needles:
        assert n in str(info.value), (n, str(info.value))


def test_layer_options_resident_auto_type() -> None:
    assert LayerOptions(resident_layers="auto").resident_layers == "auto"
    with pytest.raises(TypeError, match=r"layer_options\.resident_layers"):
        LayerOptions(resident_layers="some")


def test_non_block_bytes_combine_to_the_largest() -> None:
    from dlo.runtime.measure import RankMeasurement, combine_non_block

    records = [
        RankMeasurement(0, non_block_nbytes=66624, non_block_to_place_nbytes=100),
        RankMeasurement(1, non_block_nbytes=33856, non_block_to_place_nbytes=200),
    ]
    assert combine_non_block(records) == (66624, 200)


def test_differing_requests_name_automatic_fields_only() -> None:
    from dlo.backends.auto import differing_requests, requested_settings

    auto = requested_settings(OffloadConfig(num_slots="auto", chunk_mb=32))
    fixed = requested_settings(OffloadConfig(num_slots=3))
    assert differing_requests([auto, auto]) == ""
    assert differing_requests([auto, fixed]) == "num_slots: rank 0='auto', rank 1=3"
    # explicit values that differ are the startup agreement's to name
    assert differing_requests([fixed, requested_settings(OffloadConfig(num_slots=2))]) == ""
    budget = requested_settings(OffloadConfig(device_budget_gb=2.0))
    assert "device_budget_gb: rank 0=None, rank 1=2.0" in differing_requests([fixed, budget])


def test_mapped_backing_keeps_every_automatic_stack_rank_local() -> None:
    # the mapped backing streams rank-local stacks only: "auto" must not pick what enable
    # would then refuse
    for compute in (None, 1.0):
        d = decide(
            _input(
                _stack(), ag=SMALL_AG, shm=100 * GIB, block_compute_s=compute, host_backing="mapped"
            )
        )
        assert d.stacks[0].transfer == "rank-local" and "mapped" in d.stacks[0].reason
    d = decide(_input(_stack(), ag=5000e9, host_backing="mapped"))
    assert d.stacks[0].transfer == "rank-local"


def test_the_compute_hint_is_the_dits() -> None:
    # an encoder block computes far less than a DiT block: the hint does not move it
    enc = _stack((64 * MIB,) * 4, name="te.layers", component="encoder", dit_path="te")
    d = decide(_input(enc, block_compute_s=0.05, shm=100 * GIB))
    assert d.stacks[0].transfer == "allgather"


def test_slots_beyond_the_streamed_blocks_are_neither_allocated_nor_budgeted() -> None:
    """Issue 26 item 6: ``num_slots`` may ask for more slots than blocks stream; the budget
    and the explanation count one slot per streamed block."""
    stack = _stack((64 * MIB,) * 3, group_size=1, transfer="rank-local")
    budget = _budget(3 * 64 * MIB + 8 * MIB)  # three slots, not a thousand
    d = decide(_input(stack, num_slots=1000, device_budget_gb=budget))
    assert d.num_slots == 1000
    assert d.device_weight_nbytes == 3 * d.slot_nbytes
    assert "3 allocated, one per streamed block" in d.explanation
    assert "+ 3 slot(s) x" in d.explanation


@pytest.mark.parametrize(
    ("compute_ms", "transfer", "expected"),
    [
        (None, "rank-local", "none"),  # no compute time: no modeled gain
        (0.5, "rank-local", "ans"),  # a 64 MiB copy at 50 GB/s takes 1.34 ms
        (5.0, "rank-local", "none"),  # the compute hides it
        (0.5, "node-shared", "ans"),  # whole blocks over the rank's own link, as rank-local
        (5.0, "node-shared", "none"),
    ],
)
def test_auto_codec_where_the_copy_outlasts_the_compute(
    compute_ms: float | None, transfer: str, expected: str
) -> None:
    stack = dataclasses.replace(_stack(transfer=transfer, group_size=1), codec="auto")
    d = decide(_input(stack, block_compute_s=compute_ms / 1e3 if compute_ms is not None else None))
    c = d.stacks[0]
    assert (c.codec, c.codec_reason.startswith("auto: ")) == (expected, True)
    assert f"codec {expected} (auto: " in d.explanation
    assert d.as_dict()["stacks"][stack.name]["codec"] == expected


def test_an_explicit_codec_is_kept() -> None:
    stack = dataclasses.replace(_stack(transfer="rank-local", group_size=1), codec="ans")
    c = decide(_input(stack, block_compute_s=1.0)).stacks[0]
    assert (c.codec, c.codec_reason) == ("ans", "explicit")
    # an unset codec resolved for a CPU device ([Note: automatic by default]) says so
    stack = dataclasses.replace(stack, codec="none")
    d = decide(_input(stack, block_compute_s=1e-4, defaults=frozenset({"codec"})))
    reason = "unset: a CPU device's default; codec='auto' decides it"
    assert (d.stacks[0].codec, d.stacks[0].codec_reason) == ("none", reason)
    assert f"codec none ({reason})" in d.explanation


def test_auto_codec_takes_none_where_a_rank_has_no_codec() -> None:
    """On a GPU without nvCOMP (on any rank) "auto", given or the GPU's default, is "none"
    at enable: "ans" there would fail the enable."""
    from dlo.runtime.measure import RankMeasurement, combine

    stack = dataclasses.replace(_stack(transfer="rank-local", group_size=1), codec="auto")
    inp = _input(stack, block_compute_s=0.5e-3)  # the copy outlasts the compute
    assert decide(inp).stacks[0].codec == "ans"
    inp = dataclasses.replace(
        inp, measured=dataclasses.replace(inp.measured, codec_available=False)
    )
    c = decide(inp).stacks[0]
    assert (c.codec, c.codec_reason) == (
        "none",
        "auto: no codec on this platform (nvCOMP is not installed)",
    )
    recs = [RankMeasurement(0, h2d_bps=H), RankMeasurement(1, h2d_bps=H, codec_available=False)]
    assert combine(recs[:1]).codec_available and not combine(recs).codec_available


def test_the_decode_staging_buffers_are_in_the_device_model() -> None:
    """Two staging buffers of the largest (raw, an upper bound) shard when a stack decodes."""
    plain = _stack((64 * MIB, 32 * MIB), transfer="rank-local", group_size=1)
    coded = dataclasses.replace(plain, codec="ans")
    a, b = decide(_input(plain)), decide(_input(coded))
    slot = padded_nbytes(64 * MIB, 1, 64 * MIB)
    assert b.device_weight_nbytes - a.device_weight_nbytes == 2 * slot
    assert f"decode staging {2 * slot / MIB:.2f} MiB (at most)" in b.explanation
    assert "decode staging" not in a.explanation


def test_auto_codec_not_where_the_gather_or_residency_bounds_it_nor_for_encoders() -> None:
    # AllGather of 8: the H2D stage (1/8 of each block) is hidden, the raw gather is not
    gather = dataclasses.replace(
        _stack((256 * MIB,) * 2, transfer="allgather", group_size=8), codec="auto"
    )
    c = decide(_input(gather, h2d=50e9, ag=60e9, block_compute_s=4e-3)).stacks[0]
    assert c.codec == "none" and "gather" in c.codec_reason
    # every block resident: nothing streams, nothing to decode
    resident = dataclasses.replace(
        _stack(transfer="rank-local", group_size=1, num_resident=1), codec="auto"
    )
    d = decide(_input(resident, resident_layers=1, block_compute_s=1e-4))
    assert d.stacks[0].codec == "none" and d.stacks[0].codec_reason.endswith("resident")
    assert "decode staging" not in d.explanation
    # block_compute_ms is a DiT block's: an encoder stack is not judged by it
    encoder = dataclasses.replace(
        _stack(transfer="rank-local", group_size=1, component="encoder", name="te.layers"),
        codec="auto",
    )
    assert decide(_input(encoder, block_compute_s=1e-4)).stacks[0].codec == "none"


@pytest.mark.parametrize(
    ("component", "note"),
    [
        ("dit", "(unset: a CPU device's default; resident_layers='auto' decides it)"),
        ("text_encoder", "(unset: no DiT selected, no resident blocks)"),
    ],
)
def test_an_unset_resident_count_is_named_for_what_it_is(component: str, note: str) -> None:
    """[Note: automatic by default]: unset resident_layers is 0 on a CPU device, and 0 on
    any device where the config selects no DiT ("auto" there would be refused)."""
    stack = _stack(transfer="rank-local", group_size=1, component=component)
    d = decide(
        _input(
            stack,
            free=GIB,
            resident_layers=0,
            num_slots="auto",
            defaults=frozenset({"resident_layers"}),
        )
    )
    (line,) = [ln for ln in d.explanation.splitlines() if "resident_layers:" in ln]
    assert line.endswith(note), line


def _held(held: int, free: int | None, **kw: Any) -> PolicyInput:
    inp = _input(_stack((512 * MIB,) * 8, transfer="rank-local", group_size=1), free=free, **kw)
    return dataclasses.replace(
        inp, measured=dataclasses.replace(inp.measured, held_device_nbytes=held)
    )


def test_a_budget_counts_what_the_process_holds_and_names_the_least_that_fits() -> None:
    """[Note: device budget]: the room is the budget less the bytes held at enable, a fifth
    of it kept for activations; a budget too small names the least budget that fits, and
    that budget fits."""
    held, to_place = 4 * GIB, 256 * MIB
    kw = {"num_slots": 2, "resident_layers": "auto", "non_block_nbytes": held + to_place}
    kw["non_block_to_place_nbytes"] = to_place
    d = decide(_held(held, 80 * GIB, device_budget_gb=8.0, **kw))
    assert d.capacity_nbytes == int((8 * GIB - held) * (1 - FREE_MEMORY_HEADROOM)) - to_place
    assert "device_budget_gb 8.00 GiB: at most" in d.explanation
    with pytest.raises(ValueError, match=r"a budget of at least 5\.56 GiB") as e:
        decide(_held(held, 80 * GIB, device_budget_gb=5.0, **kw))
    assert "4.00 GiB already there" in str(e.value) and "only" not in str(e.value)
    least = held + (to_place + 2 * 512 * MIB) / (1 - FREE_MEMORY_HEADROOM)
    assert decide(_held(held, 80 * GIB, device_budget_gb=least / GIB + 1e-6, **kw)).num_slots == 2
    with pytest.raises(ValueError, match=r"\(the device has only 1\.00 GiB free\)"):
        decide(_held(held, GIB, device_budget_gb=8.0, **kw))  # the device binds, not the budget


@pytest.mark.parametrize("r", [0, 3])
def test_an_explicit_resident_count_is_kept_under_a_budget_and_must_fit(r: int) -> None:
    """Issue 35 item 1: an explicit setting always wins: under a budget an explicit count
    (0 included) is kept, not revised to "auto"; one that does not fit is refused naming the
    budget and the least that fits."""
    assert OffloadConfig(resident_layers=r, device_budget_gb=40.0).resident_layers == r

    def stack(n: int) -> StackSpec:  # the topology lays out an explicit count
        return _stack((512 * MIB,) * 8, transfer="rank-local", group_size=1, num_resident=n)

    d = decide(_input(stack(r), free=80 * GIB, resident_layers=r, device_budget_gb=8.0))
    assert d.resident_layers == r and d.stacks[0].num_resident == r
    with pytest.raises(ValueError, match=r"device_budget_gb=1\.0 cannot hold .* a budget of"):
        decide(_input(stack(r + 1), free=80 * GIB, resident_layers=r + 1, device_budget_gb=1.0))


def test_the_rings_whose_codec_was_turned_on_are_settled() -> None:
    """``dlo run``'s settled line names the rings whose codec a measurement turned on."""
    from dlo.plan.policy_explain import late_codecs

    assert late_codecs({}) == [] and late_codecs({"": "watching", "t": "off"}) == []
    assert late_codecs({"transformer": "on", "": "on", "t2": "encoding"}) == [
        "codec=ans by measurement (the model, transformer)"
    ]
