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
