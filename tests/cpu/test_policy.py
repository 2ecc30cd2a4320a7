"""The automatic policy with real gloo process groups: ranks that measure different numbers
still take one decision, and the pipeline stays bitwise equal to a resident run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.cli import main
from dlo.host.region import LEDGER
from dlo.platform.device import CpuPlatform
from tests.cpu.test_cli import _torchrun
from tests.harness import assert_all_ok, run_ranks
from tests.toys import ToyDiT, TwoStackDiT, clone

DIM = 16
NS = "node-shared"
GBPS = 1e9


def _x(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(2, 3, DIM, generator=g)


def _steps(model: torch.nn.Module, rank: int, n: int) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for s in range(n):
            out.append(model(_x(rank, s)).clone())
    return out


def _fake_probes(
    rank: int,
    numbers: dict[int, tuple[float, float]] | None,
    shm: dict[int, int | None] | None = None,
) -> None:
    """Make this rank measure ``numbers[rank]`` (GB/s of H2D, AllGather) and ``shm[rank]``
    free bytes of shared memory. The real probes still run (the gather is a real
    collective); only the reported value changes."""
    import dlo.runtime.measure as measure

    if shm is not None:
        free = shm[min(rank, max(shm))]
        measure.shared_memory_free_nbytes = lambda: free  # type: ignore[assignment]
    if numbers is None:
        return

    h2d, ag = numbers[min(rank, max(numbers))]
    real_h2d, real_ag = measure.h2d_bandwidth, measure.allgather_bandwidth

    def fake_h2d(*a: Any, **k: Any) -> float:
        real_h2d(*a, **k)
        return h2d * GBPS

    def fake_ag(*a: Any, **k: Any) -> float:
        real_ag(*a, **k)
        return ag * GBPS

    measure.h2d_bandwidth = fake_h2d  # type: ignore[assignment]
    measure.allgather_bandwidth = fake_ag  # type: ignore[assignment]


def _auto(
    rank: int, world: int, numbers: dict[int, tuple[float, float]] | None, cfg_kw: dict[str, Any]
) -> dict[str, Any]:
    _fake_probes(rank, numbers, cfg_kw.pop("shm", None))
    model = TwoStackDiT(5, num_blocks2=2) if cfg_kw.pop("two_stacks", False) else ToyDiT(5)
    ref = _steps(clone(model), rank, 3)
    cfg = dlo.OffloadConfig(mode="layer", collective_timeout_s=20.0, **cfg_kw)
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    backend.enable(model)
    got = _steps(model, rank, 3)
    st = backend.stats()
    stacks = {s.container_path: (s.transfer, s.group_size) for s in backend.plan.stacks}  # type: ignore[union-attr]
    backend.disable()
    return {
        "same": all(torch.equal(a, b) for a, b in zip(ref, got)),
        "policy": st["policy"],
        "transfer": st["transfer"],
        "group_size": st["group_size"],
        "host_share_ranks": st["host_share_ranks"],
        "num_slots": st["num_slots"],
        "num_resident": st["num_resident_blocks"] + st["num_pinned_blocks"],  # the kept ones
        "allgather_nbytes": st["allgather_nbytes"],
        "stacks": stacks,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


# rank -> (H2D GB/s, AllGather GB/s); ranks above the last key use the last entry.
# Blocks are one chunk, G = 2: AllGather wins roughly when AllGather > 2 x H2D.
DISAGREE_PICK_ALLGATHER = {0: (10.0, 1000.0), 1: (100.0, 40.0)}  # min (10, 40): allgather
DISAGREE_PICK_WHOLE_BLOCKS = {0: (10.0, 1000.0), 1: (100.0, 12.0)}  # min (10, 12): whole


def _env(tmp_path: Path) -> dict[str, str]:
    """A private DLO_SHM_DIR: a node-shared choice maps its file there."""
    return {"DLO_SHM_DIR": str(tmp_path)}


@pytest.mark.parametrize(
    "numbers, expected",
    [(DISAGREE_PICK_ALLGATHER, "allgather"), (DISAGREE_PICK_WHOLE_BLOCKS, "node-shared")],
)
def test_ranks_measuring_differently_take_one_decision(
    tmp_path: Path, numbers: dict[int, tuple[float, float]], expected: str
) -> None:
    """Alone, rank 0 would pick AllGather and rank 1 whole blocks (a layout mismatch); with
    the group-wide minimum they agree, and the output is bitwise the resident one. Whole
    blocks of a weight axis of two ranks are node-shared (the shared memory holds them)."""
    cfg = {"transfer": "auto", "num_slots": "auto"}
    res = assert_all_ok(run_ranks(_auto, 2, numbers, cfg, timeout_s=120, env=_env(tmp_path)))
    assert all(r["same"] for r in res)
    assert res[0]["policy"] == res[1]["policy"]
    assert {r["transfer"] for r in res} == {expected}
    assert all(r["stacks"] == {"blocks": (expected, r["group_size"])} for r in res)
    assert all(r["group_size"] == (2 if expected == "allgather" else 1) for r in res)
    assert all(r["host_share_ranks"] == (2 if expected == NS else 1) for r in res)
    assert all((r["allgather_nbytes"] > 0) == (expected == "allgather") for r in res)
    assert all(r["num_slots"] == (3 if expected == "allgather" else 2) for r in res)
    policy = res[0]["policy"]
    # every rank's raw numbers were different, and the decision used the minimum of each
    raw = [(p["h2d_GBps"], p["allgather_GBps"]["data"]) for p in policy["per_rank"]]
    assert raw == [numbers[0], numbers[1]]
    assert policy["measured"]["h2d_GBps"] == pytest.approx(10.0)
    assert policy["measured"]["allgather_GBps"]["data"] == pytest.approx(
        min(numbers[0][1], numbers[1][1])
    )
    assert policy["measured"]["shared_memory_nbytes"] is not None
    assert all(r["ledger"] == (0, 0) for r in res)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "shm, expected",
    [
        ({0: 1 << 40, 1: 1000}, "rank-local"),  # the fullest node decides
        ({0: 1 << 40, 1: None}, "rank-local"),  # unknown on one rank: unknown
        ({0: 1 << 40, 1: 1 << 30}, NS),
    ],
    ids=["one-rank-short", "one-rank-unknown", "both-fit"],
)
def test_shared_memory_decides_between_node_shared_and_rank_local(
    tmp_path: Path, shm: dict[int, int | None], expected: str
) -> None:
    cfg = {"transfer": "auto", "num_slots": "auto", "shm": shm}
    res = assert_all_ok(
        run_ranks(_auto, 2, DISAGREE_PICK_WHOLE_BLOCKS, cfg, timeout_s=120, env=_env(tmp_path))
    )
    assert all(r["same"] and r["ledger"] == (0, 0) for r in res)
    assert res[0]["policy"] == res[1]["policy"]
    assert [r["transfer"] for r in res] == [expected] * 2
    assert all(r["group_size"] == 1 and r["allgather_nbytes"] == 0 for r in res)
    assert [r["host_share_ranks"] for r in res] == [2 if expected == NS else 1] * 2
    policy = res[0]["policy"]
    assert [p["shared_memory_nbytes"] for p in policy["per_rank"]] == [shm[0], shm[1]]
    known = [v for v in shm.values() if v is not None]
    assert policy["measured"]["shared_memory_nbytes"] == (
        min(known) if len(known) == len(shm) else None
    )
    reason = policy["stacks"]["blocks"]["reason"]
    # either way the reason says what the shared memory holds (or why it cannot)
    assert "shared memory" in reason and ("rank-local:" in reason) == (expected == "rank-local"), (
        reason
    )
    if expected == "rank-local":
        assert "shared memory" in policy["explanation"] and reason in policy["explanation"]
        assert ("unknown" in reason) == (None in shm.values()), reason
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("world", [3, 4])
def test_larger_groups_agree_too(world: int) -> None:
    numbers = {0: (10.0, 1000.0), 1: (100.0, 40.0), 2: (30.0, 500.0)}
    res = assert_all_ok(
        run_ranks(
            _auto,
            world,
            numbers,
            {"transfer": "auto", "two_stacks": True},
            timeout_s=180,
        )
    )
    assert all(r["same"] for r in res)
    assert all(r["policy"] == res[0]["policy"] for r in res)
    assert all(r["stacks"] == res[0]["stacks"] for r in res)
    # min (10, 40) with G >= 3: C/G/10 + C/40 < C/10, AllGather on every stack
    assert set(res[0]["stacks"].values()) == {("allgather", world)}


def test_real_probes_and_every_automatic_setting(tmp_path: Path) -> None:
    """No fakes: the real probes run on gloo, every setting is automatic, and every rank
    ends with the same concrete values."""
    cfg = {"transfer": "auto", "num_slots": "auto", "resident_layers": "auto"}
    res = assert_all_ok(run_ranks(_auto, 2, None, cfg, timeout_s=120, env=_env(tmp_path)))
    assert all(r["same"] for r in res)
    assert res[0]["policy"] == res[1]["policy"]
    assert res[0]["num_resident"] == res[1]["num_resident"] == 5  # host RAM: all fit
    measured = res[0]["policy"]["measured"]
    assert measured["h2d_GBps"] > 0 and measured["allgather_GBps"]["data"] > 0
    assert measured["num_ranks"] == 2
    assert all(r["stacks"] == res[0]["stacks"] for r in res)
    assert os.listdir(tmp_path) == []


def test_explicit_allgather_with_auto_slots_measures_its_gather() -> None:
    # the slot count of an AllGather stack depends on the gather's time: it is measured even
    # though the transfer is explicit (a guessed bandwidth gave 2 slots instead of 3)
    numbers = {0: (10.0, 40.0)}  # H2D 10 GB/s, AllGather 40 GB/s: L = 1.25 P -> 3 slots
    cfg = {"transfer": "allgather", "num_slots": "auto"}
    res = assert_all_ok(run_ranks(_auto, 2, numbers, cfg, timeout_s=120))
    assert all(r["same"] for r in res)
    assert res[0]["policy"]["measured"]["allgather_GBps"] == {"data": 40.0}
    assert [r["num_slots"] for r in res] == [3, 3]
    assert "AllGather[data] 40.00 GB/s" in res[0]["policy"]["explanation"]


@pytest.mark.parametrize(
    "cfg_kw, note",
    [
        ({}, "(unset: a CPU device's default; resident_layers='auto' decides it)"),
        ({"resident_layers": 1}, "(explicit)"),
        ({"layer_options": {"dit": {"resident_layers": 2}}}, "(explicit)"),
    ],
)
def test_the_explanation_calls_only_untouched_knobs_the_default(
    cfg_kw: dict[str, Any], note: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = ToyDiT(4)
    cfg = dlo.OffloadConfig(mode="layer", num_slots="auto", **cfg_kw)
    with caplog.at_level("INFO", logger="dlo.backends.auto"):
        backend = dlo.enable_offload(model, cfg, device="cpu")
    assert backend is not None
    backend.disable()
    (line,) = [ln for ln in caplog.text.splitlines() if "resident_layers:" in ln]
    assert line.endswith(note), line


def test_budget_sizes_resident_blocks_identically() -> None:
    # a budget that holds about half of the toy's blocks beside two slots, the non-block
    # weights and the fifth kept for activations ([Note: device budget])
    cfg = {"transfer": "rank-local", "device_budget_gb": 16_000 / (1 << 30)}
    res = assert_all_ok(run_ranks(_auto, 2, None, cfg, timeout_s=120))
    assert all(r["same"] for r in res)
    assert res[0]["policy"] == res[1]["policy"]
    n = res[0]["num_resident"]
    assert 0 < n < 5 and res[1]["num_resident"] == n
    assert res[0]["policy"]["device_weight_nbytes"] <= 16_000


def _gpu_defaults(rank: int, world: int, free: dict[int, int], cfg_kw: dict[str, Any]) -> Any:
    """Rank-local defaults as on a GPU (the unset fields become "auto"), with ``free[rank]``
    bytes of device memory: every rank decides for itself, with no exchange at enable."""
    import dlo.config.unset as unset
    from dlo.parallel.store import exchanges_started

    unset.device_values = lambda _: {n: "auto" for n in unset.UNSET_FIELDS}  # type: ignore[assignment]
    CpuPlatform.free_memory = lambda self: free[rank]  # type: ignore[method-assign]
    model = ToyDiT(5)
    ref = _steps(clone(model), rank, 3)
    cfg = dlo.OffloadConfig(mode="layer", collective_timeout_s=20.0, **cfg_kw)
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    before = exchanges_started()
    backend.enable(model)
    exchanged = exchanges_started() - before
    got = _steps(model, rank, 3)
    st = backend.stats()
    backend.disable()
    return {
        "same": all(torch.equal(a, b) for a, b in zip(ref, got)),
        "exchanged": exchanged,
        "explanation": st["policy"]["explanation"],
        "num_resident": st["num_resident_blocks"] + st["num_pinned_blocks"],  # the kept ones
    }


def test_rank_local_defaults_are_decided_by_each_rank_alone() -> None:
    """[Note: automatic by default]: ranks whose stacks exchange nothing and which leave only
    unset fields to the policy decide alone: no store exchange at enable (a job that asked
    for no collective neither waits on nor fails with a peer), each from its own free
    memory, bitwise. The same job with an explicit "auto" decides together."""
    free = {0: 1 << 30, 1: 15_000}  # rank 1: 12 kB less headroom, about half the blocks
    res = assert_all_ok(run_ranks(_gpu_defaults, 2, free, {}, timeout_s=120))
    assert all(r["same"] for r in res)
    assert [r["exchanged"] for r in res] == [0, 0]
    assert all(r["explanation"].startswith("dlo policy (this rank alone") for r in res)
    assert res[0]["num_resident"] == 5 and 0 < res[1]["num_resident"] < 5
    res = assert_all_ok(run_ranks(_gpu_defaults, 2, free, {"num_slots": "auto"}, timeout_s=120))
    assert all(r["same"] and r["exchanged"] > 0 for r in res)
    assert res[0]["num_resident"] == res[1]["num_resident"] < 5  # the group-wide minimum


def _enabled_or_refusal(cfg: dlo.OffloadConfig, world: int) -> str:
    """Enable on a fresh toy: "enabled", or the refusal's message after checking that the
    model was left as it was."""
    model = ToyDiT(4)
    before = [p.detach().clone() for p in model.parameters()]
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    try:
        backend.enable(model)
    except dlo.OffloadError as e:
        assert not backend.is_enabled()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return str(e)
    return "enabled"


def _failing_probe(rank: int, world: int) -> str:
    import dlo.runtime.measure as measure

    if rank == 1:

        def broken(*a: Any, **k: Any) -> float:
            raise RuntimeError("probe broke")

        measure.h2d_bandwidth = broken  # type: ignore[assignment]
    cfg = dlo.OffloadConfig(mode="layer", transfer="auto", collective_timeout_s=20.0)
    return _enabled_or_refusal(cfg, world)


def test_a_failed_probe_fails_every_rank_naming_it() -> None:
    res = assert_all_ok(run_ranks(_failing_probe, 2, timeout_s=90))
    for msg in res:
        assert "measurement for the automatic policy failed on rank(s) [1]" in msg
        assert "probe broke" in msg


def _auto_on_one_rank(rank: int, world: int, field: str) -> str:
    kw: dict[str, Any] = {"transfer": "allgather"}
    if rank == 0:
        kw[field] = {"num_slots": "auto", "device_budget_gb": 1.0, "transfer": "auto"}[field]
    cfg = dlo.OffloadConfig(mode="layer", collective_timeout_s=60.0, **kw)
    return _enabled_or_refusal(cfg, world).split("]", 1)[-1]


@pytest.mark.parametrize(
    "field, needle",
    [
        ("num_slots", "num_slots: rank 0='auto', rank 1=2"),
        ("device_budget_gb", "device_budget_gb: rank 0=1.0, rank 1=None"),
        ("transfer", "transfer for 'dit': rank 0='auto', rank 1='allgather'"),
    ],
)
def test_auto_on_one_rank_only_is_named_promptly(field: str, needle: str) -> None:
    """Only automatic ranks enter the policy's exchanges; a rank without "auto" went straight
    to the startup agreement and both waited out the timeout (60 s here) with a message
    naming ranks that did reach enable. Now the mismatch is named at once on every rank."""
    t0 = time.monotonic()
    msgs = assert_all_ok(run_ranks(_auto_on_one_rank, 2, field, timeout_s=50))
    assert time.monotonic() - t0 < 50
    assert len(set(msgs)) == 1, msgs
    assert "different automatic settings" in msgs[0] and needle in msgs[0], msgs[0]


# ----------------------------------------------------------------------------- dlo run --explain
def test_run_explain_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "run",
            "--steps",
            "2",
            "--device",
            "cpu",
            "--transfer",
            "auto",
            "--num-slots",
            "auto",
            "--resident-layers",
            "auto",
            "--explain",
            "--check",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "dlo policy (group-wide minimum over 1 rank(s))" in out
    assert "host-to-device" in out and "GB/s" in out
    assert "num_slots: 2" in out and "resident_layers: 5 per DiT" in out
    assert "bitwise equal" in out
    # after the run: what the forwards changed (a CPU has no allocator statistics: none)
    assert "dlo re-plans: none (every forward ran as enable planned it)" in out


def test_run_explain_without_automatic_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--steps", "1", "--device", "cpu", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "nothing automatic" in out
    assert "codec=none (unset: a CPU device's default)" in out  # [Note: automatic by default]
    assert " codec=" not in out.splitlines()[0]  # the header: given values only
    assert main(["run", "--steps", "1", "--device", "cpu", "--explain", "--codec", "none"]) == 0
    out = capsys.readouterr().out
    assert "nothing automatic" in out and "codec=none (pass" in out  # given: no "unset"


@pytest.mark.parametrize("given", ["0", "1"])
def test_an_explicit_resident_count_is_kept_under_a_budget(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 35 item 1: the budget no longer revises an explicit count (0 was made "auto")."""
    argv = ["run", "--steps", "1", "--device", "cpu", "--json", "--device-budget-gb", "1"]
    assert main([*argv, "--resident-layers", given]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["num_resident_blocks"] == int(given)
    assert f"resident_layers: {given} per DiT (explicit)" in report["policy"]["explanation"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--num-slots", "many"], "'many' is not an int or 'auto'"),
        (["run", "--device-budget-gb", "0"], "device_budget_gb must be a finite number > 0"),
        (
            ["run", "--resident-layers", "2", "--device-budget-gb", "0.000001"],
            "device_budget_gb=1e-06 cannot hold what the run needs",
        ),
    ],
)
def test_bad_policy_flags_are_one_clear_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_torchrun_run_auto_explain_two_cpu_ranks() -> None:
    proc = _torchrun(
        "run", "--transfer", "auto", "--num-slots", "auto", "--steps", "2", "--check",
        "--json", "--explain", "--gather-engine", "auto",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout[proc.stdout.index("[") :])
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["parity"] is True for r in reports)
    assert reports[0]["policy"] == reports[1]["policy"] is not None
    assert reports[0]["transfer"] == reports[1]["transfer"]
    # --json keeps stdout machine-readable: rank 0's explanation went to stderr, once
    assert proc.stderr.count("dlo policy (group-wide minimum over 2 rank(s))") == 1
    # what gathered: NCCL's gather on gloo (never the copy engine), nothing for whole blocks
    want = "nccl" if reports[0]["transfer"] == "allgather" else None
    assert [r["gather_engine"] for r in reports] == [want, want]


