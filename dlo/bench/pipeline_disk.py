"""A pipeline folder streamed from disk under a host budget (issue 37's GPU targets):
``python -m dlo.bench.pipeline_disk DIR --host-budgets 8 --size 480x832x1 --size 480x832x81
--steps 4,2``.

In one process, in this order:

1. the disk: :func:`dlo.io.direct.read_bandwidth` on the folder's largest file holding DiT
   blocks, the disk tier's own reads (O_DIRECT where the filesystem allows it, the tier's
   reader threads and piece size), over ``--probe-gb``; and the pinned host-to-device rate;
2. ``resident`` (unless left out of ``--methods``): the folder through diffusers, every
   weight on the device: the compute term and the reference bits;
3. ``dlo-disk`` per ``--host-budgets`` value: :func:`dlo.load_pipeline` with
   ``OffloadConfig(host_budget_gb=H)`` (and ``device_budget_gb`` where ``--budget`` is
   given, else ``resident_layers=0``: every DiT block streams), the calls in order in one
   enable.

Issue 37's bound per step: ``max(compute, disk, H2D)``: compute is the resident steady
step; disk is the bytes the call read from the disk tier per step over the probed rate; H2D
is the bytes the call copied host to device per step over the pinned rate. The table's
``disk-limit`` row is the disk term alone; ``disk GB/s`` is the call's disk bytes over its
denoise time, beside the probe (the reads kept the disk busy when they are close).
Random weights are a proxy for speed only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dlo.bench.flags import add_call_arguments, method_list
from dlo.bench.methods import _clean
from dlo.bench.pipeline_budgets import FAILURES, Bench, bench_main, failure, save
from dlo.bench.report import per_call
from dlo.commands.pipeline_calls import resident_reference
from dlo.config.offload import OffloadConfig
from dlo.host.packer import READERS
from dlo.io.direct import read_bandwidth
from dlo.pipelines.load import load_pipeline
from dlo.runtime.measure import GB, h2d_bandwidth

METHODS = ("resident", "dlo-disk")
H2D_PROBE_NBYTES = 256 << 20
_COUNTS = (
    "num_disk_blocks",
    "num_disk_encoded_blocks",
    "encoded_h2d_nbytes",
    "disk_nbytes",
    "host_region_nbytes",
    "host_pinned_nbytes",
    "disk_direct",
    "disk_read_nbytes",
    "disk_read_ms",
    "disk_read_gbps",
    "num_read_ahead_waits",
    "read_ahead_wait_ms",
    "num_wasted_disk_reads",
    "h2d_nbytes",
    "num_streamed_blocks",
    "num_resident_blocks",
    "enable_peak_rss_nbytes",
)
_CUMULATIVE = (
    "disk_read_nbytes",
    "disk_read_ms",
    "h2d_nbytes",
    "encoded_h2d_nbytes",
    "num_read_ahead_waits",
)
"""Counts since enable: each row gets its own call's share."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dlo.bench.pipeline_disk")
    p.add_argument("pipeline", help="the diffusers pipeline folder (on the disk to measure)")
    p.add_argument(
        "--host-budgets", required=True, help="host budgets (GiB) of the dlo rows, comma-separated"
    )
    p.add_argument("--budget", type=float, default=None, help="device budget (GiB) of dlo rows")
    p.add_argument("--probe-gb", type=float, default=2.0, help="GB the disk probe reads")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    p.add_argument(
        "--codec",
        choices=("none", "ans"),
        default="none",
        help="the dlo rows' codec; 'ans' reads the disk blocks encoded from the encoded "
        "checkpoints beside the folder's weights (write them first: dlo run --pipeline DIR "
        "--codec ans --save-encoded)",
    )
    add_call_arguments(p)
    return p.parse_args(argv)


