"""The startup verdict: settings, gather-engine choice, weight fingerprints (pure)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dlo.config.offload import OffloadConfig
from dlo.parallel.agreement import (
    AGREED_SETTINGS,
    BlockPrint,
    RankReport,
    WeightsDifferError,
    decide,
    gather_engine_verdict,
    settings_of,
    weights_verdict,
)
from dlo.parallel.records import decode, encode


def _reports(hosts: list[str], symmetric: list[bool]) -> list[RankReport]:
    return [
        RankReport(rank=r, ok=True, digest="d", host=h, symmetric_slots=s)
        for r, (h, s) in enumerate(zip(hosts, symmetric))
    ]


@pytest.mark.parametrize(
    ("hosts", "symmetric", "engine", "want"),
    [
        (["a", "a"], [True, True], "auto", "copy"),
        (["a", "a"], [True, True], "copy", "copy"),
        (["a", "a"], [True, True], "nccl", "nccl"),
        (["a", "b"], [True, True], "auto", "nccl"),  # two nodes
        (["a", "a"], [True, False], "auto", "nccl"),  # a rank without symmetric slots
        (["a"], [False], "copy", "nccl"),  # a group of one gathers nothing
    ],
)
def test_gather_engine_verdict(
    hosts: list[str], symmetric: list[bool], engine: str, want: str
) -> None:
    assert gather_engine_verdict(_reports(hosts, symmetric), engine) == want
    verdict = decide(_reports(hosts, symmetric), pin_failure_policy="fail", gather_engine=engine)
    assert verdict.ok and verdict.copy_gather == (want == "copy")


def test_copy_asked_across_nodes_fails_every_rank_naming_the_hosts() -> None:
    verdict = decide(
        _reports(["n1", "n1", "n2"], [True] * 3), pin_failure_policy="fail", gather_engine="copy"
    )
    assert not verdict.ok
    assert (
        "gather_engine='copy'" in verdict.message
        and "{0: 'n1', 1: 'n1', 2: 'n2'}" in verdict.message
    )


def test_copy_asked_without_symmetric_slots_names_the_ranks() -> None:
    verdict = decide(
        _reports(["n1", "n1"], [True, False]), pin_failure_policy="fail", gather_engine="copy"
    )
    assert not verdict.ok and "rank(s) [1] have no symmetric-memory slots" in verdict.message


def test_pageable_fallback_and_copy_gather_compose() -> None:
    reports = _reports(["a", "a"], [True, True])
    reports[1].unpinned_blocks = ("blocks.3",)
    verdict = decide(reports, pin_failure_policy="whole_block_fallback", gather_engine="auto")
    assert verdict.ok and verdict.fallback_blocks == ("blocks.3",) and verdict.copy_gather


def test_settings_that_differ_are_named_and_equal_ones_pass() -> None:
    same = settings_of(OffloadConfig(mode="layer"))
    assert [n for n, _ in same] == list(AGREED_SETTINGS)
    reports = [RankReport(rank=r, ok=True, digest="d", settings=same) for r in range(2)]
    assert decide(reports, pin_failure_policy="fail").ok
    other = settings_of(OffloadConfig(mode="layer", gather_sync="kernel", chunk_mb=32))
    reports[1] = RankReport(rank=1, ok=True, digest="d", settings=other)
    verdict = decide(reports, pin_failure_policy="fail")
    assert not verdict.ok
    assert "chunk_mb: rank 0=64, rank 1=32" in verdict.message
    assert "gather_sync: rank 0='auto', rank 1='kernel'" in verdict.message
    assert "num_slots" not in verdict.message


def _plan_stack(
    path: str, *, num_resident: int = 0, transfer: str = "rank-local", share_axis: str = "local"
) -> SimpleNamespace:
    """What settings_of reads of a plan's stack."""
    return SimpleNamespace(
        container_path=path, num_resident=num_resident, transfer=transfer, share_axis=share_axis
    )


def test_resolved_resident_counts_are_compared_per_stack() -> None:
    cfg = OffloadConfig(mode="layer", resident_layers="auto")

    def stacks(n: int) -> list[SimpleNamespace]:
        return [
            _plan_stack("dit.blocks", num_resident=n),
            _plan_stack("te.layers"),
        ]

    reports = [
        RankReport(rank=r, ok=True, digest="d", settings=settings_of(cfg, stacks(2)))
        for r in range(2)
    ]
    assert decide(reports, pin_failure_policy="fail").ok
    reports[1].settings = settings_of(cfg, stacks(1))
    verdict = decide(reports, pin_failure_policy="fail")
    assert not verdict.ok
    assert (
        "resident_layers: rank 0='dit.blocks=2, te.layers=0', "
        "rank 1='dit.blocks=1, te.layers=0'" in verdict.message
    )


def _verdict(*per_rank: list[SimpleNamespace]) -> tuple[bool, str]:
    cfg = OffloadConfig(mode="layer", transfer="auto")
    reports = [
        RankReport(rank=r, ok=True, digest="d", settings=settings_of(cfg, stacks))
        for r, stacks in enumerate(per_rank)
    ]
    verdict = decide(reports, pin_failure_policy="fail")
    return verdict.ok, verdict.message