def _two_groups_on_one_node(rank: int, world: int, free: int) -> tuple[str, str]:
    import dlo.runtime.measure as measure

    _fake_probes(rank, {0: (10.0, 12.0)})  # whole blocks win
    measure.shared_memory_free_nbytes = lambda: free  # type: ignore[assignment]
    backend = LayerwiseBackend(
        dlo.OffloadConfig(mode="layer", transfer="auto", collective_timeout_s=20.0),
        dlo.ParallelConfig(data_parallel_size=2, sequence_parallel_size=2),
        CpuPlatform(),
    )
    backend.enable(ToyDiT(5))
    st = backend.stats()
    backend.disable()
    return st["transfer"], st["policy"]["stacks"]["blocks"]["reason"]


def test_two_weight_groups_on_one_node_need_two_copies(tmp_path: Path) -> None:
    """DP 2 x SP 2 on one node, weights shared along data: two groups ([0, 2], [1, 3]), so two
    copies; shared memory that holds one (with the headroom) but not two is rank-local."""
    from dlo.config.fields import MIB
    from dlo.plan.layout import describe_entries, module_tensor_entries, plan_block_layout

    one_copy = sum(
        plan_block_layout(
            f"blocks.{i}",
            describe_entries(module_tensor_entries(b)),
            group_size=1,
            chunk_nbytes=64 * MIB,
        ).padded_nbytes
        for i, b in enumerate(ToyDiT(5).blocks)
    )
    env = {"DLO_SHM_DIR": str(tmp_path)}
    free = int(one_copy * 1.3)
    res = assert_all_ok(run_ranks(_two_groups_on_one_node, 4, free, timeout_s=90, env=env))
    assert {t for t, _ in res} == {"rank-local"}
    assert all("the node's 2 copies need" in why for _, why in res), res
    res = assert_all_ok(run_ranks(_two_groups_on_one_node, 4, 3 * one_copy, timeout_s=90, env=env))
    assert {t for t, _ in res} == {"node-shared"}
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("compute_ms", "expected"), [(None, "allgather"), (1e4, "node-shared")])
def test_a_given_block_compute_takes_node_shared_where_it_hides_whole_copies(
    tmp_path: Path, compute_ms: float | None, expected: str
) -> None:
    """AllGather is faster per block (DISAGREE_PICK_ALLGATHER's minimum), but a compute of
    10 s per block hides every whole-block copy: node-shared, no peer traffic; the same
    decision on both ranks, bitwise output."""
    cfg = {"transfer": "auto", "block_compute_ms": compute_ms}
    res = assert_all_ok(
        run_ranks(_auto, 2, DISAGREE_PICK_ALLGATHER, cfg, timeout_s=120, env=_env(tmp_path))
    )
    assert all(r["same"] and r["transfer"] == expected for r in res)
    assert res[0]["policy"] == res[1]["policy"]
    reason = res[0]["policy"]["stacks"]["blocks"]["reason"]
    assert ("hides every whole-block copy" in reason) == (expected == NS), reason
    assert os.listdir(tmp_path) == []


