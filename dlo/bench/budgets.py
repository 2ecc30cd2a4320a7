"""``dlo bench --like NAME --budgets 24,32,48``: one set of rows per device budget, every method
under the same cap on the device allocator, as on a device of that size (issue 35 item 5).

Per budget and token count:

- ``resident``: the model on the device, where it fits the budget (else the row says so);
- ``dlo``: dlo with no settings but ``device_budget_gb`` (the automatic defaults);
- ``dlo-best``: the fastest manual setting of a sweep over ``resident_layers`` (0, the policy's
  count and its neighbours, quarters of the blocks), ``num_slots`` (2, 3) and the codecs of
  ``--codec``, each enabled with that setting alone;
- ``diffusers-group``: diffusers group offloading at block level on streams (CUDA only).

The cap is :meth:`dlo.platform.device.Platform.cap_memory` (``set_per_process_memory_fraction``
on CUDA). The CPU has none: there the rows run uncapped (the report says ``"capped": false``)
and only dlo's own rows plan against the budget, so the CPU lane tests the plumbing, not the
numbers. A setting that runs out of memory under
the cap is a row that says so, never a crash. One build of the model serves every dlo row of
every budget (enable and disable give it back as it was); resident and diffusers rows take
their own. Outputs are compared bit for bit with one resident run made before any cap.
"""

from __future__ import annotations

import argparse
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dlo.backends.factory import enable_offload
from dlo.bench.like import LIKE, build, check_like_input, model_nbytes, time_rows
from dlo.bench.methods import METHODS, _clean, codec_list, manual_codecs
from dlo.bench.peers import apply_diffusers_group
from dlo.config.fields import GIB
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.errors import OffloadError
from dlo.plan.topology import resolve_offload_plan
from dlo.platform.device import Platform, get_platform

logger = logging.getLogger(__name__)

BUDGET_METHODS = ("resident", "dlo", "dlo-best", "diffusers-group")
"""The methods of a budget run (``dlo`` always runs: the sweep starts from its choice)."""

SWEEP_SLOTS = (2, 3)
"""The slot counts the manual sweep tries."""


def budget_list(text: str) -> list[float]:
    """``"24,32"`` -> ``[24.0, 32.0]``: GiB > 0, or a ValueError naming ``--budgets``."""
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or any(not (0 < v < 1e6) for v in values):
        raise ValueError(f"--budgets={text!r}: expected GiB > 0 separated by commas")
    return values


def one_budget(text: str) -> float:
    """``"24"`` -> ``24.0``: one budget in GiB (``--budget``), or a ValueError naming it."""
    budgets = budget_list(text)
    if len(budgets) != 1:
        raise ValueError(f"--budget={text!r}: expected one budget (GiB)")
    return budgets[0]