def test_resolved_transfers_are_compared_per_stack() -> None:
    """rank-local and node-shared lay a block out alike (the digest cannot tell them apart),
    but a rank packing a node's shared copy beside one streaming privately fills it wrong."""
    shared = _plan_stack("dit.blocks", transfer="node-shared", share_axis="data")
    local = _plan_stack("dit.blocks")
    enc = _plan_stack("te.layers", transfer="allgather", share_axis="local")
    cfg = OffloadConfig(mode="layer")
    assert dict(settings_of(cfg, [shared, enc]))["transfer"] == (
        "dit.blocks=node-shared@data, te.layers=allgather"
    )
    assert dict(settings_of(cfg, [local]))["transfer"] == "dit.blocks=rank-local"
    assert dict(settings_of(cfg))["transfer"] == ""
    assert _verdict([shared, enc], [shared, enc]) == (True, "")
    assert _verdict([local, enc], [local, enc]) == (True, "")
    ok, msg = _verdict([shared, enc], [local, enc])
    assert not ok
    assert (
        "different settings (transfer: rank 0='dit.blocks=node-shared@data, "
        "te.layers=allgather', rank 1='dit.blocks=rank-local, te.layers=allgather')" in msg
    ), msg
    assert "resident_layers" not in msg


def test_node_shared_along_different_axes_or_stacks_is_refused() -> None:
    on_data = _plan_stack("dit.blocks", transfer="node-shared", share_axis="data")
    on_seq = _plan_stack("dit.blocks", transfer="node-shared", share_axis="sequence")
    ok, msg = _verdict([on_data], [on_seq])
    assert not ok and "rank 0='dit.blocks=node-shared@data'" in msg
    assert "rank 1='dit.blocks=node-shared@sequence'" in msg
    # another list of shared blocks: one stack node-shared on one rank only
    enc_shared = _plan_stack("te.layers", transfer="node-shared", share_axis="data")
    ok, msg = _verdict([on_data, _plan_stack("te.layers")], [on_data, enc_shared])
    assert not ok and "transfer:" in msg and "te.layers=node-shared@data" in msg, msg


# ----------------------------------------------------------------------------- weights
def _prints(
    digests: list[str],
    *,
    groups: list[list[int]] | None = None,
    hosts: str = "",
    node: bool = False,
    blocks: tuple[str, ...] = ("dit.blocks.0", "dit.blocks.1"),
    differ_from: int = 0,
) -> list[RankReport]:
    """One report per rank of ``digests``: block ``i`` fingerprinted ``digest`` for
    ``i >= differ_from`` and ``"same"`` before, each rank exchanging with its group of
    ``groups`` (default: every rank), on host ``hosts[rank]``."""
    world = len(digests)
    groups = groups or [list(range(world))]
    group = {r: tuple(g) for g in groups for r in g}
    return [
        RankReport(
            rank=r,
            ok=True,
            digest="d",
            host=hosts[r] if hosts else "h",
            weights=tuple(
                BlockPrint(b, group[r], node, d if i >= differ_from else "same", f"file-{d}")
                for i, b in enumerate(blocks)
            ),
        )
        for r, d in enumerate(digests)
    ]


def test_equal_fingerprints_agree() -> None:
    assert decide(_prints(["a", "a", "a"]), pin_failure_policy="fail").ok
    assert weights_verdict(_prints(["a", "a"])) == ""


@pytest.mark.parametrize("world", [2, 3])
def test_different_weights_are_refused_naming_each_rank_and_the_first_block(world: int) -> None:
    digests = ["a", "b", "a"][:world]
    verdict = decide(_prints(digests, differ_from=1), pin_failure_policy="fail")
    assert not verdict.ok and verdict.error is WeightsDifferError
    assert issubclass(WeightsDifferError, ValueError)  # the job's input: the CLI's one line
    want = "[0, 2] and [1]" if world == 3 else "[0] and [1]"
    assert f"block 'dit.blocks.1' differs between ranks {want}" in verdict.message
    assert "rank 0: file-a; rank 1: file-b" in verdict.message
    assert "more blocks" not in verdict.message
    msg = weights_verdict(_prints(digests))  # both blocks: the first named, the other counted
    assert "block 'dit.blocks.0'" in msg and "(and 1 more blocks)" in msg


def test_ranks_that_never_exchange_a_block_are_not_compared() -> None:
    # two weight groups ([0, 2] and [1, 3], DP x SP): each agrees within itself
    assert weights_verdict(_prints(["a", "b", "a", "b"], groups=[[0, 2], [1, 3]])) == ""
    msg = weights_verdict(_prints(["a", "b", "c", "b"], groups=[[0, 2], [1, 3]]))
    assert "between ranks [0] and [2]" in msg and "rank 1" not in msg
    # node-shared: only the group's ranks of one host share a copy
    assert weights_verdict(_prints(["a", "a", "b", "b"], hosts="xxyy", node=True)) == ""
    msg = weights_verdict(_prints(["a", "a", "b", "a"], hosts="xxyy", node=True))
    assert "between ranks [2] and [3]" in msg
    # the same ranks gathering (not node-shared) compare across hosts
    assert "between ranks [0, 1] and [2, 3]" in weights_verdict(
        _prints(["a", "a", "b", "b"], hosts="xxyy")
    )


def test_a_rank_without_a_fingerprint_for_a_block_differs() -> None:
    reports = _prints(["a", "a"])
    reports[1].weights = reports[1].weights[:1]
    msg = weights_verdict(reports)
    assert "block 'dit.blocks.1'" in msg and "rank 1: no fingerprint for this block" in msg


def test_a_failed_rank_or_other_manifest_is_named_before_the_weights() -> None:
    reports = _prints(["a", "b"])
    reports[1].digest = "other"
    assert "different block manifests" in decide(reports, pin_failure_policy="fail").message
    reports[1].ok, reports[1].error = False, "boom"
    verdict = decide(reports, pin_failure_policy="fail")
    assert "boom" in verdict.message and verdict.error is not WeightsDifferError


def test_fingerprints_travel_as_store_records() -> None:
    (report, _) = _prints(["a", "b"])
    assert decode(encode(report), [RankReport, BlockPrint]) == report
