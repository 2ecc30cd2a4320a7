"""``python -m dlo.bench.pipeline_budgets``: a tiny folder under two budgets, every method in
one process, calls of two sizes in sequence, every row bitwise against resident; bad input
refused by name before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlo.bench import pipeline_budgets as pb
from dlo.host.region import LEDGER
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("budgets") / "tiny-flux"
    save_folder(FOLDERS["tiny-flux"], out, max_shard_size=40_000)
    return out


def test_every_method_under_every_budget_bitwise(folder: Path, tmp_path: Path) -> None:
    report_path, table_path = tmp_path / "r.json", tmp_path / "r.md"
    argv = [str(folder), "--budgets", "0.0012,1", "--size", "32x32", "--size", "64x64"]
    argv += ["--steps", "2,3", "--dtype", "float32", "--sweep-counts", "0,auto"]
    argv += [
        "--sweep-slots",
        "2",
        "--unbudgeted",
        "--forward-marks",
        "--json",
        str(report_path),
        "--markdown",
        str(table_path),
    ]
    assert pb.main(argv) == 0
    report = json.loads(report_path.read_text())
    assert report["sizes"] == ["32x32", "64x64"] and report["steps"] == [2, 3]
    rows = report["results"]
    done = [r for r in rows if "failed" not in r]
    assert done and all(r["bitwise_vs_resident"] for r in done)
    assert all(r["output_bitwise_vs_resident"] for r in done)
    assert {r["compared"] for r in done} == {"latents"}  # the DiT's result, before the VAE
    for budget in (0.0012, 1.0):
        for size in ("32x32", "64x64"):
            methods = {r["method"] for r in rows if r["budget_gb"] == budget and r["size"] == size}
            assert methods == {"resident", "dlo", "dlo-sweep", "dlo-best", "diffusers-group"}, (
                budget,
                size,
            )
    # the sweep: 2 counts x 1 slot count x 2 component sets per budget, both calls each
    settings = {(r["budget_gb"], r["setting"]) for r in rows if r["method"] == "dlo-sweep"}
    assert len(settings) == 2 * 2 * 2
    dlo_rows = [r for r in done if r["method"] == "dlo"]
    assert all(len(r["step_ms"]) == (2 if r["size"] == "32x32" else 3) for r in dlo_rows)
    # the diagnostic: one time per DiT forward (the tiny FLUX folder: one forward a step)
    assert all(len(r["forward_ms"]) == len(r["step_ms"]) for r in done)
    assert all(ms >= 0 for r in done for ms in r["forward_ms"])
    assert all("kept_whole" in r for r in dlo_rows if r["budget_gb"] is not None)
    unbudgeted = [r for r in dlo_rows if r["budget_gb"] is None]
    assert [r["size"] for r in unbudgeted] == ["32x32", "64x64"]
    table = table_path.read_text()
    assert "dlo with nothing set, 64x64:" in table
    assert "the best manual setting" in table and "| dlo-best |" in table
    assert "x diffusers group offloading" in table and "| diffusers-group |" in table
    group = [r for r in rows if r["method"] == "diffusers-group"]
    assert len(group) == 4 and all(r["enable_s"] is not None for r in group)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--size", "32"], "--size"),
        (["--size", "32x32", "--steps", "2,3"], "--steps"),
        (["--size", "32x32", "--sweep-counts", "few"], "--sweep-counts"),
        (["--size", "32x32", "--methods", "dlo,fast"], "--methods"),
        (["--size", "32x32", "--budgets", "0"], "--budgets"),
    ],
)
def test_bad_input_is_refused_naming_the_flag(folder: Path, argv: list[str], named: str) -> None:
    base = [str(folder), "--budgets", "1", "--dtype", "float32"]
    with pytest.raises(ValueError, match=named):
        pb.main(base + argv)
