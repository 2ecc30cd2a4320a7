"""A pipeline folder under device budgets, every method in one process (issue 35's table):
``python -m dlo.bench.pipeline_budgets DIR --budgets 24,32,48 --size 480x832x1 --size
480x832x81``.

Per budget, every method under the same cap on the device allocator
(:meth:`dlo.platform.device.Platform.cap_memory`), and per method the calls of ``--size``
in order, in one enable (so a later, larger call follows a smaller one as in a server):

- ``resident``: diffusers' own pipeline with every weight on the device, where it fits
  (else the row says why);
- ``dlo``: ``OffloadConfig(device_budget_gb=B)`` and nothing else (the automatic defaults:
  the policy's residency, slots and encoders, re-planned between forwards);
- ``dlo-best``: the fastest setting of a manual sweep over ``resident_layers``
  (``--sweep-counts``; ``auto`` is the blocks the ``dlo`` row held on the device, pinned
  ones included), ``num_slots`` (``--sweep-slots``), ``components`` (the DiTs alone, and
  with the encoders streamed: ``--sweep-components``) and ``--codec``, each its own enable
  with no budget (the cap alone says what runs), fastest per call size;
- ``diffusers-group``: the folder as diffusers loads it, under
  ``enable_group_offload`` (every model component at block level, one block per group, on
  streams with ``record_stream``: its fastest documented setting; the CPU has no streams).

Every output is compared bit for bit with one resident run made before any cap. The steady
step is the median of the steps after a call's first (:func:`dlo.commands.args.steady_median`);
the process is warm (the resident reference ran first), so the first step shows what a
method adds, not the process's first kernels. The CPU has no cap: there the rows run
uncapped (``"capped": false``) and only dlo's rows plan against the budget.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dlo.backends.factory import enable_offload
from dlo.bench.budgets import budget_list
from dlo.bench.flags import add_call_arguments, int_list, method_list, parse_size, sweep_list
from dlo.bench.methods import _clean, codec_list, manual_codecs
from dlo.bench.pipeline_table import markdown
from dlo.commands.pipeline_calls import (
    call_kwargs,
    diffusers_load,
    forward_marks,
    resident_reference,
    step_times,
    timed_call,
)
from dlo.config.fields import GIB
from dlo.config.offload import OffloadConfig
from dlo.errors import OffloadError
from dlo.platform.device import Platform, default_device, get_platform

logger = logging.getLogger(__name__)

METHODS = ("resident", "dlo", "dlo-best", "diffusers-group")
FAILURES = (torch.OutOfMemoryError, ValueError, OffloadError)
"""What a row may die of under a cap: it becomes a row that says so."""

_COUNTS = ("num_resident_blocks", "num_streamed_blocks", "num_pinned_blocks", "num_slots")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dlo.bench.pipeline_budgets")
    p.add_argument("pipeline", help="the diffusers pipeline folder")
    p.add_argument("--budgets", required=True, help="comma-separated device budgets (GiB)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--sweep-counts", default="grid", help="resident_layers of the sweep")
    p.add_argument("--sweep-slots", default="2,3", help="num_slots of the sweep")
    components = "components of the sweep, ';'-separated (dit: the encoders whole)"
    p.add_argument("--sweep-components", default="dit;dit,encoder", help=components)
    p.add_argument("--codec", default="none", help="codecs of the sweep, comma-separated")
    p.add_argument(
        "--unbudgeted", action="store_true", help="also a dlo row with nothing set, no budget"
    )
    p.add_argument("--forward-marks", action="store_true", help="diagnostic: each DiT forward's ms")
    add_call_arguments(p)
    return p.parse_args(argv)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits (NaNs included: random weights may make them)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The latents bit for bit where both calls handed them out, else the outputs."""
    if a["latents"] is not None and b["latents"] is not None:
        return bitwise_equal(a["latents"], b["latents"])
    return bitwise_equal(a["output"], b["output"])


def failure(e: BaseException) -> str:
    """A failed row's reason: the error and where it was raised (the innermost frames)."""
    frames = traceback.extract_tb(e.__traceback__)[-4:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(e).__name__}: {str(e)[:300]} [at {where}]"


