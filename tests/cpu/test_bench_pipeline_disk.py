"""``python -m dlo.bench.pipeline_disk``: a tiny folder streamed from its files under host
budgets, every dlo row bitwise against resident, the disk probe and the disk-limit row in
the table; bad input refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlo.bench import pipeline_disk as pd
from dlo.host.region import LEDGER
from tests.cpu.test_bench_pipeline_budgets import folder

__all__ = ["folder"]  # fixture


def test_disk_rows_are_bitwise_and_read_what_the_budget_leaves(
    folder: Path, tmp_path: Path
) -> None:
    report_path, table_path = tmp_path / "r.json", tmp_path / "r.md"
    argv = [str(folder), "--host-budgets", "0,0.0004", "--size", "32x32", "--size", "64x64"]
    argv += ["--steps", "3,2", "--dtype", "float32", "--probe-gb", "0.001"]
    argv += ["--json", str(report_path), "--markdown", str(table_path)]
    assert pd.main(argv) == 0
    report = json.loads(report_path.read_text())
    rows = report["results"]
    assert not [r for r in rows if "failed" in r], rows
    assert report["disk_probe"]["GBps"] > 0 and report["h2d_pinned_GBps"] > 0
    disk = [r for r in rows if r["method"] == "dlo-disk"]
    assert [(r["host_budget_gb"], r["size"]) for r in disk] == [
        (0.0, "32x32"),
        (0.0, "64x64"),
        (0.0004, "32x32"),
        (0.0004, "64x64"),
    ]
    for r in disk:
        assert r["bitwise_vs_resident"] is True, r
        assert r["num_disk_blocks"] > 0 and r["disk_read_nbytes"] > 0
        assert r["host_region_nbytes"] <= r["host_budget_gb"] * (1 << 30)
    everything, some = disk[0], disk[2]
    assert everything["host_region_nbytes"] == 0
    assert some["num_disk_blocks"] < everything["num_disk_blocks"]
    table = table_path.read_text()
    assert "Disk probe:" in table and "| disk-limit |" in table
    assert "max(compute" in table
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


@pytest.mark.parametrize("bad", ["", "x", "-1", "1,,-2"])
def test_bad_host_budgets_are_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="--host-budgets"):
        pd.host_budgets(bad)


def test_a_folder_without_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \.safetensors file"):
        pd.dit_file(str(tmp_path))