def sweep_counts(num_blocks: int, auto: int) -> list[int]:
    """The resident counts the manual sweep tries (pure): 0, every quarter of the blocks,
    and the policy's count with its neighbours, within ``[0, num_blocks]``."""
    grid = {0, num_blocks, auto - 1, auto, auto + 1}
    grid |= {num_blocks * q // 4 for q in range(1, 4)}
    return sorted(r for r in grid if 0 <= r <= num_blocks)


def run_budgets(
    args: argparse.Namespace,
    like: Any,
    platform: Platform,
    dtype: torch.dtype,
    tokens_list: list[int],
    methods: list[str],
) -> dict[str, Any]:
    """The rows of every budget in ``args.budgets`` (see the module docstring), and every
    setting the sweep tried (``sweep``)."""
    budgets = budget_list(args.budgets)
    reference: dict[int, torch.Tensor] = {}
    rows: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    capped: list[bool] = []
    ref_model = build(like, dtype)
    try:  # the outputs every row is compared with, before any cap
        ref_model.to(platform.device)
        time_rows(
            ref_model,
            None,
            "resident",
            like,
            platform,
            dtype,
            tokens_list,
            _one(args),
            reference,
            setup_s=0.0,
        )
    except torch.OutOfMemoryError:
        logger.warning("resident does not fit the device: rows are not compared bit for bit")
    del ref_model
    _clean(platform)
    model = build(like, dtype)  # every dlo row's
    nbytes = model_nbytes(model)
    for budget in budgets:
        undo = platform.cap_memory(int(budget * GIB))
        capped.append(undo is not None)
        try:
            rows += _budget_rows(
                args,
                like,
                platform,
                dtype,
                tokens_list,
                methods,
                model,
                nbytes,
                budget,
                reference,
                sweep,
            )
        finally:
            if undo is not None:
                undo()
            _clean(platform)
    return {"results": rows, "sweep": sweep, "capped": all(capped)}


def like_budgets(args: argparse.Namespace, tokens_list: list[int], methods: list[str]) -> dict:
    """The ``--like NAME --budgets ...`` run (:mod:`dlo.bench.budgets`): one report dict."""
    like = LIKE[args.like]
    budget_list(args.budgets)  # bad input fails before the model is built
    if args.methods == ",".join(METHODS):
        methods = list(BUDGET_METHODS)
    dtype = getattr(torch, args.dtype)
    check_like_input(like, dtype, tokens_list, methods, BUDGET_METHODS, "--budgets")
    platform = get_platform(None)
    report: dict[str, Any] = {"like": like.name, "class": like.cls, "dtype": args.dtype}
    report.update(run_budgets(args, like, platform, dtype, tokens_list, methods))
    return report


def _one(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with one untimed and one timed forward (the reference needs no timing)."""
    return argparse.Namespace(**{**vars(args), "warmup": 0, "reps": 1})


def _budget_rows(
    args: argparse.Namespace,
    like: Any,
    platform: Platform,
    dtype: torch.dtype,
    tokens_list: list[int],
    methods: list[str],
    model: nn.Module,
    nbytes: int,
    budget: float,
    reference: dict[int, torch.Tensor],
    sweep: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    timed = functools.partial(
        time_rows,
        like=like,
        platform=platform,
        dtype=dtype,
        tokens_list=tokens_list,
        args=args,
        reference=reference,
    )

    def tag(new: list[dict[str, Any]], method: str, **extra: Any) -> list[dict[str, Any]]:
        for r in new:
            r.update(method=method, budget_gb=budget, **extra)
        return new

    def failed(method: str, why: str, **extra: Any) -> list[dict[str, Any]]:
        logger.warning("budget %g GiB, %s: %s", budget, method, why)
        return [
            {"method": method, "budget_gb": budget, "tokens": t, "failed": why, **extra}
            for t in tokens_list
        ]

    def dlo_rows(cfg: OffloadConfig, method: str, **extra: Any) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        backend = None
        try:
            backend = enable_offload(model, cfg, device=platform.device)
            platform.synchronize()
            new = timed(
                model, backend, method, setup_s=time.perf_counter() - t0, codec=cfg.codec or "unset"
            )
            st = backend.stats() if backend is not None else {}
            split = {k: st.get(k, 0) for k in ("num_resident_blocks", "num_streamed_blocks")}
            return tag(new, method, num_slots=st.get("num_slots", 0), **split, **extra)
        except (torch.OutOfMemoryError, ValueError, OffloadError) as e:  # a budget refused,
            # or a probe or allocation of enable ran out under the cap
            return failed(method, f"{type(e).__name__}: {str(e)[:200]}", **extra)
        finally:
            if backend is not None:
                backend.disable()
            _clean(platform)

    def whole_rows(method: str, place: Callable[[nn.Module], Any]) -> list[dict[str, Any]]:
        """A fresh build of the model, set up by ``place`` (resident, diffusers)."""
        whole = build(like, dtype)
        try:
            place(whole)
            return tag(timed(whole, None, method, setup_s=0.0), method)
        except torch.OutOfMemoryError as e:
            return failed(method, f"OutOfMemoryError: {str(e)[:200]}")
        finally:
            del whole
            _clean(platform)

    if "resident" in methods:
        if nbytes > budget * GIB:
            rows += failed("resident", f"the weights ({nbytes / GIB:.2f} GiB) exceed the budget")
        else:
            rows += whole_rows("resident", lambda m: m.to(platform.device))
    auto = dlo_rows(OffloadConfig(device_budget_gb=budget), "dlo")
    rows += auto
    if "dlo-best" in methods:
        n = len(resolve_offload_plan(model, OffloadConfig(), ParallelConfig()).all_block_paths)
        # the blocks the dlo row kept on the device (its pins too); 0 where it failed
        r_auto = auto[0].get("num_resident_blocks", 0) + auto[0].get("num_pinned_blocks", 0)
        tried: list[dict[str, Any]] = []
        for codec in manual_codecs(codec_list(getattr(args, "codec", "none"))):
            for r in sweep_counts(n, r_auto):
                for slots in SWEEP_SLOTS:
                    cfg = OffloadConfig(resident_layers=r, num_slots=slots, codec=codec)
                    tried += dlo_rows(cfg, "dlo-sweep", setting=f"r={r} s={slots} {codec}")
        for tokens in tokens_list:
            ok = [t for t in tried if t["tokens"] == tokens and "failed" not in t]
            if ok:
                best = dict(min(ok, key=lambda t: t["median_ms"]))
                best["method"], best["swept"] = "dlo-best", len(ok)
                rows.append(best)
        sweep += tried
    if "diffusers-group" in methods and platform.has_streams:
        rows += whole_rows(
            "diffusers-group",
            lambda m: apply_diffusers_group(m, platform.device, record_stream=True),
        )
    return rows


def block_split(r: dict[str, Any]) -> str:
    """A row's ``resident / streamed (n pinned)`` blocks, ``-`` where it has none."""
    if "num_resident_blocks" not in r:
        return "-"
    return (
        f"{r['num_resident_blocks']} / {r['num_streamed_blocks']}"
        f" ({r.get('num_pinned_blocks', 0)} pinned)"
    )


def markdown_budgets(rows: list[dict[str, Any]], *, capped: bool = True) -> str:
    """The budget rows as one markdown table: steady ms per method, and dlo against the best
    manual setting."""
    lines = (
        []
        if capped
        else [
            "No allocator cap on this platform: only dlo's rows plan "
            "against the budget; the others may exceed it.",
            "",
        ]
    )
    lines += [
        "| budget GiB | tokens | method | median ms | peak HBM GB | resident / streamed | "
        "setting | bitwise vs resident |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(
                f"| {r['budget_gb']:g} | {r['tokens']} | {r['method']} | - | - | - | "
                f"{r['failed']} | - |"
            )
            continue
        split = block_split(r)
        lines.append(
            f"| {r['budget_gb']:g} | {r['tokens']} | {r['method']} | {r['median_ms']:.1f} | "
            f"{r['peak_device_nbytes'] / 1e9:.2f} | {split} | {r.get('setting', '-')} | "
            f"{r.get('bitwise_vs_resident', '-')} |"
        )
    best = {
        (r["budget_gb"], r["tokens"]): r["median_ms"]
        for r in rows
        if r["method"] == "dlo-best" and "failed" not in r
    }
    for r in rows:
        key = (r.get("budget_gb"), r.get("tokens"))
        if r["method"] == "dlo" and "failed" not in r and key in best:
            lines.append(
                f"\ndlo (no flags) at {key[0]:g} GiB, {key[1]} tokens: "
                f"{r['median_ms'] / best[key]:.3f}x the best manual setting"
            )
    return "\n".join(lines)