def _one_rank_hints(rank: int, world: int) -> str:
    cfg = dlo.OffloadConfig(
        mode="layer",
        transfer="auto",
        block_compute_ms=5.0 if rank == 0 else None,
        collective_timeout_s=20.0,
    )
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    with pytest.raises(dlo.OffloadError) as e:
        backend.enable(ToyDiT(3))
    return str(e.value).split("] ", 1)[1]


def test_a_block_compute_given_on_one_rank_only_is_named(tmp_path: Path) -> None:
    res = assert_all_ok(run_ranks(_one_rank_hints, 2, timeout_s=60, env=_env(tmp_path)))
    assert res[0] == res[1] and "block_compute_ms: rank 0=5.0, rank 1=None" in res[0], res


def _explicit_hints_differ(rank: int, world: int) -> str:
    cfg = dlo.OffloadConfig(
        mode="layer",
        transfer="node-shared",
        block_compute_ms=1.0 + rank,  # ignored: nothing is automatic
        collective_timeout_s=20.0,
    )
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    backend.enable(ToyDiT(3))
    backend.disable()
    return "enabled"


def test_a_block_compute_that_nothing_uses_may_differ_between_ranks(tmp_path: Path) -> None:
    assert assert_all_ok(
        run_ranks(_explicit_hints_differ, 2, timeout_s=60, env=_env(tmp_path))
    ) == [
        "enabled",
        "enabled",
    ]
