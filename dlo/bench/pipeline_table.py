"""The markdown of :mod:`dlo.bench.pipeline_budgets`' report: one table of every row (the
sweep's settings apart), and dlo against resident and against the best manual setting."""

from __future__ import annotations

from typing import Any

from dlo.bench.budgets import block_split
from dlo.config.fields import GIB


def markdown(report: dict[str, Any]) -> str:
    """The rows (sweep settings apart) as one markdown table, and dlo against the best."""
    lines = (
        []
        if report["capped"]
        else ["No allocator cap on this platform: only dlo's rows plan against the budget.", ""]
    )
    lines += [
        "| budget GiB | call | method | steady step ms | first step ms | peak HBM GiB "
        "(dlo rows: since enable) | "
        "resident / streamed | slots | encoders whole | setting | bitwise (DiT / "
        "decoded) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [r for r in report["results"] if r["method"] != "dlo-sweep"]
    for r in rows:
        budget = "none" if r["budget_gb"] is None else f"{r['budget_gb']:g}"
        if "failed" in r:
            lines.append(f"| {budget} | {r['size']} | {r['method']} | {r['failed']} |" + " |" * 7)
            continue
        split = block_split(r)
        lines.append(
            f"| {budget} | {r['size']} | {r['method']} | {r['step_ms_median']:.1f} | "
            f"{r['first_step_ms']:.1f} | {r['hbm_peak_nbytes'] / GIB:.2f} | {split} | "
            f"{r.get('num_slots', '-')} | {', '.join(r.get('kept_whole', [])) or '-'} | "
            f"{r.get('setting', '-')} | {r.get('bitwise_vs_resident', '-')} / "
            f"{r.get('output_bitwise_vs_resident', '-')} |"
        )
    best = _steady(rows, "dlo-best")
    resident = {  # the uncapped reference: dlo with nothing set is compared with it
        (None, r["size"]): r["step_ms_median"]
        for r in rows
        if r["method"] == "resident" and r["budget_gb"] is None and "failed" not in r
    }
    group = _steady(rows, "diffusers-group")
    for r in rows:
        key = (r["budget_gb"], r["size"])
        if r["method"] == "dlo" and "failed" not in r and key in group:
            lines.append(
                f"\ndlo (no flags) at {key[0]:g} GiB, {key[1]}: "
                f"{r['step_ms_median'] / group[key]:.3f}x diffusers group offloading"
            )
        if r["method"] == "dlo" and "failed" not in r and key in resident:
            lines.append(
                f"\ndlo with nothing set, {key[1]}: {r['step_ms_median'] / resident[key]:.3f}x "
                f"resident; first step {r['first_step_ms'] / r['step_ms_median']:.2f}x its steady"
            )
        if r["method"] == "dlo" and "failed" not in r and key in best:
            lines.append(
                f"\ndlo (no flags) at {key[0]:g} GiB, {key[1]}: {r['step_ms_median'] / best[key]:.3f}x"
                f" the best manual setting; first step {r['first_step_ms'] / r['step_ms_median']:.2f}x"
                " its steady step"
            )
    return "\n".join(lines)


def _steady(rows: list[dict[str, Any]], method: str) -> dict[tuple[Any, str], float]:
    """``method``'s steady step per (budget, call size), of the rows that ran."""
    return {
        (r["budget_gb"], r["size"]): r["step_ms_median"]
        for r in rows
        if r["method"] == method and "failed" not in r
    }
