"""``python -m dlo.bench.pipeline_disk``: a tiny folder streamed from its files under host
budgets, every dlo row bitwise against resident, the disk probe and the disk-limit row in
the table; bad input refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dlo.bench import pipeline_disk as pd
from dlo.cli import main
from dlo.host.region import LEDGER
from tests.cpu.test_bench_pipeline_budgets import folder
from tests.cpu.test_pipeline_folders import _call_flags

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


def test_codec_rows_read_the_encoded_checkpoint(folder: Path, tmp_path: Path) -> None:
    """``--codec ans``: the disk blocks are read encoded from the encoded checkpoints that
    ``dlo run --save-encoded`` wrote beside the folder's weights; fewer bytes than raw (the
    reference codec on random weights: a proxy, not a ratio), bitwise."""
    own = tmp_path / "folder"
    shutil.copytree(folder, own)
    call = [
        *_call_flags("tiny-flux"),
        "--steps",
        "1",
        "--resident-layers",
        "0",
        "--dtype",
        "float32",
    ]
    assert main(["run", "--pipeline", str(own), "--codec", "ans", "--save-encoded", *call]) == 0
    report_path = tmp_path / "r.json"
    rows = {}
    for codec in ("none", "ans"):
        argv = [str(own), "--host-budgets", "0", "--size", "32x32", "--steps", "2"]
        argv += ["--dtype", "float32", "--probe-gb", "0.001"]
        assert pd.main([*argv, "--codec", codec, "--json", str(report_path)]) == 0
        results = json.loads(report_path.read_text())["results"]
        (rows[codec],) = [r for r in results if r["method"] == "dlo-disk"]
    raw, enc = rows["none"], rows["ans"]
    assert enc["bitwise_vs_resident"] is True and enc["codec"] == "ans", enc
    assert enc["num_disk_encoded_blocks"] == enc["num_disk_blocks"] == raw["num_disk_blocks"] > 0
    assert 0 < enc["disk_read_nbytes"] < raw["disk_read_nbytes"]
    assert enc["encoded_h2d_nbytes"] > 0 and raw["num_disk_encoded_blocks"] == 0
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


@pytest.mark.parametrize("bad", ["", "x", "-1", "1,,-2"])
def test_bad_host_budgets_are_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="--host-budgets"):
        pd.host_budgets(bad)


def test_a_folder_without_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \.safetensors file"):
        pd.dit_file(str(tmp_path))


def test_dlo_bench_disk_row_reads_the_blocks_beyond_the_budget(tmp_path: Path) -> None:
    """``dlo bench --methods dlo-disk``: opt-in (the default methods write nothing), the
    preset's DiT saved under --disk-dir and removed after, the bytes read per forward
    against the probed disk, and its disk-limit row in the table."""
    from dlo.cli import main

    disk = tmp_path / "disk"
    disk.mkdir()
    path, table = tmp_path / "b.json", tmp_path / "b.md"
    argv = ["bench", "--preset", "tiny", "--tokens", "32", "--warmup", "1", "--reps", "2"]
    argv += ["--methods", "resident,dlo-disk", "--host-budget-gb", "0.0003"]
    argv += ["--disk-dir", str(disk), "--json", str(path), "--markdown", str(table)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    (row,) = [r for r in report["results"] if r["method"] == "dlo-disk"]
    assert row["num_disk_blocks"] > 0 and row["host_region_nbytes"] <= 0.0003 * (1 << 30)
    # every forward reads the blocks the budget leaves in the file
    assert row["disk_nbytes_per_fwd"] > 0 and row["disk_limit_ms"] > 0
    assert report["limits"]["disk_GBps"] > 0 and "disk_direct" in report["limits"]
    assert not list(disk.iterdir())  # the saved DiT is gone
    text = table.read_text()
    assert "| dlo-disk | 32 |" in text and "| disk-limit | 32 |" in text
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    from dlo.bench.methods import METHODS

    assert "dlo-disk" not in METHODS  # not in `dlo bench`'s default methods
