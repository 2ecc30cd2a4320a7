"""Which blocks ``host_budget_gb`` keeps in host memory ([Note: host budget tiers])."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo.plan.host_tiers import choose_on_disk
from dlo.plan.layers import ENCODED_AXIS, check_stacks, plan_layers
from dlo.plan.topology import BlockStack
from dlo.platform.env import page_size


def test_nothing_on_disk_when_every_block_fits() -> None:
    assert choose_on_disk([4, 4, 4], ["dit"] * 3, [True, False, False], 12) == frozenset()


def test_resident_blocks_go_to_disk_first() -> None:
    # two resident blocks cross the link once: the budget keeps the streamed ones
    on_disk = choose_on_disk([4, 4, 4, 4], ["dit"] * 4, [True, True, False, False], 8)
    assert on_disk == {0, 1}


def test_dit_blocks_are_kept_before_encoder_blocks() -> None:
    comps = ["encoder", "encoder", "dit", "dit"]
    assert choose_on_disk([4, 4, 4, 4], comps, [False] * 4, 8) == {0, 1}
    # what the DiT leaves goes to the encoder
    assert choose_on_disk([4, 4, 4, 4], comps, [False] * 4, 12) == {0}


def test_kept_blocks_are_spread_evenly_along_the_ring() -> None:
    on_disk = choose_on_disk([1] * 12, ["dit"] * 12, [False] * 12, 4)
    kept = sorted(set(range(12)) - on_disk)
    assert kept == [2, 5, 8, 11]  # one in three, never two in a row


def test_zero_budget_reads_every_block() -> None:
    assert choose_on_disk([3, 5], ["dit", "encoder"], [False, True], 0) == {0, 1}


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 100), min_size=1, max_size=30),
    data=st.data(),
)
def test_the_kept_bytes_fit_the_budget_and_no_block_that_fits_is_left(
    sizes: list[int], data: st.DataObject
) -> None:
    n = len(sizes)
    comps = data.draw(st.lists(st.sampled_from(["dit", "encoder"]), min_size=n, max_size=n))
    resident = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    budget = data.draw(st.integers(0, sum(sizes) + 10))
    on_disk = choose_on_disk(sizes, comps, resident, budget)
    kept = [i for i in range(n) if i not in on_disk]
    held = sum(sizes[i] for i in kept)
    assert held <= budget
    if sum(sizes) <= budget:
        assert not on_disk
    else:  # greedy completion: no streamed block left on disk would still fit
        assert all(resident[i] or sizes[i] > budget - held for i in on_disk)


def _stack(transfer: str = "rank-local", codec: str = "none", size: int = 1) -> BlockStack:
    return BlockStack(
        component="dit",
        component_path="",
        container_path="blocks",
        block_paths=tuple(f"blocks.{i}" for i in range(4)),
        transfer=transfer,
        num_resident=1,
        group_axis="local" if size == 1 else "shard",
        group_size=size,
        codec=codec,
    )


def test_the_layer_plan_gives_disk_blocks_no_region_bytes() -> None:
    t = {f"blocks.{i}": [("w", "param", (64, 64), (64, 1), torch.float32)] for i in range(4)}
    plan = plan_layers([_stack()], t, chunk_nbytes=1 << 20, num_slots=2, host_budget_nbytes=32768)
    # block 0 is resident: it goes to disk first; two of the three streamed ones fit
    assert plan.on_disk == {0, 1} and plan.from_file == [0, 1]
    assert plan.region_nbytes == [0, 0, 16384, 16384]
    none = plan_layers([_stack()], t, chunk_nbytes=1 << 20, num_slots=2)
    assert none.on_disk == frozenset() and none.from_file == []


def test_the_tiers_count_encoded_copies_and_the_region_s_pages() -> None:
    """``tiered`` chooses again with the bytes the budget really holds: an encoded copy's
    (given by position) where known, every size rounded up to a page of the region."""
    p = page_size()
    dim = math.isqrt(p)  # a block of 4 pages
    t = {f"blocks.{i}": [("w", "param", (dim, dim), (dim, 1), torch.float32)] for i in range(4)}
    kw: dict[str, Any] = {"chunk_nbytes": 1 << 20, "num_slots": 2}
    roomy = plan_layers([_stack(codec="ans")], t, host_budget_nbytes=9 * p, **kw)
    assert roomy.on_disk == {0, 1}  # raw: two of the three streamed 4-page blocks fit
    encoded = {i: int(2.45 * p) for i in range(1, 4)}  # three pages each in the region
    assert roomy.tiered(encoded).on_disk == {0}  # all three fit in 9 pages
    # 7.4 pages hold three copies of 2.45 pages, but not their nine pages
    tight = plan_layers([_stack(codec="ans")], t, host_budget_nbytes=int(7.4 * p), **kw)
    assert tight.tiered(encoded).on_disk == {0, 1}
    assert plan_layers([_stack()], t, **kw).tiered(encoded).on_disk == frozenset()  # no budget


@pytest.mark.parametrize(
    ("stack", "what"),
    [
        (_stack(codec="ans", transfer="allgather", size=2), "codec 'ans'.*gathers"),
        (_stack(transfer="node-shared"), "transfer 'node-shared'"),
    ],
)
def test_what_the_disk_tier_does_not_serve_yet_is_refused_by_name(
    stack: BlockStack, what: str
) -> None:
    with pytest.raises(ValueError, match=f"host_budget_gb.*{what}"):
        check_stacks([stack], host_backing="region", host_budget=0)
    with pytest.raises(ValueError, match=r"host_budget_gb.*host_backing='mapped'"):
        check_stacks([_stack()], host_backing="mapped", host_budget=0)


def test_a_codec_s_disk_blocks_are_read_by_their_own_reader() -> None:
    """[Note: encoded blocks on disk]: a rank-local stack with a codec is served under a
    budget, its disk blocks read whole and encoded by the ENCODED_AXIS reader."""
    t = {f"blocks.{i}": [("w", "param", (64, 64), (64, 1), torch.float32)] for i in range(4)}
    kw: dict[str, Any] = dict(chunk_nbytes=1 << 20, num_slots=2, host_budget_nbytes=32768)
    plan = plan_layers([_stack(codec="ans")], t, **kw)
    assert plan.on_disk == {0, 1} and plan.read_ahead_sizes == {ENCODED_AXIS: 16384}
    assert plan_layers([_stack()], t, **kw).read_ahead_sizes == {"local": 16384}


def test_the_read_ahead_buffers_are_pinned_out_of_the_pin_budget_first() -> None:
    t = {f"blocks.{i}": [("w", "param", (64, 64), (64, 1), torch.float32)] for i in range(4)}
    kw: dict[str, Any] = dict(chunk_nbytes=1 << 20, num_slots=2, host_budget_nbytes=32768)
    plan = plan_layers([_stack()], t, pin_budget_nbytes=50_000, **kw)
    assert plan.read_ahead_nbytes == 2 * 16384
    # the buffers take theirs first; the kept blocks' region pins what is left
    assert plan.read_ahead_pin_budgets() == {"local": 32768}
    assert plan.private_pin_budget_nbytes == 50_000 - 32768
    tight = plan_layers([_stack()], t, pin_budget_nbytes=20_000, **kw)
    assert tight.read_ahead_pin_budgets() == {"local": 20_000}
    assert tight.private_pin_budget_nbytes == 0
    free = plan_layers([_stack()], t, **kw)
    assert free.read_ahead_pin_budgets() == {"local": None}
    assert free.private_pin_budget_nbytes is None
    assert plan_layers([_stack()], t, chunk_nbytes=1 << 20, num_slots=2).read_ahead_nbytes == 0


def test_an_allgather_stacks_disk_shards_are_one_nth_of_each_block() -> None:
    """Each rank of a group of 2 keeps, and reads, its half of a block: the budget counts
    shards, the read-ahead buffers are a shard each, on the stack's weight axis."""
    t = {f"blocks.{i}": [("w", "param", (64, 64), (64, 1), torch.float32)] for i in range(4)}
    gathered = _stack(transfer="allgather", size=2)
    plan = plan_layers(
        [gathered], t, chunk_nbytes=1 << 20, num_slots=3, host_budget_nbytes=2 * 8192
    )
    shard = plan.blocks[1].layout.shard_nbytes
    assert shard == plan.blocks[1].layout.padded_nbytes // 2
    assert plan.on_disk == {0, 1} and plan.region_nbytes == [0, 0, shard, shard]
    assert plan.read_ahead_sizes == {"shard": shard} and plan.read_ahead_nbytes == 2 * shard
