"""``dlo bench --like``: a diffusers transformer at a named shape, resident and dlo-ring in one
run on CPU (diffusers-group needs CUDA streams: skipped, said so)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlo.cli import main


def test_bench_like_runs_resident_and_the_ring_bitwise(tmp_path: Path) -> None:
    out = tmp_path / "like.json"
    rc = main(["bench", "--like", "tiny-flux", "--tokens", "16", "--reps", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"resident", "dlo-ring"}
    ring = rows["dlo-ring"]
    assert ring["bitwise_vs_resident"] is True
    assert ring["demand_loads_after_warmup"] == 0  # the seam between the two stacks
    # every streamed byte once per forward, no more (chunk padding aside)
    assert ring["h2d_nbytes_per_forward"] == pytest.approx(report["streamed_nbytes"], rel=0.02)
    assert 0 < report["streamed_nbytes"] < report["model_nbytes"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokens", "15"], "must be a square"),
        (["--methods", "fsdp2-offload"], "'fsdp2-offload' is not one of"),
        (["--like-slots", "0"], "--like-slots"),
    ],
)
def test_bench_like_refuses_bad_input_naming_it(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--like", "tiny-flux", "--reps", "1", *flags]) != 0
    assert message in capsys.readouterr().err


def test_bench_like_budgets_rows_per_budget(tmp_path: Path) -> None:
    """Issue 35 item 5 on the CPU (no allocator cap here: the plumbing, not the numbers):
    per budget, resident where the weights fit, dlo with no flags planned against the
    budget, the best setting of the sweep, each bitwise against resident; a budget nothing
    fits under is a row that says so, not a crash."""
    out = tmp_path / "budgets.json"
    argv = ["bench", "--like", "tiny-flux", "--tokens", "16", "--reps", "1", "--warmup", "0"]
    assert main([*argv, "--budgets", "0.0001,1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["capped"] is False
    rows = {(r["budget_gb"], r["method"]): r for r in report["results"]}
    assert set(rows) == {(b, m) for b in (0.0001, 1.0) for m in ("resident", "dlo", "dlo-best")}
    assert "exceed the budget" in rows[(0.0001, "resident")]["failed"]
    assert "device_budget_gb=0.0001 cannot hold" in rows[(0.0001, "dlo")]["failed"]
    dlo, best = rows[(1.0, "dlo")], rows[(1.0, "dlo-best")]
    # the tiny model fits 1 GiB: every block kept, as pins (none loads per forward)
    assert dlo["num_streamed_blocks"] == dlo["num_pinned_blocks"] > 0
    assert dlo["bitwise_vs_resident"] is True and best["bitwise_vs_resident"] is True
    assert best["swept"] == len([s for s in report["sweep"] if s["budget_gb"] == 1.0])
    assert best["median_ms"] == min(
        s["median_ms"] for s in report["sweep"] if s["budget_gb"] == 1.0
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--budgets", "0"], "--budgets='0': expected GiB > 0"),
        (["--budgets", "24", "--methods", "dlo-ring"], "'dlo-ring' is not one of"),
    ],
)
def test_bench_budgets_refuse_bad_input_naming_it(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--like", "tiny-flux", "--reps", "1", *flags]) != 0
    assert message in capsys.readouterr().err


def test_bench_budgets_need_like(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--budgets", "24"]) != 0
    assert "--budgets='24' needs --like NAME" in capsys.readouterr().err
