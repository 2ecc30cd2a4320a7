"""transfer="node-shared": the ranks of a weight group on one node share one host copy in a
file under DLO_SHM_DIR (see [Note: node-shared host copy] in dlo.host.node_share). Real gloo ranks;
every test gives the ranks a private DLO_SHM_DIR, so parallel tests never see each other's
files."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
import dlo.backends.layerwise as layerwise
import dlo.host.node_share
import dlo.host.region
from dlo import faults
from dlo.backends.layerwise import LayerwiseBackend
from dlo.host.region import LEDGER
from dlo.parallel import store as agreement
from dlo.parallel.agreement import RankReport, pin_verdict
from dlo.plan.layers import check_stacks
from dlo.plan.topology import BlockStack, resolve_offload_plan
from dlo.platform.device import CpuPlatform
from tests.cpu.test_dlo import FakePinPlatform, _cfg, _par, _steps
from tests.cpu.test_streamed_writes import _CachingDiT, _state
from tests.cpu.test_streamed_writes import _x as _write_x
from tests.harness import assert_all_ok, run_ranks
from tests.toys import ToyDiT, ToyPipeline, TwoStackDiT, assert_same, clone, snapshot

NS = "node-shared"


def _env(tmp_path: Path) -> dict[str, str]:
    return {"DLO_SHM_DIR": str(tmp_path)}


def _shm_files() -> list[str]:
    return sorted(f for f in os.listdir(os.environ["DLO_SHM_DIR"]) if f.startswith("dlo-"))


def _ns(world: int, platform: CpuPlatform | None = None, **kw: Any) -> LayerwiseBackend:
    return LayerwiseBackend(_cfg(transfer=NS, **kw), _par(world), platform or CpuPlatform())


def _error(e: BaseException) -> str:
    """The message without its ``[dlo rank N]`` prefix (equal on every rank)."""
    return str(e).split("]", 1)[1]


# ----------------------------------------------------------------------------- parity
def _parity(
    rank: int, world: int, num_blocks: int, resident: int, nodes: int, sp: int = 1
) -> dict[str, Any]:
    """``nodes`` simulated hosts; ``sp`` > 1: data x sequence, the weight group is DP's."""
    if nodes > 1:  # ranks [0, world/nodes) on one node, the next ones on another, ...
        host = f"node{rank * nodes // world}"
        layerwise.host_name = lambda: host  # type: ignore[assignment]
    packed: list[str] = []
    paths: list[str] = []
    real_pack, real_map = dlo.host.node_share.pack_block, dlo.host.region._map_file

    def pack(dst: torch.Tensor, layout: Any, r: int, sources: Any) -> None:
        packed.append(layout.name)
        real_pack(dst, layout, r, sources)

    def map_file(path: str, nbytes: int) -> Any:
        paths.append(path)
        return real_map(path, nbytes)

    dlo.host.node_share.pack_block = pack  # type: ignore[assignment]
    dlo.host.region._map_file = map_file  # type: ignore[assignment]
    model = TwoStackDiT(num_blocks, num_blocks2=2) if num_blocks % 2 else ToyDiT(num_blocks)
    ref = _steps(clone(model), rank, 4)
    before = snapshot(model)
    par = dlo.ParallelConfig(data_parallel_size=world // sp, sequence_parallel_size=sp)
    backend = LayerwiseBackend(_cfg(transfer=NS, resident_layers=resident), par, CpuPlatform())
    backend.enable(model)
    files_enabled = _shm_files()
    got, h2d = _forwards(backend, model, rank)
    st = backend.stats()
    blocks = [(b.name, b.layout.shard_nbytes, b.resident) for b in backend._blocks]
    backend.disable()
    assert_same(before, model)
    files_disabled = _shm_files()
    # what rank-local moves for the same model: with two stacks both move a little more
    # than one pass over the blocks (each stack's first block is prefetched at the end)
    local = LayerwiseBackend(
        _cfg(transfer="rank-local", resident_layers=resident), par, CpuPlatform()
    )
    local.enable(model)
    local_h2d = _forwards(local, model, rank)[1]
    local.disable()
    return {
        "same": all(torch.equal(a, b) for a, b in zip(ref, got)),
        "stats": st,
        "blocks": blocks,
        "packed": packed,
        "paths": paths,
        "h2d": h2d,
        "local_h2d": local_h2d,
        "files_enabled": files_enabled,
        "files_disabled": files_disabled,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


def _forwards(
    backend: LayerwiseBackend, model: torch.nn.Module, rank: int
) -> tuple[list[torch.Tensor], list[int]]:
    """Four forwards, then one more alone: the outputs, and the bytes each run moved."""
    h2d = [backend.stats()["h2d_nbytes"]]
    got = _steps(model, rank, 4)
    h2d.append(backend.stats()["h2d_nbytes"])
    _steps(model, rank, 1)
    h2d.append(backend.stats()["h2d_nbytes"])
    return got, [b - a for a, b in itertools.pairwise(h2d)]


@pytest.mark.parametrize(
    "world, num_blocks, resident",
    [(1, 3, 0), (2, 4, 1), (3, 5, 0), (4, 5, 1)],  # odd counts: TwoStackDiT (7 blocks)
)
def test_parity_one_copy_per_node_each_rank_packs_its_share(
    tmp_path: Path, world: int, num_blocks: int, resident: int
) -> None:
    res = assert_all_ok(
        run_ranks(_parity, world, num_blocks, resident, 1, timeout_s=60, env=_env(tmp_path))
    )
    names = [n for n, _, _ in res[0]["blocks"]]
    for rank, r in enumerate(res):
        st = r["stats"]
        assert r["same"] and r["ledger"] == (0, 0)
        assert r["files_enabled"] == [] and r["files_disabled"] == []  # unlinked at enable
        assert st["transfer"] == NS and st["group_size"] == 1 and st["allgather_nbytes"] == 0
        assert st["host_share_ranks"] == world and st["host_region_nbytes"] == 0
        assert st["host_nbytes"] == sum(-(-n // world) for _, n, _ in r["blocks"])
        assert st["host_shared_nbytes"] >= sum(n for _, n, _ in r["blocks"])
        assert st["host_shared_nbytes"] % os.sysconf("SC_PAGE_SIZE") == 0
        assert st["host_pinned_nbytes"] == 0  # CPU: nothing pinned
        assert st["num_resident_blocks"] == resident
        streamed = sum(n for _, n, res_ in r["blocks"] if not res_)
        assert r["h2d"] == r["local_h2d"]  # whole blocks, like rank-local
        if num_blocks % 2 == 0:  # one stack: each forward moves every streamed block once
            assert r["h2d"] == [4 * streamed, streamed]
        # rank r packed exactly the blocks k % L == r, resident ones included
        assert r["packed"] == names[rank::world], (rank, r["packed"])
        assert len(set(r["paths"])) == 1
    assert sorted(n for r in res for n in r["packed"]) == sorted(names)
    assert len({r["paths"][0] for r in res}) == 1  # one file for the node
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "nodes, sp, copies",
    [(2, 1, [[0, 1], [2, 3]]), (1, 2, [[0, 2], [1, 3]])],
    ids=["two-nodes", "two-weight-groups-on-one-node"],
)
def test_two_copies_for_two_nodes_or_two_weight_groups(
    tmp_path: Path, nodes: int, sp: int, copies: list[list[int]]
) -> None:
    res = assert_all_ok(run_ranks(_parity, 4, 4, 0, nodes, sp, timeout_s=60, env=_env(tmp_path)))
    names = [n for n, _, _ in res[0]["blocks"]]
    for r in res:
        assert r["same"] and r["ledger"] == (0, 0) and r["h2d"] == r["local_h2d"]
        # its own file is gone once a rank enabled (the other copy's may not be yet)
        assert Path(r["paths"][0]).name not in r["files_enabled"] + r["files_disabled"]
        assert r["stats"]["host_share_ranks"] == 2
        assert r["stats"]["host_nbytes"] == sum(-(-n // 2) for _, n, _ in r["blocks"])
    for a, b in copies:  # one file per pair, each rank of it packing its half
        assert res[a]["paths"] == res[b]["paths"]
        assert (res[a]["packed"], res[b]["packed"]) == (names[0::2], names[1::2])
    assert res[copies[0][0]]["paths"] != res[copies[1][0]]["paths"]
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- failures
def _slow_exchange(rank: int) -> None:
    """Rank 1 reaches the host-share exchange late, and rank 0 is preempted between its
    reads of the exchange's outcome and of the failure mark (as a loaded node may do)."""
    if rank == 1:
        real_share = dlo.host.node_share.share

        def late(*args: Any, **kw: Any) -> Any:
            time.sleep(0.3)
            return real_share(*args, **kw)

        dlo.host.node_share.share = late  # type: ignore[assignment]
    elif rank == 0:
        real_refusal, polls = agreement._refusal, [0]

        def preempted(store: Any, *, rank: int, what: str) -> Any:
            polls[0] += what == "node-shared host copy"
            if polls[0] == 2 and what == "node-shared host copy":  # the first poll
                time.sleep(0.6)
            return real_refusal(store, rank=rank, what=what)

        agreement._refusal = preempted  # type: ignore[assignment]


def _failure(rank: int, world: int, point: str, slow: bool = False) -> dict[str, Any]:
    if slow:
        _slow_exchange(rank)
    model = ToyDiT(3)
    before = snapshot(model)
    backend = _ns(world, collective_timeout_s=10.0)
    try:
        if rank == 1:
            with faults.inject(point):
                backend.enable(model)
        else:
            backend.enable(model)
    except dlo.OffloadError as e:
        msg = _error(e)
    else:
        return {"msg": "enabled"}
    assert_same(before, model)
    later = []
    for again in (backend, _ns(world)):  # the same object, and a new one on this worker
        try:
            again.enable(model)
            later.append("enabled")
        except dlo.OffloadError as e:
            later.append(f"{type(e).__name__}: {e}")
    assert_same(before, model)
    return {
        "msg": msg,
        "later": later,
        "files": _shm_files(),
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.mark.parametrize("point", ["host_share", "host_fill"])
def test_failure_on_one_rank_fails_every_rank_and_leaves_nothing(
    tmp_path: Path, point: str
) -> None:
    res = assert_all_ok(run_ranks(_failure, 3, point, timeout_s=60, env=_env(tmp_path)))
    assert len({r["msg"] for r in res}) == 1, res  # see also the next test
    msg = res[0]["msg"]
    assert "node-shared host copy failed on rank(s) [1]" in msg and point in msg, msg
    for r in res:
        assert r["files"] == [] and r["ledger"] == (0, 0)
        # the startup failed after the agreement: the worker is done
        same, fresh = r["later"]
        assert same.startswith("BackendPoisonedError") and "recreate the worker" in same, same
        assert "previous multi-rank startup of dlo failed" in fresh, fresh
    assert os.listdir(tmp_path) == []


def test_failure_reaches_a_peer_polling_the_exchange_as_the_same_error(tmp_path: Path) -> None:
    # A race, made deterministic: rank 1 completes the host-share exchange, raises and marks
    # the store failed while rank 0 is between its read of the exchange's outcome and its
    # read of the mark. dlo.parallel.store._share at 9f7dccc then raised the refusal ("node-shared
    # host copy refused: a previous multi-rank startup of dlo failed (rank 1: ...)") on rank
    # 0 instead of the error, although the exchange had been decided "ok"; it must read the
    # exchange (FAILED at 9f7dccc until _share broke out of its wait when every rank had
    # arrived)
    res = assert_all_ok(run_ranks(_failure, 2, "host_fill", True, timeout_s=60, env=_env(tmp_path)))
    assert len({r["msg"] for r in res}) == 1, res
    assert res[0]["msg"].startswith(" the node-shared host copy failed on rank(s) [1]"), res


# ----------------------------------------------------------------------------- pinning
def _pinning(rank: int, world: int, case: str, nbytes: list[int]) -> dict[str, Any]:
    charge = [-(-n // world) for n in nbytes]
    platform = FakePinPlatform(fail=case == "fail_one" and rank == 1)
    budget = {"fits_shared": sum(charge) + charge[0] // 2, "two_blocks": sum(charge[:2])}
    kw: dict[str, Any] = {
        "pin_failure_policy": "fail" if case == "fail" else "whole_block_fallback"
    }
    if case != "fail_one":
        kw["pin_budget_gb"] = budget["two_blocks" if case == "fail" else case] / (1 << 30)
    model = ToyDiT(4)
    before = snapshot(model)
    backend = _ns(world, platform, **kw)
    try:
        backend.enable(model)
    except dlo.OffloadError as e:
        assert_same(before, model)
        return {
            "msg": _error(e),
            "files": _shm_files(),
            "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
        }
    same = all(
        torch.equal(a, b) for a, b in zip(_steps(clone(ToyDiT(4)), rank, 2), _steps(model, rank, 2))
    )
    st = backend.stats()
    backend.disable()
    assert_same(before, model)
    return {
        "same": same,
        "budget": int(kw.get("pin_budget_gb", 0) * (1 << 30)),
        "pageable": st["pageable_blocks"],
        "pinned": st["host_pinned_nbytes"],
        "charge": charge,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


def _block_nbytes(num_blocks: int) -> list[int]:
    """Each block's bytes (a whole block, as rank-local holds it)."""
    probe = LayerwiseBackend(_cfg(transfer="rank-local"), _par(1), CpuPlatform())
    probe.enable(ToyDiT(num_blocks))
    out = [b.layout.shard_nbytes for b in probe._blocks]
    probe.disable()
    return out


def test_pin_budget_charges_each_sharer_its_share(tmp_path: Path) -> None:
    # the budget holds every block at 1/2 its bytes, not at its whole bytes
    nbytes = _block_nbytes(4)
    res = assert_all_ok(
        run_ranks(_pinning, 2, "fits_shared", nbytes, timeout_s=60, env=_env(tmp_path))
    )
    for r in res:
        assert sum(r["charge"]) <= r["budget"] < sum(nbytes)
        assert r["same"] and r["pageable"] == [] and r["pinned"] == sum(r["charge"])
        assert r["ledger"] == (0, 0)


@pytest.mark.parametrize("case", ["two_blocks", "fail_one"])
def test_blocks_left_pageable_anywhere_are_pageable_everywhere(tmp_path: Path, case: str) -> None:
    res = assert_all_ok(
        run_ranks(_pinning, 2, case, _block_nbytes(4), timeout_s=60, env=_env(tmp_path))
    )
    want = ["blocks.2", "blocks.3"] if case == "two_blocks" else [f"blocks.{i}" for i in range(4)]
    for r in res:
        assert r["same"] and r["pageable"] == want, res
        assert r["pinned"] == (sum(r["charge"][:2]) if case == "two_blocks" else 0)
        assert r["ledger"] == (0, 0)


def test_pin_failure_policy_fail_is_the_same_error_everywhere(tmp_path: Path) -> None:
    res = assert_all_ok(
        run_ranks(_pinning, 2, "fail", _block_nbytes(4), timeout_s=60, env=_env(tmp_path))
    )
    assert len({r["msg"] for r in res}) == 1, res
    msg = res[0]["msg"]
    assert "pin_budget_gb on rank(s) [0, 1]" in msg and "'blocks.2', 'blocks.3']" in msg, msg
    assert all(r["files"] == [] and r["ledger"] == (0, 0) for r in res)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- writes
def _streamed_write(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _CachingDiT()
    before = snapshot(model)
    backend = _ns(world)
    backend.enable(model)
    try:
        with torch.no_grad():
            model(_write_x(0), 0)
        msg = "no error"
    except dlo.OffloadError as e:
        msg = str(e)
    backend.disable()
    assert_same(before, model)
    return {"msg": msg, "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes)}


def test_in_place_write_into_a_streamed_tensor_is_refused(tmp_path: Path) -> None:
    for r in assert_all_ok(run_ranks(_streamed_write, 2, timeout_s=60, env=_env(tmp_path))):
        m = r["msg"]
        assert "blocks.0" in m and "calls" in m and "in place" in m and NS in m, m
        assert r["ledger"] == (0, 0)


def test_resident_block_write_warns_and_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DLO_SHM_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = _CachingDiT(2)
    ref, before = clone(model), _state(model)
    backend = _ns(1, resident_layers=2)
    backend.enable(model)
    with torch.no_grad():  # the resident copies keep their writes while enabled
        for step in range(3):
            assert torch.equal(model(_write_x(step), step), ref(_write_x(step), step))
    with caplog.at_level(logging.WARNING, logger="dlo"):
        backend.disable()
    assert "blocks.0" in caplog.text and "not kept after disable" in caplog.text
    assert "node-shared host copy" in caplog.text
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the pre-enable bytes
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0) and os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- refusals
def test_mapped_backing_is_refused_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # checked before any block is mapped: a model without a checkpoint is enough
    monkeypatch.setenv("DLO_SHM_DIR", str(tmp_path))
    model = ToyDiT(3)
    before = snapshot(model)
    backend = _ns(1, host_backing="mapped")
    with pytest.raises(ValueError, match=r"host_backing='mapped'.*'node-shared'"):
        backend.enable(model)
    assert_same(before, model)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0) and not backend.is_enabled()
    assert os.listdir(tmp_path) == []


def test_stacks_sharing_along_different_axes_are_refused() -> None:
    # weight_axis is global, so resolution never yields two share axes; the check guards
    # the plan the backend executes
    plan = resolve_offload_plan(TwoStackDiT(2, num_blocks2=2), _cfg(transfer=NS), _par(2))
    check_stacks(plan.stacks, host_backing="region")
    a, b = plan.stacks
    mixed = dataclasses.replace(plan, stacks=(a, dataclasses.replace(b, share_axis="sequence")))
    with pytest.raises(ValueError, match=r"different axes.*'blocks2': 'sequence'"):
        check_stacks(mixed.stacks, host_backing="region")


# ----------------------------------------------------------------------------- pure
def test_sharers_are_the_group_on_this_host() -> None:
    reports = [RankReport(rank=r, ok=True, host="ab"[r // 2]) for r in range(4)]
    assert dlo.host.node_share.sharers(reports, [0, 1, 2, 3], 2) == [2, 3]
    assert dlo.host.node_share.sharers(reports, [1, 3], 1) == [1]
    assert dlo.host.node_share.sharers(reports, [0, 1], 0) == [0, 1]
    assert dlo.host.node_share.sharers(reports[:1], [0], 0) == [0]


def test_pin_verdict_is_the_union_and_fail_names_the_ranks() -> None:
    votes = [(0, ["b.2"]), (1, ["b.1", "b.2"]), (2, [])]
    assert pin_verdict(votes, "whole_block_fallback") == (("b.1", "b.2"), "")
    blocks, refused = pin_verdict(votes, "fail")
    assert blocks == ("b.1", "b.2") and "rank(s) [0, 1]" in refused and "'fail'" in refused
    assert pin_verdict([(0, []), (1, [])], "fail") == ((), "")


def test_block_stack_copies_whole_blocks() -> None:
    kw: dict[str, Any] = dict(
        component="dit",
        component_path="",
        container_path="blocks",
        block_paths=("blocks.0",),
        transfer=NS,
        num_resident=0,
        group_axis="data",
    )
    with pytest.raises(ValueError, match="group_size 1"):
        BlockStack(group_size=2, **kw)
    assert BlockStack(group_size=1, share_axis="data", share_size=2, **kw).share_size == 2


def test_plan_resolves_the_share_group() -> None:
    (s,) = resolve_offload_plan(ToyDiT(3), _cfg(transfer=NS), _par(2)).stacks
    assert (s.transfer, s.group_axis, s.group_size) == (NS, "local", 1)
    assert (s.share_axis, s.share_size) == ("data", 2)
    cfg = _cfg(
        components=("dit", "encoder"),
        transfer="rank-local",
        layer_options={"encoder": {"weight_transfer": NS}},
    )
    stacks = resolve_offload_plan(ToyPipeline(), cfg, _par(2)).stacks
    got = {s.container_path: (s.transfer, s.group_size, s.share_axis, s.share_size) for s in stacks}
    assert got["text_encoder.layers"] == (NS, 1, "data", 2)
    assert got["transformer.blocks"] == ("rank-local", 1, "local", 1)


def test_unknown_transfer_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"^transfer='node-share' is not one of .*'node-shared'"):
        dlo.OffloadConfig(mode="layer", transfer="node-share")
    options: Any = {"dit": {"weight_transfer": "shared"}}
    with pytest.raises(ValueError, match=r"layer_options\['dit'\]: .*weight_transfer='shared'"):
        dlo.OffloadConfig(mode="layer", layer_options=options)


# ----------------------------------------------------------------------------- review fixes
def _outcome(backend: LayerwiseBackend, model: torch.nn.Module, rank: int) -> dict[str, Any]:
    """Enable ``model`` (a toy DiT) and run two forwards: parity with a resident run, the
    stats, then disable; or the error's message (rank prefix dropped). Either way the model
    is checked to be restored bitwise, and the files and ledger are reported."""
    ref = _steps(clone(model), rank, 2)
    before = snapshot(model)
    t0 = time.monotonic()
    try:
        backend.enable(model)
    except dlo.OffloadError as e:
        out: dict[str, Any] = {"msg": _error(e), "enabled": False}
    else:
        got = _steps(model, rank, 2)
        out = {
            "enabled": True,
            "same": all(torch.equal(a, b) for a, b in zip(ref, got)),
            "stats": backend.stats(),
        }
        backend.disable()
    assert_same(before, model)
    out.update(
        seconds=time.monotonic() - t0,
        files=_shm_files(),
        ledger=(LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    )
    return out


def _share_group_of_one(rank: int, world: int, par_kw: dict[str, int], axis: str) -> Any:
    # every rank has a copy of its own: a folder of its own, so its "nothing left" check does
    # not see a peer's file between that peer's map and unlink
    own = os.path.join(os.environ["DLO_SHM_DIR"], f"rank{rank}")
    os.makedirs(own)
    os.environ["DLO_SHM_DIR"] = own
    cfg = _cfg(transfer=NS, weight_axis=axis, collective_timeout_s=10.0)
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(**par_kw), CpuPlatform())
    (s,) = resolve_offload_plan(ToyDiT(3), cfg, dlo.ParallelConfig(**par_kw)).stacks
    return {"share": (s.share_axis, s.share_size), **_outcome(backend, ToyDiT(3), rank)}


@pytest.mark.parametrize(
    "par_kw, axis",
    [
        ({"data_parallel_size": 1, "tensor_parallel_size": 2}, "auto"),
        ({"sequence_parallel_size": 2}, "data"),
    ],
    ids=["tensor-parallel", "sequence-parallel-data-axis"],
)
def test_a_share_group_of_one_builds_its_own_copy_on_every_rank(
    tmp_path: Path, par_kw: dict[str, int], axis: str
) -> None:
    # the weight axis has one rank: each rank builds its own copy with no exchange (it used
    # to raise IndexError on one rank and leave the other waiting out the timeout)
    res = assert_all_ok(
        run_ranks(_share_group_of_one, 2, par_kw, axis, timeout_s=60, env=_env(tmp_path))
    )
    for r in res:
        assert r["enabled"] and r["same"], r
        assert r["share"][1] == 1, r["share"]
        st = r["stats"]
        assert st["transfer"] == NS and st["group_size"] == 1 and st["host_share_ranks"] == 1
        assert st["allgather_nbytes"] == 0
        assert r["files"] == [] and r["ledger"] == (0, 0)
        assert r["seconds"] < 8, r["seconds"]  # no wait for a peer (timeout 10 s)
    assert [os.listdir(tmp_path / f"rank{r}") for r in range(2)] == [[], []]


def _mismatch(rank: int, world: int, transfers: tuple[str, str]) -> dict[str, Any]:
    options: Any = {"encoder": {"weight_transfer": NS}}
    cfg = dlo.OffloadConfig(
        mode="layer",
        components=("dit", "encoder"),
        transfer=transfers[rank],
        layer_options=options,
        collective_timeout_s=10.0,
    )
    backend = LayerwiseBackend(cfg, _par(world), CpuPlatform())
    pipe = ToyPipeline()
    before = snapshot(pipe)
    t0 = time.monotonic()
    try:
        backend.enable(pipe)
    except dlo.OffloadError as e:
        msg = _error(e)
    else:
        backend.disable()
        msg = "enabled"
    assert_same(before, pipe)
    return {
        "msg": msg,
        "seconds": time.monotonic() - t0,
        "files": _shm_files(),
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.mark.parametrize("transfers", [(NS, "rank-local"), ("rank-local", NS)])
def test_ranks_disagreeing_on_node_shared_fail_alike(
    tmp_path: Path, transfers: tuple[str, str]
) -> None:
    # the layouts (and so the digests) are equal; the resolved transfers are compared
    res = assert_all_ok(run_ranks(_mismatch, 2, transfers, timeout_s=60, env=_env(tmp_path)))
    assert len({r["msg"] for r in res}) == 1, res
    msg = res[0]["msg"]

    def named(t: str) -> str:
        dit = f"{t}@data" if t == NS else t
        return (
            f"'transformer.blocks={dit}, transformer_2.blocks={dit}, text_encoder.layers={NS}@data'"
        )

    assert "different settings (transfer: " in msg, msg
    assert f"rank 0={named(transfers[0])}" in msg and f"rank 1={named(transfers[1])}" in msg, msg
    for r in res:
        assert r["files"] == [] and r["ledger"] == (0, 0)
        assert r["seconds"] < 8, r["seconds"]  # the verdict, not the timeout (10 s)
    assert os.listdir(tmp_path) == []


def _state_dict_write(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    model = ToyDiT(4)
    ref = clone(model)
    before = snapshot(model)
    backend = _ns(world)
    backend.enable(model)
    sd = model.state_dict()
    keys = [k for k in sd if k.startswith("blocks.")]
    same_values = all(torch.equal(sd[k], before[k][-1]) for k in keys)
    if rank == 0:  # e.g. an in-place edit (quantization) of a saved dict
        for k in keys:
            sd[k].zero_()
    dist.barrier()
    again = model.state_dict()
    unchanged = all(torch.equal(again[k], before[k][-1]) for k in keys)
    same = all(torch.equal(a, b) for a, b in zip(_steps(ref, rank, 2), _steps(model, rank, 2)))
    backend.disable()
    assert_same(before, model)
    return {
        "same_values": same_values,
        "unchanged": unchanged,
        "same": same,
        "files": _shm_files(),
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


def test_state_dict_is_a_private_clone(tmp_path: Path) -> None:
    # rank 0 zeroes every block tensor of its state_dict(): no rank streams or restores it
    res = assert_all_ok(run_ranks(_state_dict_write, 2, timeout_s=60, env=_env(tmp_path)))
    for r in res:
        assert r["same_values"] and r["unchanged"] and r["same"], r
        assert r["files"] == [] and r["ledger"] == (0, 0)
    assert os.listdir(tmp_path) == []


def _other_namespace(rank: int, world: int) -> dict[str, Any]:
    # one host name, two machines (or PID namespaces): rank 1 cannot see rank 0's process,
    # so the offered /proc/PID/fd/N does not resolve there
    import dlo.host.node_share as node_share

    if rank == 1:

        def readlink(path: str) -> str:
            raise FileNotFoundError(2, "No such file or directory", path)

        node_share.os.readlink = readlink  # type: ignore[assignment]
    return _outcome(_ns(world, collective_timeout_s=10.0), ToyDiT(4), rank)


def test_ranks_of_one_host_name_that_cannot_see_one_memory_fail_alike(tmp_path: Path) -> None:
    res = assert_all_ok(run_ranks(_other_namespace, 2, timeout_s=60, env=_env(tmp_path)))
    assert not any(r["enabled"] for r in res), res
    assert len({r["msg"] for r in res}) == 1, res
    msg = res[0]["msg"]
    assert "node-shared host copy failed on rank(s) [1]" in msg, msg
    assert "not in this rank's process namespace" in msg, msg
    for r in res:
        assert r["files"] == [] and r["ledger"] == (0, 0)
        assert r["seconds"] < 8, r["seconds"]


def _copy_engine(rank: int, world: int) -> dict[str, Any]:
    return _outcome(_ns(world, gather_engine="copy"), ToyDiT(3), rank)


def test_copy_gather_engine_with_nothing_to_gather_enables(tmp_path: Path) -> None:
    # node-shared only: nothing gathers, so the engine has nothing to refuse (rank-local
    # was never refused; node-shared was)
    res = assert_all_ok(run_ranks(_copy_engine, 2, timeout_s=60, env=_env(tmp_path)))
    for r in res:
        assert r["enabled"] and r["same"], r
        st = r["stats"]
        assert st["transfer"] == NS and st["host_share_ranks"] == 2
        assert st["allgather_nbytes"] == 0
        assert r["files"] == [] and r["ledger"] == (0, 0)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- second review
def _auto_against_explicit(rank: int, world: int) -> str:
    cfg = _cfg(transfer="node-shared", num_slots="auto" if rank == 0 else 2)
    backend = LayerwiseBackend(cfg, _par(world), CpuPlatform())
    t0 = time.monotonic()
    with pytest.raises(dlo.OffloadError) as e:
        backend.enable(ToyDiT(4))
    assert time.monotonic() - t0 < 10.0  # named at once, not after collective_timeout_s
    return str(e.value).split("] ", 1)[1]


def test_automatic_settings_on_one_node_shared_rank_only_are_named_at_once(
    tmp_path: Path,
) -> None:
    # node-shared stacks have group size 1 but exchange: the request check must run too
    res = assert_all_ok(run_ranks(_auto_against_explicit, 2, timeout_s=60, env=_env(tmp_path)))
    assert res[0] == res[1] and "num_slots: rank 0='auto', rank 1=2" in res[0], res
    assert os.listdir(tmp_path) == []


def _budget_order(rank: int, world: int, budget: int | None, nodes: int = 1) -> dict[str, Any]:
    if nodes > 1:  # one rank per node (LOCAL_WORLD_SIZE=1 in the env): the group spans them
        host = f"node{rank * nodes // world}"
        layerwise.host_name = lambda: host  # type: ignore[assignment]
    cfg = _cfg(
        transfer="node-shared",
        layer_options={"encoder": dlo.LayerOptions(weight_transfer="rank-local")},
        pin_budget_gb=None if budget is None else budget / (1 << 30),
        pin_failure_policy="whole_block_fallback",
    )
    backend = LayerwiseBackend(cfg, _par(world), FakePinPlatform())
    backend.enable(ToyPipeline())
    pinned = {b.name: b.region.is_pinned(b.host_index) for b in backend._blocks if b.region}
    shared = {b.name: b.layout.shard_nbytes for b in backend._blocks if b.node_shared}
    share_ranks = backend.stats()["host_share_ranks"]
    backend.disable()
    return {
        "pinned": pinned,
        "shared": shared,
        "share_ranks": share_ranks,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


def test_pin_budget_goes_to_the_node_shared_blocks_first(tmp_path: Path) -> None:
    """A DiT node-shared, an encoder rank-local (not declared replicated, say): a budget that
    holds the DiT's charged half pins every DiT block, though the private encoder's blocks
    are pinned first (before the agreement)."""
    first = assert_all_ok(run_ranks(_budget_order, 2, None, timeout_s=60, env=_env(tmp_path)))
    charged = sum(-(-n // 2) for n in first[0]["shared"].values())
    res = assert_all_ok(run_ranks(_budget_order, 2, charged + 64, timeout_s=60, env=_env(tmp_path)))
    for r in res:
        assert all(r["pinned"][name] for name in r["shared"]), r["pinned"]
        assert not all(r["pinned"].values())  # the encoder got what was left
        assert r["ledger"] == (0, 0)
    assert os.listdir(tmp_path) == []


def test_pin_budget_serves_node_shared_blocks_first_across_nodes(tmp_path: Path) -> None:
    """A DP group of two on two nodes: each node's copy has one sharer (L = 1, not the group's
    2), so each rank is charged whole blocks; the reservation before the vote must say so
    (torchrun's placement: LOCAL_WORLD_SIZE ranks per node), else the private encoder takes
    the budget of the DiT's streamed blocks."""
    env = {**_env(tmp_path), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    first = assert_all_ok(run_ranks(_budget_order, 2, None, 2, timeout_s=60, env=env))
    assert first[0]["share_ranks"] == 1
    whole = sum(first[0]["shared"].values())
    res = assert_all_ok(run_ranks(_budget_order, 2, whole + 64, 2, timeout_s=60, env=env))
    for r in res:
        assert all(r["pinned"][name] for name in r["shared"]), r["pinned"]
        assert not all(r["pinned"].values())
        assert r["ledger"] == (0, 0)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- planted files
_TOKEN = "feedfacecafebeef"


def _planted(rank: int, world: int, target: str) -> dict[str, Any]:
    """Every rank's token is predictable (as a reader of the store would learn it) and the
    old named path ``dlo-<token>`` is planted as a symlink to ``target`` before the enable:
    dlo names no file, so it never opens it."""
    import dlo.backends.layerwise as layerwise

    layerwise.secrets.token_hex = lambda n=8: _TOKEN  # type: ignore[attr-defined]
    if rank == 0:
        os.symlink(target, os.path.join(os.environ["DLO_SHM_DIR"], f"dlo-{_TOKEN}"))
    import torch.distributed as dist

    dist.barrier()
    return _outcome(_ns(world, collective_timeout_s=10.0), ToyDiT(3), rank)


def test_a_planted_shared_memory_path_is_never_opened(tmp_path: Path) -> None:
    """Issue 26 (1): a local user who learns the token plants ``/dev/shm/dlo-<token>`` first
    (dlo used to grow and overwrite a symlink's target, or share the weights with a planted
    0666 file). The shared copy is an anonymous memfd now: nothing named can be planted."""
    shm = tmp_path / "shm"
    shm.mkdir()
    target = tmp_path / "victim"
    target.write_bytes(b"precious" * 512)
    res = assert_all_ok(run_ranks(_planted, 2, str(target), timeout_s=60, env=_env(shm)))
    for r in res:
        assert r["enabled"] and r["same"], r
        assert r["stats"]["host_share_ranks"] == 2
    assert target.read_bytes() == b"precious" * 512
    assert os.listdir(shm) == [f"dlo-{_TOKEN}"]  # only the planted link, untouched


def _forged(rank: int, world: int, how: str, victim: str) -> dict[str, Any]:
    """Rank 0's offer is not dlo's own memory (as a writer of the store could forge it): a
    regular file, a memfd of another user, a memfd open to everyone."""
    import dlo.host.node_share as node_share

    real = node_share.create_memfd

    def forged(name: str) -> int:
        if how == "regular-file":
            return os.open(victim, os.O_RDWR)
        fd = real(name)
        if how == "other-owner":
            os.fchown(fd, 65534, 65534)
        else:
            os.fchmod(fd, 0o666)
        return fd

    node_share.create_memfd = forged  # type: ignore[assignment]
    return _outcome(_ns(world, collective_timeout_s=10.0), ToyDiT(3), rank)


# a memfd of another uid can be made only by root (as CI runs); the mode case covers the
# same check for an unprivileged run
_FORGED = ["regular-file", "open-mode"] + (["other-owner"] if os.geteuid() == 0 else [])


@pytest.mark.parametrize("how", _FORGED)
def test_a_forged_offer_of_the_shared_memory_is_refused_and_nothing_is_written(
    tmp_path: Path, how: str
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 512)
    res = assert_all_ok(run_ranks(_forged, 2, how, str(victim), timeout_s=60, env=_env(tmp_path)))
    assert not any(r["enabled"] for r in res), res
    assert len({r["msg"] for r in res}) == 1, res
    want = "not dlo's memfd" if how == "regular-file" else "is not dlo's own"
    assert want in res[0]["msg"] and "rank(s) [0, 1]" in res[0]["msg"], res[0]["msg"]
    assert victim.read_bytes() == b"precious" * 512
    for r in res:
        assert r["ledger"] == (0, 0)


def _names_during_fill(rank: int, world: int) -> dict[str, Any]:
    """What a kill at the worst moment would leave: the shared-memory folders' dlo files
    while the shared copy is being filled (after every sharer mapped it, before the end)."""
    import dlo.host.node_share as node_share

    seen: list[list[str]] = []
    real = node_share.pack_block

    def pack(*args: Any, **kwargs: Any) -> None:
        seen.append(_shm_files() + [f for f in os.listdir("/dev/shm") if f.startswith("dlo-")])
        real(*args, **kwargs)

    node_share.pack_block = pack  # type: ignore[assignment]
    out = _outcome(_ns(world), ToyDiT(4), rank)
    return {**out, "seen": seen}


def test_no_shared_memory_file_exists_at_any_point_of_the_enable(tmp_path: Path) -> None:
    """Issue 26 (3): SIGTERM to torchrun or a kill of every rank between the file's creation
    and its unlink left /dev/shm/dlo-<token> (hundreds of MB). The memfd has no name: a kill
    at any point leaves nothing, since the memory goes with the last process holding it."""
    res = assert_all_ok(run_ranks(_names_during_fill, 2, timeout_s=60, env=_env(tmp_path)))
    for r in res:
        assert r["enabled"] and r["same"], r
        assert r["seen"] and all(names == [] for names in r["seen"]), r["seen"]