class Bench:
    """One folder, its calls and its reference outputs (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device) if args.device else default_device()
        self.platform: Platform = get_platform(self.device)
        self.dtype = getattr(torch, args.dtype)
        self.sizes = [parse_size(s) for s in args.size]
        steps = int_list("--steps", args.steps)
        if len(steps) not in (1, len(self.sizes)):
            raise ValueError(f"--steps={args.steps!r}: one count, or one per --size")
        self.steps = steps * len(self.sizes) if len(steps) == 1 else steps
        self.expect: dict[int, dict[str, Any]] = {}

    def header(self) -> dict[str, Any]:
        """The fields every pipeline bench's report starts with."""
        return {
            "pipeline": self.args.pipeline,
            "device": str(self.device),
            "dtype": self.args.dtype,
            "sizes": [self.size_name(i) for i in range(len(self.sizes))],
            "steps": self.steps,
        }

    def size_name(self, i: int) -> str:
        h, w, f = self.sizes[i]
        return f"{h}x{w}" + (f"x{f}" if f is not None else "")

    def call(self, pipe: Any, i: int, *, reset: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """Call ``i`` on ``pipe``: its output and its last step's latents (on the CPU), and
        its timings and peak."""
        h, w, f = self.sizes[i]
        ns = argparse.Namespace(
            **{**vars(self.args), "height": h, "width": w, "frames": f, "steps": self.steps[i]}
        )
        kw = call_kwargs(ns, pipe, 0, self.device)
        kw["output_type"] = self.args.output_type
        if reset:  # not under dlo: its re-plans read the peak a call's decode left
            self.platform.reset_peak_memory_stats()
        latents: list[torch.Tensor] = []
        with forward_marks(pipe, self.platform, on=self.args.forward_marks) as fwd:
            out, marks, wall = timed_call(pipe, kw, self.platform, latents=latents)
        if self.args.output_type == "latent":  # the pipeline's latents, whatever it calls them
            out = out if isinstance(out, torch.Tensor) else torch.as_tensor(out)
        times = step_times(marks)
        times.pop("cold_start_s")
        result = {"output": out.cpu(), "latents": latents[0].cpu() if latents else None}
        return result, {
            **times,
            **({"forward_ms": [round((b - a) * 1e3, 1) for a, b in fwd]} if fwd else {}),
            "wall_s": wall,
            # resident: this call's; dlo: since its enable (the peak is never reset under it)
            "hbm_peak_nbytes": self.platform.max_memory_allocated(),
        }

    def rows_of(
        self,
        method: str,
        budget: float | None,
        pipe: Any,
        stats: Callable[[], dict[str, Any]],
        counts: tuple[str, ...] = _COUNTS,
    ) -> list[dict[str, Any]]:
        """Every call in order on ``pipe``; a call that fails ends the sequence (its row and
        the later ones say why). ``counts``: the keys of ``stats()`` each row records, read
        after its call."""
        rows: list[dict[str, Any]] = []
        for i in range(len(self.sizes)):
            row: dict[str, Any] = {"method": method, "budget_gb": budget, "size": self.size_name(i)}
            try:
                out, times = self.call(pipe, i, reset=method in ("resident", "diffusers-group"))
            except FAILURES as e:
                why = failure(e)
                rows += [{**row, "failed": why}] + [
                    {**row, "size": self.size_name(j), "failed": f"after: {why}"}
                    for j in range(i + 1, len(self.sizes))
                ]
                break
            if method == "resident" and budget is None:  # the reference, before any cap
                self.expect[i] = out
            row.update(times)
            ref = self.expect.get(i)
            # the DiTs' result (the latents where the pipeline hands them out): what dlo
            # computes; the decoded output too (a VAE's kernels may differ under a cap)
            row["bitwise_vs_resident"] = None if ref is None else same(out, ref)
            row["compared"] = "latents" if out["latents"] is not None else "output"
            row["output_bitwise_vs_resident"] = (
                None if ref is None else bitwise_equal(out["output"], ref["output"])
            )
            st = stats()
            row.update({k: st[k] for k in counts if k in st})
            if st.get("policy"):
                row["kept_whole"] = st["policy"].get("kept_whole", [])
                records = st["policy"].get("replans", [])  # this enable's, so far
                row["replans"] = len(records)
                row["replan_log"] = [  # a codec record (codec="auto") pins nothing
                    [r["forward"], r["action"], r.get("pinned"), r.get("ms")] for r in records
                ]
            rows.append(row)
        return rows

    def failed_rows(
        self, method: str, budget: float | None, e: BaseException
    ) -> list[dict[str, Any]]:
        """One row per call size saying why ``method`` could not run them (its setup failed)."""
        why = failure(e)
        return [
            {"method": method, "budget_gb": budget, "size": self.size_name(i), "failed": why}
            for i in range(len(self.sizes))
        ]

    def dlo_rows(
        self,
        pipe: Any,
        cfg: OffloadConfig,
        method: str,
        budget: float | None,
        counts: tuple[str, ...] = _COUNTS,
        setup: Callable[[Any, Any], Callable[[], dict[str, Any]]] | None = None,
        **extra: Any,
    ) -> list[dict[str, Any]]:
        """``pipe`` enabled with ``cfg``, its calls, then disabled (given back as it was).
        ``setup(pipe, backend)``, called after enable, returns the rows' ``stats`` (default:
        the backend's)."""
        backend = None
        enable_s: float | None = None
        _clean(self.platform)  # what an earlier method left would shrink the room enable sees
        held = self.platform.memory_allocated()
        pins: int | None = None
        t0 = time.perf_counter()
        try:
            backend = enable_offload(pipe, cfg, device=self.device)
            assert backend is not None  # a layer config always has one
            enable_s = time.perf_counter() - t0
            pins = backend.stats().get("num_pinned_blocks")
            stats = backend.stats if setup is None else setup(pipe, backend)
            new = self.rows_of(method, budget, pipe, stats, counts)
        except FAILURES as e:  # a budget refused, or enable ran out under the cap
            new = self.failed_rows(method, budget, e)
        finally:
            if backend is not None:
                backend.disable()
            _clean(self.platform)
        for r in new:
            r.update(enable_s=enable_s, held_at_enable_nbytes=held, pinned_at_enable=pins, **extra)
        return new


def _capped(platform: Platform, budget: float) -> tuple[bool, Callable[[], None]]:
    undo = platform.cap_memory(int(budget * GIB))
    return undo is not None, (undo if undo is not None else lambda: None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every method on the folder under every budget: the report (see the module docstring)."""
    budgets = budget_list(args.budgets)
    methods = method_list(args.methods, METHODS)
    codecs = manual_codecs(codec_list(args.codec))
    sweep_list(args.sweep_counts, 1, 0)  # bad input fails before any work
    int_list("--sweep-slots", args.sweep_slots)
    b = Bench(args)
    platform = b.platform
    rows: list[dict[str, Any]] = []
    capped: list[bool] = []
    ref = resident_reference(args.pipeline, b.dtype, b.device)  # before any cap
    rows += b.rows_of("resident", None, ref, dict)
    if "resident" in methods:
        for budget in budgets:
            _, undo = _capped(platform, budget)
            _clean(platform)  # cached blocks would escape the cap
            try:
                rows += b.rows_of("resident", budget, ref, dict)
            finally:
                undo()
    del ref
    _clean(platform)
    if "diffusers-group" in methods:
        rows += _group_rows(b, budgets)
    # the pipeline every dlo row enables, in host memory of its own (diffusers' tensors
    # alias the file, aligned only to their dtype: CPU kernels may then give other bits)
    pipe = resident_reference(args.pipeline, b.dtype, torch.device("cpu"))
    num_blocks, num_dits = _dit_blocks(pipe)

    def report() -> dict[str, Any]:
        return {
            **b.header(),
            "class": type(pipe).__name__,
            "capped": all(capped),
            "results": rows,
        }

    if args.unbudgeted:  # dlo with nothing set at all
        rows += b.dlo_rows(pipe, OffloadConfig(), "dlo", None)
    for budget in budgets:
        save(args.json, report())  # so far: a run cut short still leaves its rows
        ok, undo = _capped(platform, budget)
        capped.append(ok)
        try:
            auto = b.dlo_rows(pipe, OffloadConfig(device_budget_gb=budget), "dlo", budget)
            rows += auto
            if "dlo-best" in methods:
                held = (
                    r.get("num_resident_blocks", 0) + r.get("num_pinned_blocks", 0) for r in auto
                )
                # the blocks the dlo row held on the device (pins too), per DiT
                r_auto = max(held, default=0) // num_dits
                tried: list[dict[str, Any]] = []
                for components in args.sweep_components.split(";"):
                    comps = tuple(c for c in components.split(",") if c)
                    for codec in codecs:
                        for r in sweep_list(args.sweep_counts, num_blocks, r_auto):
                            for slots in int_list("--sweep-slots", args.sweep_slots):
                                cfg = OffloadConfig(
                                    components=comps or None,
                                    resident_layers=r,
                                    num_slots=slots,
                                    codec=codec,
                                )  # no budget: the cap alone says what runs
                                setting = f"r={r} s={slots} {codec} {components}"
                                tried += b.dlo_rows(pipe, cfg, "dlo-sweep", budget, setting=setting)
                rows += tried + _best(tried, b)
        finally:
            undo()
    save(args.json, report())
    return report()


def _group_rows(
    b: Bench,
    budgets: list[float],
    setup: Callable[[Any], Callable[[], dict[str, Any]]] = lambda pipe: dict,
    counts: tuple[str, ...] = _COUNTS,
) -> list[dict[str, Any]]:
    """diffusers group offloading under each budget, on a load of its own (its pinned host
    copies go before dlo's load). ``setup(pipe)``, called once group offloading is on, may
    add to the pipeline (a step cache) and returns the rows' ``stats``."""
    rows: list[dict[str, Any]] = []
    for budget in budgets:
        _, undo = _capped(b.platform, budget)
        pipe = None
        try:
            if b.platform.has_streams:  # diffusers pins a copy: the folder's tensors suffice
                pipe = diffusers_load(b.args.pipeline, b.dtype)
                pipe.set_progress_bar_config(disable=True)
            else:  # computed where they lie: own memory, as dlo's (aliases may give other bits)
                pipe = resident_reference(b.args.pipeline, b.dtype, torch.device("cpu"))
            t0 = time.perf_counter()
            pipe.enable_group_offload(
                b.device,
                offload_type="block_level",
                num_blocks_per_group=1,
                use_stream=b.platform.has_streams,
                record_stream=b.platform.has_streams,
            )
            enable_s = time.perf_counter() - t0
            new = b.rows_of("diffusers-group", budget, pipe, setup(pipe), counts)
        except FAILURES as e:
            new, enable_s = b.failed_rows("diffusers-group", budget, e), None
        finally:
            del pipe
            _clean(b.platform)
            _empty_host_cache()  # its pinned copies, before the next load
            undo()
        rows += [{**r, "enable_s": enable_s} for r in new]
    return rows


def _empty_host_cache() -> None:
    """Give the pinned blocks torch's host allocator caches back to the system (diffusers'
    pinned copies of a whole pipeline: dlo's load after it needs that memory)."""
    if not torch.cuda.is_available():
        return
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if empty is not None:
        empty()


def save(path: str | None, report: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(report, indent=2))


def _dit_blocks(pipe: Any) -> tuple[int, int]:
    """The blocks of the pipeline's first DiT (the sweep's resident counts are per DiT), and
    how many DiTs it has."""
    from dlo.config.parallel import ParallelConfig
    from dlo.plan.topology import resolve_offload_plan

    plan = resolve_offload_plan(pipe, OffloadConfig(components=("dit",)), ParallelConfig())
    first = plan.stacks[0].component_path
    dits = {s.component_path for s in plan.stacks}
    return sum(len(s.block_paths) for s in plan.stacks if s.component_path == first), len(dits)


def _best(tried: list[dict[str, Any]], b: Bench) -> list[dict[str, Any]]:
    """The fastest manual setting per call size (its steady step)."""
    out = []
    for i in range(len(b.sizes)):
        ok = [t for t in tried if t["size"] == b.size_name(i) and "failed" not in t]
        if ok:
            best = dict(min(ok, key=lambda t: t["step_ms_median"]))
            best["method"], best["swept"] = "dlo-best", len(ok)
            out.append(best)
    return out


def bench_main(
    argv: list[str] | None,
    parse: Callable[[list[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
) -> int:
    """A pipeline bench's ``main``: parse, run, write the markdown where asked, print it."""
    args = parse(argv)
    table = markdown(run(args))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse, run, markdown)


if __name__ == "__main__":
    sys.exit(main())
