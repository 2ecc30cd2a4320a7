"""The bench report's tables and plot from a synthetic report (no measurement)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dlo.bench import report as bench


def _report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "preset": "tiny",
        "dtype": "bfloat16",
        "world_size": 2,
        "device": "cpu",
        "torch": "x",
        "num_blocks": 2,
        "block_nbytes": 1000,
        "date": "2026-11-30",
        "chunk_mb": [64],
        "num_slots": [2],
        "limits": {
            "h2d_pinned_alone_GBps": 10.0,
            "h2d_pinned_concurrent_GBps": 10.0,
            "h2d_pageable_GBps": 1.0,
            "allgather_GBps": 50.0,
            "h2d_ms_per_block": 0.1,
        },
        "results": [{"peak_device_nbytes": 0, "median_ms": 1.0, "min_ms": 1.0, **r} for r in rows],
    }
    bench._ratios(report, 2000)
    return report


def test_methods_dlo_does_not_pin_for_show_a_dash_not_zero() -> None:
    text = bench.markdown(_report([{"method": "resident", "tokens": 64}]))
    header = [c.strip() for c in text.splitlines()[-3].strip("|").split("|")]
    row = [c.strip() for c in text.splitlines()[-1].strip("|").split("|")]
    assert row[header.index("pinned host GB / rank")] == "-"
    assert row[header.index("first forward s")] == "-"  # not measured in this row


def test_auto_without_a_manual_row_says_so() -> None:
    rows = [
        {"method": "dlo-auto", "tokens": 64, "transfer": "rank-local", "num_slots": 2,
         "host_pinned_nbytes": 2000, "h2d_limit_ms": 0.2},
    ]  # fmt: skip
    report = _report(rows)
    assert report["results"][0]["x_best_manual"] is None
    assert "(rank-local, 2 slots, no manual row)" in bench.markdown(report)


def test_plot_draws_one_limit_per_distinct_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.axes

    drawn: list[tuple[float, str]] = []
    real = matplotlib.axes.Axes.hlines

    def hlines(self: Any, y: float, *a: Any, **kw: Any) -> Any:
        drawn.append((y, kw.get("label", "")))
        return real(self, y, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "hlines", hlines)
    rows = [
        {"method": "dlo-rank-local", "tokens": 64, "h2d_limit_ms": 0.2},
        {"method": "dlo-allgather", "tokens": 64, "h2d_limit_ms": 0.1},
        {"method": "dlo-allgather", "tokens": 128, "h2d_limit_ms": 0.1},
    ]
    bench.plot(_report(rows), str(tmp_path / "p.png"))
    assert sorted(drawn) == [
        (0.1, "H2D limit of dlo-allgather"),
        (0.2, "H2D limit of dlo-rank-local"),
    ]