def host_budgets(text: str) -> list[float]:
    """``"8,16"`` -> ``[8.0, 16.0]``; an error naming ``--host-budgets`` otherwise."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(not v >= 0 for v in values):
        raise ValueError(f"--host-budgets={text!r}: expected GiB values >= 0, comma-separated")
    return values


def dit_file(folder: str) -> Path:
    """The largest safetensors file of the folder's DiT (``transformer``)."""
    files = sorted(Path(folder, "transformer").glob("*.safetensors"))
    files = files or sorted(Path(folder).rglob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors file to probe")
    return max(files, key=lambda f: f.stat().st_size)


def disk_rows(b: Bench, args: argparse.Namespace, host_gb: float) -> list[dict[str, Any]]:
    """The folder loaded by dlo under a host budget of ``host_gb``, its calls, disabled."""
    cfg = OffloadConfig(
        host_budget_gb=host_gb,
        codec=args.codec,
        **(
            {"device_budget_gb": args.budget} if args.budget is not None else {"resident_layers": 0}
        ),
    )
    backend = None
    t0 = time.perf_counter()
    try:
        pipe, backend = load_pipeline(args.pipeline, cfg, device=b.device, dtype=b.dtype)
        assert backend is not None
        load_s = time.perf_counter() - t0
        pipe.set_progress_bar_config(disable=True)
        rows = b.rows_of("dlo-disk", args.budget, pipe, backend.stats, _COUNTS)
    except FAILURES as e:
        return [{**r, "host_budget_gb": host_gb} for r in b.failed_rows("dlo-disk", None, e)]
    finally:
        if backend is not None:
            backend.disable()
        _clean(b.platform)
    return [
        {**r, "host_budget_gb": host_gb, "codec": args.codec, "load_s": load_s}
        for r in per_call(rows, _CUMULATIVE)
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    budgets = host_budgets(args.host_budgets)
    methods = method_list(args.methods, METHODS)
    b = Bench(args)
    probe = dit_file(args.pipeline)
    disk_bps, direct = read_bandwidth(probe, nbytes=int(args.probe_gb * 1e9), workers=READERS)
    h2d = h2d_bandwidth(b.platform, H2D_PROBE_NBYTES, pinned=True)
    rows: list[dict[str, Any]] = []

    def report() -> dict[str, Any]:
        return {
            **b.header(),
            "disk_probe": {"file": str(probe), "GBps": disk_bps / GB, "direct": direct},
            "disk_readers": READERS,
            "h2d_pinned_GBps": h2d / GB,
            "results": rows,
        }

    if "resident" in methods:
        try:
            ref = resident_reference(args.pipeline, b.dtype, b.device)
            rows += b.rows_of("resident", None, ref, dict)
            del ref
        except FAILURES as e:
            rows += [{"method": "resident", "failed": failure(e)}]
        _clean(b.platform)
    save(args.json, report())
    if "dlo-disk" in methods:
        for host_gb in budgets:
            rows += disk_rows(b, args, host_gb)
            save(args.json, report())
    return report()


def markdown(report: dict[str, Any]) -> str:
    """The rows, the disk-limit row per call, and dlo against ``max(compute, disk, H2D)``."""
    p = report["disk_probe"]
    disk_gbps, h2d_gbps = p["GBps"], report["h2d_pinned_GBps"]
    lines = [
        f"Disk probe: {disk_gbps:.2f} GB/s ({'O_DIRECT' if p['direct'] else 'buffered'}, "
        f"{report['disk_readers']} readers, {p['file']}); pinned H2D {h2d_gbps:.1f} GB/s.",
        "",
        "| call | method | host GiB | steady step ms | first step ms | disk GB per step | "
        "disk-limit ms | H2D-limit ms | disk GB/s in denoise | reader GB/s | waits | "
        "bitwise |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    compute: dict[str, float] = {}
    for r in report["results"]:
        if "failed" in r:
            lines.append(f"| {r.get('size', '-')} | {r['method']} | {r['failed']} |" + " |" * 9)
            continue
        if r["method"] == "resident":
            compute[r["size"]] = r["step_ms_median"]
            lines.append(
                f"| {r['size']} | resident | - | {r['step_ms_median']:.1f} | "
                f"{r['first_step_ms']:.1f} |" + " - |" * 6 + " - |"
            )
            continue
        steps = len(r["step_ms"])
        disk_gb = r["disk_read_nbytes"] / steps / GB
        disk_ms = disk_gb / disk_gbps * 1e3
        h2d_ms = r["h2d_nbytes"] / steps / GB / h2d_gbps * 1e3
        denoise_s = sum(r["step_ms"]) / 1e3
        lines.append(
            f"| {r['size']} | dlo-disk | {r['host_budget_gb']:g} | {r['step_ms_median']:.1f} | "
            f"{r['first_step_ms']:.1f} | {disk_gb:.2f} | {disk_ms:.1f} | {h2d_ms:.1f} | "
            f"{r['disk_read_nbytes'] / GB / denoise_s:.2f} | {r['disk_read_gbps']:.2f} | "
            f"{r['num_read_ahead_waits']} | {r.get('bitwise_vs_resident', '-')} |"
        )
        bound = max(compute.get(r["size"], 0.0), disk_ms, h2d_ms)
        lines.append(
            f"| {r['size']} | disk-limit | {r['host_budget_gb']:g} | {disk_ms:.1f} | |" + " |" * 7
        )
        r["bound_ms"], r["vs_bound"] = bound, r["step_ms_median"] / bound if bound else None
    for r in report["results"]:
        if r.get("vs_bound") is not None:
            lines.append(
                f"\ndlo-disk {r['size']} at {r['host_budget_gb']:g} GiB host: steady step "
                f"{r['step_ms_median']:.0f} ms = {r['vs_bound']:.3f}x max(compute "
                f"{compute.get(r['size'], float('nan')):.0f}, disk, H2D) = {r['bound_ms']:.0f} ms"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse, run, markdown)


if __name__ == "__main__":
    sys.exit(main())
