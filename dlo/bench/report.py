"""The bench report: ratios against the measured limits, the markdown table, the plot, JSON."""

from __future__ import annotations

import json
import os
from typing import Any

from dlo.bench.disk_row import markdown_disk
from dlo.bench.methods import AUTO_METHODS, MANUAL_DLO_METHODS
from dlo.runtime.measure import (
    GB,
)


def label(row: dict[str, Any]) -> str:
    """A result row's name in tables and plots: the method, with its setting in a sweep."""
    setting = row.get("setting")
    return f"{row['method']} [{setting}]" if setting else str(row["method"])


def _listed(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _ratios(report: dict[str, Any], streamed_bytes: int) -> None:
    resident = {r["tokens"]: r["median_ms"] for r in report["results"] if r["method"] == "resident"}
    # the two sides of the ring per block: compute (resident) and one block's copy
    lim = report["limits"]
    lim["resident_ms_per_block"] = {
        str(t): ms / report["num_blocks"] for t, ms in sorted(resident.items())
    }
    bw = lim.get("h2d_pinned_alone_GBps") or 0.0
    lim["h2d_ms_per_block"] = report["block_nbytes"] / (bw * GB) * 1e3 if bw else None
    for r in report["results"]:
        base = resident.get(r["tokens"])
        r["x_resident"] = r["median_ms"] / base if base else None
        lim = r.get("h2d_limit_ms")
        r["x_h2d_limit"] = r["median_ms"] / lim if lim else None
    best_peer: dict[int, float] = {}
    for r in report["results"]:
        if r["method"].startswith(("fsdp2", "diffusers")):
            best_peer[r["tokens"]] = min(best_peer.get(r["tokens"], float("inf")), r["median_ms"])
    for r in report["results"]:
        peer = best_peer.get(r["tokens"])
        r["x_best_peer"] = r["median_ms"] / peer if peer else None
    # the automatic policy against the best manual dlo setting of this run (issue: <= 1.05)
    manual: dict[int, float] = {}
    for r in report["results"]:
        if r["method"] in MANUAL_DLO_METHODS:
            manual[r["tokens"]] = min(manual.get(r["tokens"], float("inf")), r["median_ms"])
    for r in report["results"]:
        if r["method"] in AUTO_METHODS:  # null: no manual row at these tokens in this run
            best = manual.get(r["tokens"])
            r["x_best_manual"] = r["median_ms"] / best if best else None


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    lim = report["limits"]
    lines = [
        f"{report['preset']} ({report['num_blocks']} blocks x {report['block_nbytes'] / 1e6:.0f} MB,"
        f" {report['dtype']}), {report['world_size']} x {report['device']}, torch "
        f"{report['torch']}, {report['date']}; chunk {_listed(report['chunk_mb'])} MiB, "
        f"{_listed(report['num_slots'])} slots"
        + (
            f"; every block compiled (block.compile(), mode {report['compile']})"
            if report.get("compile")
            else ""
        ),
        "",
        f"Limits: pinned H2D {lim['h2d_pinned_alone_GBps']:.1f} GB/s alone, "
        f"{lim['h2d_pinned_concurrent_GBps']:.1f} GB/s per rank with all ranks copying; pageable "
        f"{lim['h2d_pageable_GBps']:.1f} GB/s; AllGather {lim['allgather_GBps']:.1f} GB/s.",
        "Per block: one pinned copy "
        + (f"{lim['h2d_ms_per_block']:.2f} ms" if lim.get("h2d_ms_per_block") else "-")
        + "; resident compute "
        + (
            ", ".join(
                f"{ms:.2f} ms at {t} tokens"
                for t, ms in lim.get("resident_ms_per_block", {}).items()
            )
            or "-"
        )
        + ".",
        "",
        *(
            [
                "**CPU platform: these timings are not meaningful** (no streams, nothing "
                "overlaps, every copy is a memcpy); they show that each method runs.",
                "",
            ]
            if report["device"] == "cpu"
            else []
        ),
        "| method | tokens | ms / forward | x resident | x H2D limit | x best peer | peak HBM GB |"
        " pinned host GB / rank | first forward s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v: Any, fmt: str = "{:.3f}") -> str:
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    for r in report["results"]:
        name = label(r)
        if r["method"] in AUTO_METHODS:
            vs = r.get("x_best_manual")
            versus = f"x{f(vs)} best manual" if vs is not None else "no manual row"
            name += f" ({r['transfer']}, {r['num_slots']} slots, {versus})"
        lines.append(
            f"| {name} | {r['tokens']} | {r['median_ms']:.1f} | {f(r['x_resident'])} | "
            f"{f(r['x_h2d_limit'])} | {f(r['x_best_peer'])} | "
            f"{r['peak_device_nbytes'] / GB:.2f} | {_pinned_gb(r)} | "
            f"{f(_seconds(r.get('first_forward_ms')), '{:.2f}')} |"
        )
    lines += markdown_disk(report)
    if report.get("swap"):
        lines += ["", "| swap component | MB | load ms | x H2D limit |", "|---|---|---|---|"]
        for r in report["swap"]:
            lines.append(
                f"| {r['component']} | {r['nbytes'] / 1e6:.1f} | {r['load_ms']:.2f} | "
                f"{f(r['x_h2d_limit'])} |"
            )
    return "\n".join(lines)


def _pinned_gb(row: dict[str, Any]) -> str:
    """dlo's pinned bytes per rank; "-" for methods whose host memory dlo does not manage."""
    nbytes = row.get("host_pinned_nbytes")
    return f"{nbytes / GB:.2f}" if nbytes is not None else "-"


def plot(report: dict[str, Any], path: str) -> None:
    """Time per forward vs tokens for each method, and peak device memory per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = sorted({label(r) for r in report["results"]})
    for m in methods:
        rows = sorted((r for r in report["results"] if label(r) == m), key=lambda r: r["tokens"])
        ax_t.plot([r["tokens"] for r in rows], [r["median_ms"] for r in rows], marker="o", label=m)
    # one dashed line per distinct limit (rank-local rows move every byte, AllGather 1/G)
    limits: dict[float, list[str]] = {}
    for r in report["results"]:
        if r.get("h2d_limit_ms"):
            names = limits.setdefault(round(r["h2d_limit_ms"], 3), [])
            if r["method"] not in names:
                names.append(r["method"])
    tokens = sorted({r["tokens"] for r in report["results"]})
    for ms, names in sorted(limits.items()):
        ax_t.hlines(
            ms,
            min(tokens),
            max(tokens),
            colors="gray",
            linestyles="dashed",
            label=f"H2D limit of {', '.join(names)}",
        )
    ax_t.set_xlabel("tokens")
    ax_t.set_ylabel("ms / forward (median)")
    ax_t.set_xscale("log", base=2)
    ax_t.legend(fontsize=8)
    peaks = [
        max(r["peak_device_nbytes"] for r in report["results"] if label(r) == m) / GB
        for m in methods
    ]
    ax_m.barh(methods, peaks)
    ax_m.set_xlabel("peak device memory, GB")
    fig.suptitle(
        f"{report['preset']} on {report['world_size']} x {report['device']}, "
        f"torch {report['torch']}, {report['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: str, report: dict[str, Any]) -> None:
    """Replace ``path`` with ``report`` in one step (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=2)
    os.replace(tmp, path)


def _seconds(ms: float | None) -> float | None:
    return ms / 1e3 if ms is not None else None


def per_call(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows whose ``keys`` count since the first call, each given its own call's share."""
    prev = dict.fromkeys(keys, 0)
    out = []
    for r in rows:
        r = dict(r)
        for k in keys:
            if k in r:
                r[k], prev[k] = r[k] - prev[k], r[k]
        out.append(r)
    return out
