"""A pipeline folder with a step cache attached, under one device budget (issue 36's GPU
targets): ``python -m dlo.bench.pipeline_caches DIR --budget 24 --size 480x832x1 --steps 20
--thresholds 0.02,0.05,0.1,0.2,0.4 --min-skip 0.4``.

In one process, in this order:

1. ``resident``, no cache: the DiT's steps with nothing skipped;
2. ``resident`` with diffusers' FirstBlockCache at the ``--thresholds`` values in increasing
   order, every block's calls and runs counted, until one skips at least ``--min-skip`` of the
   block calls (the largest doubled up to :data:`EXTEND` times where none does): that one
   is the threshold every later row uses, and its outputs are the reference the later rows
   are compared with bit for bit (the largest tried where none reaches it);
3. ``dlo``: ``OffloadConfig(device_budget_gb=B)`` with the same cache enabled on the DiT
   before dlo (dlo re-applies it around its hooks: [Note: loads inside step caches]), under
   the device cap of ``--budget``;
4. ``diffusers-group``: the folder under ``enable_group_offload`` (block level, streams), the
   same cache added after it, under the same cap (after dlo: an out-of-memory failure of
   its left the device's memory to be collected while dlo's enable measured its room, on
   the H100 of 2026-12-07).

A ``--size`` given twice (``480x832x1,480x832x1``) runs a second call on the same enable:
the steady request of a server, after the first call's re-plan. Each dlo row records what
the process held on the device at its enable and how many blocks enable pinned.

Issue 36's bound, per call: ``max(compute, transfer)``, where compute is the resident call
with the cache (its denoise: first DiT forward to the last step's end; the counting hooks of
step 2 are off by then, as they are for group offloading and dlo) and transfer is the bytes
of the blocks that ran and had to load: the bytes dlo copied host to device from the call's
first DiT forward to its end, less those of the loads the cache made useless
(``wasted_nbytes``: prefetches of blocks it then skipped), over the pinned H2D rate measured
here.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from dlo.bench.budgets import one_budget
from dlo.bench.flags import add_call_arguments, method_list
from dlo.bench.methods import _clean
from dlo.bench.pipeline_budgets import Bench, _capped, _group_rows, bench_main, save
from dlo.bench.report import per_call
from dlo.commands.pipeline_calls import dits_of, resident_reference
from dlo.config.fields import GIB
from dlo.config.offload import OffloadConfig
from dlo.runtime.measure import GB, h2d_bandwidth

METHODS = ("resident", "diffusers-group", "dlo")
BLOCK_LISTS = ("blocks", "transformer_blocks", "single_transformer_blocks")
"""The DiT children whose blocks diffusers' step caches hook (and this bench counts)."""
RUNS_HOOK = "dlo.bench.runs"
H2D_PROBE_NBYTES = 256 << 20

