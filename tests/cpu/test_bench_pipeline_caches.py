"""``python -m dlo.bench.pipeline_caches``: a tiny folder with FirstBlockCache, the threshold
chosen on the resident pipeline, every row bitwise against resident with that cache, dlo's
skipped blocks the same as resident's and never loaded; bad input refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlo.bench import pipeline_caches as pc
from dlo.host.region import LEDGER
from tests.cpu.test_bench_pipeline_budgets import folder

__all__ = ["folder"]  # fixture


def test_cached_rows_bitwise_and_skipped_blocks_not_loaded(folder: Path, tmp_path: Path) -> None:
    report_path, table_path = tmp_path / "r.json", tmp_path / "r.md"
    argv = [str(folder), "--budget", "0.0012", "--size", "32x32", "--size", "64x64"]
    argv += ["--steps", "8,6", "--dtype", "float32", "--thresholds", "2,0.05,0.2"]
    argv += ["--min-skip", "0.5", "--json", str(report_path), "--markdown", str(table_path)]
    assert pc.main(argv) == 0
    report = json.loads(report_path.read_text())
    rows = report["results"]
    assert not [r for r in rows if "failed" in r]
    sweep = {r["threshold"]: r for r in rows if r["method"] == "resident-sweep"}
    chosen = report["threshold"]
    # in increasing order up to the one chosen: no larger threshold is run
    assert sorted(sweep) == [t for t in (0.05, 0.2, 2.0) if t <= chosen]

    def skipped(t: float) -> float:
        ran = [r for r in rows if r["method"] == "resident-sweep" and r["threshold"] == t]
        return 1 - sum(r["block_runs"] for r in ran) / sum(r["block_calls"] for r in ran)

    # the smallest threshold that skips at least half the block calls
    assert skipped(chosen) >= 0.5
    assert all(skipped(t) < 0.5 for t in sweep if t < chosen)
    by = {(r["method"], r["size"]): r for r in rows if r["threshold"] == chosen}
    counted = {
        r["size"]: r for r in rows if r["method"] == "resident-sweep" and r["threshold"] == chosen
    }
    for method in ("resident", "diffusers-group", "dlo"):
        for size in ("32x32", "64x64"):
            assert by[method, size]["bitwise_vs_resident"] is True, (method, size)
    for size in ("32x32", "64x64"):
        res, dlo = counted[size], by["dlo", size]
        assert "block_runs" not in by["resident", size]  # the compute term ran without hooks
        # the streamed blocks moved inside the cache, and skipped as resident's (the pinned
        # ones skip too, uncounted: they load nothing either way)
        assert dlo["num_cache_inner_blocks"] == dlo["num_streamed_blocks"] > 0
        assert 0 < dlo["num_skipped_blocks"] <= res["block_calls"] - res["block_runs"]
        # a skipped block loads nothing: fewer loads than the blocks that ran, plus at most
        # one wasted load per step
        steps = len(res["step_ms"]) + 1
        assert dlo["num_loads"] <= res["block_runs"] + steps
        assert dlo["num_wasted_loads"] <= steps
        assert 0 <= dlo["denoise_wasted_nbytes"] <= dlo["denoise_h2d_nbytes"] <= dlo["h2d_nbytes"]
        assert dlo["held_at_enable_nbytes"] >= 0 and dlo["pinned_at_enable"] is not None
    # dlo before group offloading: nothing a failed group row left is on the device at enable
    methods = [r["method"] for r in rows]
    assert methods.index("dlo") < methods.index("diffusers-group")
    table = table_path.read_text()
    assert "dlo with the cache, call 2 (64x64)" in table and "diffusers group offloading" in table
    assert "at enable:" in table
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)  # dlo's host memory given back


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--budget", "24,32", "--budget"),
        ("--thresholds", "0.1,x", "--thresholds"),
        ("--thresholds", "0,0.1", "--thresholds"),
        ("--min-skip", "1.5", "--min-skip"),
        ("--methods", "dlo,resident-sweep", "--methods"),
    ],
)
def test_bad_input_named_before_any_work(folder: Path, flag: str, value: str, named: str) -> None:
    argv = [str(folder), "--budget", "1", "--size", "32x32", flag, value]
    with pytest.raises(ValueError, match=named):
        pc.run(pc.parse(argv))


def test_the_sweep_stops_at_the_first_threshold_that_skips_enough_and_extends_the_largest() -> None:
    skips = {0.05: 0.0, 0.1: 0.2, 0.2: 0.5, 0.4: 0.9}
    ran: list[float] = []

    def measure(t: float) -> float:
        ran.append(t)
        return skips.get(t, 0.0)

    assert pc.sweep([0.4, 0.05, 0.2, 0.1], 0.5, measure) == {0.05: 0.0, 0.1: 0.2, 0.2: 0.5}
    assert ran == [0.05, 0.1, 0.2]  # 0.4 never run
    ran.clear()
    skips = {0.8: 0.1, 1.6: 0.45}
    assert list(pc.sweep([0.4], 0.45, measure)) == [0.4, 0.8, 1.6]  # the largest doubled
    ran.clear()
    assert list(pc.sweep([0.4], 0.99, measure, extend=2)) == [0.4, 0.8, 1.6]  # at most twice
