"""``python -m dlo.bench.pipeline_adapters``: a tiny folder serving requests over random
LoRAs, every dlo placement bitwise against resident per request; bad input named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlo.bench import pipeline_adapters as pa
from dlo.host.region import LEDGER
from tests.cpu.test_bench_pipeline_budgets import folder

__all__ = ["folder"]  # fixture


def test_every_placement_serves_the_resident_bits(folder: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "r.json"
    argv = [str(folder), "--budget", "0.0012", "--size", "32x32", "--steps", "2"]
    argv += ["--rank", "4", "--adapters", "3", "--requests", "5", "--dtype", "float32"]
    argv += ["--json", str(report_path), "--markdown", str(tmp_path / "r.md")]
    assert pa.main(argv) == 0
    report = json.loads(report_path.read_text())
    rows = report["results"]
    assert not [r for r in rows if "failed" in r]
    for method in pa.METHODS:
        mine = [r for r in rows if r["method"] == method]
        assert [r["request"] for r in mine] == list(range(5)), method
        assert [r["adapter"] for r in mine][:4] == ["a0", "a1", "a2", "a0"]
        if method not in ("resident", "dlo-none"):
            assert all(r["bitwise_vs_resident"] is True for r in mine), method
    # an adapter streamed with its block is in dlo's host copy; one loaded after is not
    host = {r["method"]: r["host_nbytes"] for r in rows if r["method"] != "resident"}
    assert host["dlo-streamed"] > host["dlo-switch"] == host["dlo-load"] == host["dlo-none"]
    preload = {r["method"]: r["preload_ms"] for r in rows if r["method"] != "resident"}
    assert preload["dlo-switch"] > 0 and preload["dlo-streamed"] > 0 and preload["dlo-load"] == 0
    assert report["adapter_nbytes"] > 0
    assert "target switch" in (tmp_path / "r.md").read_text()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--budget", "1,2"), ("--rank", "0"), ("--requests", "0"), ("--methods", "dlo-load")],
)
def test_bad_input_named_before_any_work(folder: Path, flag: str, value: str) -> None:
    argv = [str(folder), "--budget", "1", "--size", "32x32", flag, value]
    with pytest.raises(ValueError, match=flag):
        pa.run(pa.parse(argv))


def test_targets_that_match_no_layer_are_named(folder: Path) -> None:
    argv = [str(folder), "--budget", "1", "--size", "32x32", "--targets", "nothing_here"]
    with pytest.raises(ValueError, match="--targets"):
        pa.run(pa.parse(argv))