_DLO_COUNTS = (
    "num_resident_blocks",
    "num_pinned_blocks",
    "num_streamed_blocks",
    "num_slots",
    "h2d_nbytes",
    "num_loads",
    "num_wasted_loads",
    "num_skipped_blocks",
    "num_cache_inner_blocks",
    "denoise_h2d_nbytes",
    "denoise_wasted_nbytes",
)
_CUMULATIVE = ("h2d_nbytes", "num_loads", "num_wasted_loads", "num_skipped_blocks")
"""dlo's counts that add up since enable: each row gets its own call's share."""
_RUN_COUNTS = ("block_calls", "block_runs")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dlo.bench.pipeline_caches")
    p.add_argument("pipeline", help="the diffusers pipeline folder")
    p.add_argument("--budget", required=True, help="the device budget (GiB) of the offloaded rows")
    p.add_argument(
        "--thresholds",
        default="0.02,0.05,0.1,0.2,0.4",
        help="FirstBlockCache thresholds tried on the resident pipeline, comma-separated",
    )
    p.add_argument(
        "--min-skip",
        type=float,
        default=0.4,
        help="the share of block calls the chosen threshold must skip (0 to 1)",
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    add_call_arguments(p)
    return p.parse_args(argv)


def thresholds(text: str) -> list[float]:
    """``"0.05,0.1"`` -> ``[0.05, 0.1]``, sorted; a clear error naming the flag otherwise."""
    try:
        values = sorted(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--thresholds={text!r}: expected positive numbers separated by commas")
    return values


EXTEND = 3
"""Doublings of the largest threshold tried where none skips ``--min-skip`` (random weights
skip little: issue 36's first GPU rows skipped nothing up to 0.4)."""


def sweep(
    values: list[float], min_skip: float, measure: Callable[[float], float], extend: int = EXTEND
) -> dict[float, float]:
    """``measure(t)`` (the share of block calls skipped at threshold ``t``) for ``values`` in
    increasing order until one skips at least ``min_skip`` (no larger one is run: each is a
    whole pipeline call); where none does, the largest doubled up to ``extend`` times."""
    skip: dict[float, float] = {}
    todo = sorted(values)
    while todo:
        t = todo.pop(0)
        skip[t] = measure(t)
        if skip[t] >= min_skip:
            break
        if not todo and extend > 0:
            todo, extend = [t * 2], extend - 1
    return skip


def cache_blocks(pipe: Any) -> list[torch.nn.Module]:
    """The blocks of the pipeline's DiTs that a step cache hooks."""
    out: list[torch.nn.Module] = []
    for dit in dits_of(pipe):
        for name in BLOCK_LISTS:
            blocks = getattr(dit, name, None)
            if isinstance(blocks, torch.nn.ModuleList):
                out += list(blocks)
    return out


def enable_cache(pipe: Any, threshold: float) -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    for dit in dits_of(pipe):
        dit.enable_cache(FirstBlockCacheConfig(threshold=threshold))


def disable_cache(pipe: Any) -> None:
    for dit in dits_of(pipe):
        if getattr(dit, "is_cache_enabled", False):
            dit.disable_cache()


class BlockRuns:
    """Every cached block's calls (a torch pre-hook: a skipped call included) and runs (a
    diffusers hook registered before the cache's, so the cache wraps it and a skip never
    reaches it). Attach before the cache is enabled; ``remove`` takes both off."""

    def __init__(self, pipe: Any) -> None:
        from diffusers.hooks import HookRegistry, ModelHook

        counter = self

        class _Run(ModelHook):
            def pre_forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
                counter.runs += 1
                return args, kwargs

        self.calls = self.runs = 0
        self.blocks = cache_blocks(pipe)
        self.handles = [b.register_forward_pre_hook(self._called) for b in self.blocks]
        for b in self.blocks:
            HookRegistry.check_if_exists_or_initialize(b).register_hook(_Run(), RUNS_HOOK)

    def _called(self, *_: Any) -> None:
        self.calls += 1

    def stats(self) -> dict[str, Any]:
        return {"block_calls": self.calls, "block_runs": self.runs}

    def remove(self) -> None:
        from diffusers.hooks import HookRegistry

        for h in self.handles:
            h.remove()
        for b in self.blocks:
            HookRegistry.check_if_exists_or_initialize(b).remove_hook(RUNS_HOOK, recurse=False)


class DenoiseTransfer:
    """dlo's stats, with ``denoise_h2d_nbytes`` (the bytes copied host to device from a
    call's first DiT forward to the call's end) and ``denoise_wasted_nbytes`` (of those, the
    loads evicted before their block ran), read when the row reads the stats."""

    def __init__(self, pipe: Any, backend: Any) -> None:
        self.backend = backend
        self.armed, self.at_first = True, {"h2d_nbytes": 0, "wasted_nbytes": 0}
        self.handle = dits_of(pipe)[0].register_forward_pre_hook(self._first)

    def _first(self, *_: Any) -> None:
        if self.armed:
            st = self.backend.stats()
            self.armed, self.at_first = False, {k: st[k] for k in self.at_first}

    def stats(self) -> dict[str, Any]:
        st = self.backend.stats()
        self.armed = True
        return {
            **st,
            "denoise_h2d_nbytes": st["h2d_nbytes"] - self.at_first["h2d_nbytes"],
            "denoise_wasted_nbytes": st["wasted_nbytes"] - self.at_first["wasted_nbytes"],
        }


def resident_rows(b: Bench, args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """The resident rows (no cache, then each threshold), and the threshold chosen."""
    ref = resident_reference(args.pipeline, b.dtype, b.device)
    rows = [{**r, "threshold": None} for r in b.rows_of("resident", None, ref, dict)]
    runs = BlockRuns(ref)
    try:
        measure = functools.partial(_skipped_at, b, ref, runs, rows)
        skip = sweep(thresholds(args.thresholds), args.min_skip, measure)
        del measure  # it holds the pipeline, which goes below
    finally:
        runs.remove()
    met = [t for t, s in skip.items() if s >= args.min_skip]
    chosen = min(met) if met else max(skip)
    enable_cache(ref, chosen)  # a fresh cache, no counting hooks: the compute term
    try:
        new = b.rows_of("resident", None, ref, dict)
    finally:
        disable_cache(ref)
        del ref
        _clean(b.platform)
    rows += [{**r, "threshold": chosen, "min_skip_met": bool(met)} for r in new]
    return rows, chosen


def _skipped_at(
    b: Bench, pipe: Any, runs: BlockRuns, rows: list[dict[str, Any]], t: float
) -> float:
    """One ``resident-sweep`` row per call at threshold ``t`` (appended to ``rows``); the
    share of block calls the cache skipped."""
    runs.calls = runs.runs = 0
    enable_cache(pipe, t)
    try:
        new = b.rows_of("resident-sweep", None, pipe, runs.stats, _RUN_COUNTS)
    finally:
        disable_cache(pipe)
    for r in new:  # compared with the uncached reference: meaningless here
        r.pop("bitwise_vs_resident", None), r.pop("output_bitwise_vs_resident", None)
    rows += [{**r, "threshold": t} for r in per_call(new, _RUN_COUNTS)]
    return 1 - runs.runs / runs.calls if runs.calls else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    budget = one_budget(args.budget)
    if not 0 <= args.min_skip <= 1:
        raise ValueError(f"--min-skip={args.min_skip!r}: expected a share from 0 to 1")
    methods = method_list(args.methods, METHODS)
    thresholds(args.thresholds)  # bad input fails before any work
    b = Bench(args)
    h2d = h2d_bandwidth(b.platform, H2D_PROBE_NBYTES, pinned=True)
    rows, chosen = resident_rows(b, args)

    def report() -> dict[str, Any]:
        return {
            **b.header(),
            "budget_gb": budget,
            "threshold": chosen,
            "h2d_pinned_GBps": h2d / GB,
            "results": rows,
        }

    if "dlo" in methods:
        pipe = resident_reference(args.pipeline, b.dtype, torch.device("cpu"))
        enable_cache(pipe, chosen)  # before enable: dlo takes it off and puts it back around it
        ok, undo = _capped(b.platform, budget)
        try:  # a failure under the cap becomes rows that say why (Bench.dlo_rows)
            new = b.dlo_rows(
                pipe,
                OffloadConfig(device_budget_gb=budget),
                "dlo",
                budget,
                _DLO_COUNTS,
                lambda p, backend: DenoiseTransfer(p, backend).stats,
            )
        finally:
            undo()
            disable_cache(pipe)
            del pipe  # its host copy, before group offloading loads and pins its own
            _clean(b.platform)
        rows += [{**r, "threshold": chosen, "capped": ok} for r in per_call(new, _CUMULATIVE)]
    save(args.json, report())
    if "diffusers-group" in methods:

        def with_cache(pipe: Any) -> Any:
            enable_cache(pipe, chosen)
            return dict

        new = _group_rows(b, [budget], with_cache)
        rows += [{**r, "threshold": chosen} for r in new]
    save(args.json, report())
    return report()


def markdown(report: dict[str, Any]) -> str:
    """The rows as one table, and dlo against issue 36's bound and against group offloading."""
    lines = [
        f"FirstBlockCache threshold {report['threshold']:g}; pinned H2D "
        f"{report['h2d_pinned_GBps']:.1f} GB/s; budget {report['budget_gb']:g} GiB.",
        "",
        "| call | method | threshold | steady step ms | first step ms | denoise ms | "
        "blocks skipped | loads (wasted) | GB loaded in denoise | peak HBM GiB | bitwise |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = report["results"]
    for r in rows:
        t = "-" if r.get("threshold") is None else f"{r['threshold']:g}"
        if "failed" in r:
            lines.append(f"| {r['size']} | {r['method']} | {t} | {r['failed']} |" + " |" * 7)
            continue
        lines.append(
            f"| {r['size']} | {r['method']} | {t} | {r['step_ms_median']:.1f} | "
            f"{r['first_step_ms']:.1f} | {sum(r['step_ms']):.1f} | {_skipped(r)} | "
            f"{_loads(r)} | {_gb(r)} | {r['hbm_peak_nbytes'] / GIB:.2f} | "
            f"{r.get('bitwise_vs_resident', '-')} |"
        )
    compute = _denoise(rows, "resident", report["threshold"])
    group = _denoise(rows, "diffusers-group", report["threshold"])
    dlo = [r for r in rows if r["method"] == "dlo"]  # call i is the i-th row
    for i, r in enumerate(dlo):
        if "failed" in r or i >= len(compute):
            continue
        ran = r["denoise_h2d_nbytes"] - r["denoise_wasted_nbytes"]  # the blocks that ran
        transfer = ran / (report["h2d_pinned_GBps"] * GB) * 1e3
        bound = max(compute[i], transfer)
        dlo_ms = sum(r["step_ms"])
        lines.append(
            f"\ndlo with the cache, call {i + 1} ({r['size']}): {dlo_ms:.0f} ms denoise = "
            f"{dlo_ms / bound:.3f}x max(compute {compute[i]:.0f} ms, transfer {transfer:.0f} ms)"
            + (
                f"; {dlo_ms / group[i]:.3f}x diffusers group offloading with the cache"
                if i < len(group)
                else ""
            )
            + f" (at enable: {r.get('pinned_at_enable')} blocks pinned, "
            f"{r.get('held_at_enable_nbytes', 0) / GIB:.2f} GiB held)"
        )
    return "\n".join(lines)


def _skipped(r: dict[str, Any]) -> str:
    if r.get("block_calls"):
        return f"{1 - r['block_runs'] / r['block_calls']:.0%} of {r['block_calls']}"
    if r.get("num_skipped_blocks") is not None and r["method"] == "dlo":
        return f"{r['num_skipped_blocks']} streamed"
    return "-"


def _loads(r: dict[str, Any]) -> str:
    return f"{r['num_loads']} ({r['num_wasted_loads']})" if "num_loads" in r else "-"


def _gb(r: dict[str, Any]) -> str:
    return f"{r['denoise_h2d_nbytes'] / GB:.1f}" if "denoise_h2d_nbytes" in r else "-"


def _denoise(rows: list[dict[str, Any]], method: str, threshold: float) -> list[float]:
    """``method``'s denoise ms of each call with the chosen cache, in call order, up to its
    first failed call."""
    out: list[float] = []
    for r in rows:
        if r["method"] != method or r.get("threshold") != threshold:
            continue
        if "failed" in r:
            break
        out.append(sum(r["step_ms"]))
    return out


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse, run, markdown)


if __name__ == "__main__":
    sys.exit(main())
