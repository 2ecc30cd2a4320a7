"""The learned execution order of a component's blocks ([Note: prefetch chain])."""

from __future__ import annotations

import pytest

from dlo.runtime.chain import ExecutionOrder, learn


def _order(declared: list[str]) -> ExecutionOrder[str]:
    return ExecutionOrder(declared, name=str)


def _run(order: ExecutionOrder[str], entries: list[str]) -> list[bool]:
    return [order.observe(b) for b in entries]


def test_before_anything_ran_the_prediction_is_declared_cyclic_order() -> None:
    order = _order(["a0", "a1", "b0", "b1"])
    assert order.after("a1", 2) == ["b0", "b1"]  # across the seam
    assert order.after("b1", 3) == ["a0", "a1", "b0"]  # wraps, never the block itself
    assert order.after("a0", 10) == ["a1", "b0", "b1"]


def test_stacks_out_of_declared_order_are_learned_on_the_first_forward() -> None:
    order = _order(["a0", "a1", "b0", "b1"])  # declared a then b; runs b then a
    assert not order.observe("b0")
    assert order.after("b0", 1) == ["b1"]  # unseen, declared successors first
    assert not order.observe("b1")
    assert order.after("b1", 1) == ["a0"]  # the seam predicted in the first forward already
    assert _run(order, ["a0", "a1"]) == [False, True]  # every block entered: fixed
    assert order.learned == ["b0", "b1", "a0", "a1"]
    assert order.after("a1", 2) == ["b0", "b1"]  # the last block prefetches the first
    assert not order.observe("b0")  # fixed once


def test_interleaved_stacks_are_learned() -> None:
    order = _order(["s0", "s1", "t0", "t1"])
    _run(order, ["s0", "t0", "s1", "t1"])
    assert order.learned == ["s0", "t0", "s1", "t1"]
    assert [order.after(b, 1)[0] for b in ["s0", "t0", "s1", "t1"]] == ["t0", "s1", "t1", "s0"]


def test_a_block_entering_again_fixes_the_order_and_unrun_blocks_are_off_the_ring() -> None:
    order = _order(["a0", "a1", "v0", "v1"])  # an optional stack v never runs
    assert _run(order, ["a0", "a1", "a0"]) == [False, False, True]
    assert order.learned == ["a0", "a1"]
    assert order.after("a1", 3) == ["a0"]  # the ring is what ran
    assert order.after("v0", 2) == ["v1", "a0"]  # off the ring: declared successors
    # an off-ring block joins the ring after the block that ran before it, once
    assert _run(order, ["a1", "v0", "v1"]) == [False, False, False]
    assert order.learned == ["a0", "a1", "v0", "v1"]
    assert order.after("a1", 1) == ["v0"] and order.after("v1", 1) == ["a0"]


def test_a_first_forward_cut_short_is_completed_by_the_next_one() -> None:
    order = _order(["b0", "b1", "b2", "b3"])
    _run(order, ["b0", "b1"])  # an exception before b2
    assert _run(order, ["b0", "b1", "b2", "b3"]) == [True, False, False, False]
    assert order.learned == ["b0", "b1", "b2", "b3"]
    assert order.after("b3", 1) == ["b0"]


def test_digest_depends_on_the_order_and_describe_names_it() -> None:
    one, two = _order(["a", "b", "c"]), _order(["a", "b", "c"])
    _run(one, ["a", "b", "c"])
    _run(two, ["b", "a", "c"])
    assert one.digest() != two.digest()
    again = _order(["a", "b", "c"])
    _run(again, ["a", "b", "c"])
    assert one.digest() == again.digest() and 0 <= one.digest() < 2**63
    assert two.describe() == "b, a, c (3 blocks)"


def test_learn_agrees_once_when_fixed_and_logs_an_order_other_than_declared(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="dlo.runtime.chain")
    agreed: list[int] = []
    order = _order(["a", "b"])
    for b in ["b", "a", "b", "a"]:
        learn(order, b, lambda value, describe: agreed.append(value), "transformer")
    assert agreed == [order.digest()]
    assert any(
        "transformer runs its blocks out of declared order" in r.message for r in caplog.records
    )
    caplog.clear()
    in_order = _order(["a", "b"])
    for b in ["a", "b"]:
        learn(in_order, b, lambda value, describe: agreed.append(value), "transformer")
    assert len(agreed) == 2 and not caplog.records
