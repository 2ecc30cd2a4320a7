"""``dlo bench --methods dlo-disk``: the preset's DiT streamed from disk under a host budget
(issue 37), against the disk limit.

The DiT is saved as safetensors into a temporary folder under ``--disk-dir`` (the disk to
measure: a tmpfs is memory, and its reads are then buffered, not O_DIRECT, which the row
says), the disk's rate is probed on that file the tier's way
(:func:`dlo.io.direct.read_bandwidth`), and :func:`dlo.load_pipeline` loads it with
``host_budget_gb=--host-budget-gb`` (every block streams: ``resident_layers=0``). Per token
count, the ``dlo-disk`` row and its ``disk-limit``: the bytes the tier read per forward over
the probed rate. One rank (the pipeline bench, ``python -m dlo.bench.pipeline_disk``, takes
real folders; AllGather's 1/N reads are tested, not benched, here). The folder is removed
after the row.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from dlo.bench.flags import int_list
from dlo.bench.methods import _build_dit, _clean, _peak, time_row
from dlo.config.offload import OffloadConfig
from dlo.io.direct import read_bandwidth
from dlo.io.writer import save_checkpoint
from dlo.pipelines.load import load_pipeline
from dlo.platform.device import Platform
from dlo.runtime.measure import GB

OPT_IN_METHODS = ("dlo-disk",)
"""Methods ``dlo bench`` runs only when ``--methods`` names them (they write to disk)."""


def bench_disk(
    preset: str,
    platform: Platform,
    dtype: torch.dtype,
    tokens_list: list[int],
    args: argparse.Namespace,
    record: Callable[[str, int, dict[str, float], dict[str, Any]], None],
    limits: dict[str, Any],
) -> None:
    """The ``dlo-disk`` rows (see the module docstring); the probe goes into ``limits``."""
    folder = tempfile.mkdtemp(prefix="dlo-bench-disk-", dir=args.disk_dir)
    try:
        path = save_checkpoint(_build_dit(preset, "cpu", dtype), folder)
        bps, direct = read_bandwidth(path)
        limits.update(disk_GBps=bps / GB, disk_direct=direct, disk_file=str(path))
        cfg = OffloadConfig(
            mode="layer",
            transfer="rank-local",
            resident_layers=0,
            num_slots=int_list("--num-slots", args.num_slots)[0],  # the row runs one setting
            host_budget_gb=args.host_budget_gb,
        )
        dit, backend = load_pipeline(
            lambda: _build_dit(preset, "meta", dtype), folder, cfg, device=platform.device
        )
        assert backend is not None
        try:
            for tokens in tokens_list:
                st0 = backend.stats()
                t = time_row(
                    dit, preset, tokens, platform, dtype, args, f"dlo-disk tokens={tokens}"
                )
                st = backend.stats()
                fwds = t["forwards"]
                disk = (st["disk_read_nbytes"] - st0["disk_read_nbytes"]) / fwds
                record(
                    "dlo-disk",
                    tokens,
                    t,
                    {
                        "disk_nbytes_per_fwd": disk,
                        "disk_limit_ms": disk / bps * 1e3 if bps else None,
                        "peak_device_nbytes": _peak(platform, st),
                        "host_pinned_nbytes": st["host_pinned_nbytes"],
                        "host_region_nbytes": st["host_region_nbytes"],
                        "num_disk_blocks": st["num_disk_blocks"],
                        "disk_direct": st["disk_direct"],
                        "host_budget_gb": args.host_budget_gb,
                    },
                )
        finally:
            backend.disable()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        _clean(platform)


def markdown_disk(report: dict[str, Any]) -> list[str]:
    """The ``dlo-disk`` rows and their disk-limit rows, as lines of the bench's markdown."""
    rows = [r for r in report["results"] if r["method"] == "dlo-disk"]
    lim = report["limits"]
    if not rows:
        return []
    how = "O_DIRECT" if lim.get("disk_direct") else "buffered (no O_DIRECT: tmpfs?)"
    lines = [
        "",
        f"Disk: {lim['disk_GBps']:.2f} GB/s ({how}, {lim['disk_file']}).",
        "",
        "| method | tokens | host budget GiB | ms / forward | disk MB / forward | x disk limit |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        limit = r.get("disk_limit_ms")
        ratio = f"{r['median_ms'] / limit:.3f}" if limit else "-"
        lines.append(
            f"| dlo-disk | {r['tokens']} | {r['host_budget_gb']:g} | {r['median_ms']:.1f} | "
            f"{r['disk_nbytes_per_fwd'] / 1e6:.1f} | {ratio} |"
        )
        if limit:
            lines.append(f"| disk-limit | {r['tokens']} | | {limit:.1f} | | |")
    return lines
