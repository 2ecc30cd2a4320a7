"""The peers of ``dlo run --pipeline`` on the same folder, one method per process (so each
cold start is its own): ``python -m dlo.bench.pipeline_peers DIR --method M``.

- ``resident``: ``DiffusionPipeline.from_pretrained(DIR, torch_dtype)`` then ``.to(device)``.
- ``diffusers-group``: the same load, the DiT(s) under diffusers group offloading (block
  level, one block per group, streams, ``record_stream=True``: its fastest documented
  setting), every other component on the device.

The call, its timing (first DiT forward, every step's end) and the report's keys are
``dlo run --pipeline``'s (:mod:`dlo.commands.run_pipeline`), so the rows compare directly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from dlo.bench.peers import apply_diffusers_group
from dlo.commands.args import DTYPES
from dlo.commands.pipeline_calls import call_kwargs, diffusers_load, dits_of, step_times, timed_call
from dlo.platform.device import default_device, get_platform
from dlo.platform.env import process_peak_rss_bytes

METHODS = ("resident", "diffusers-group")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dlo.bench.pipeline_peers")
    p.add_argument("pipeline", help="the diffusers pipeline folder")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", action="append", default=None)
    p.add_argument("--negative-prompt", default=None)
    for flag in ("--height", "--width", "--frames", "--max-sequence-length"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--device", default=None)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One method on the folder; the report of ``dlo run --pipeline --json`` (its keys)."""
    device = torch.device(args.device) if args.device else default_device()
    platform = get_platform(device)
    t0 = time.perf_counter()
    pipe = diffusers_load(args.pipeline, getattr(torch, args.dtype))
    dits = {id(m) for m in dits_of(pipe)}
    for module in pipe.components.values():
        if not isinstance(module, torch.nn.Module):
            continue
        if args.method == "diffusers-group" and id(module) in dits:
            apply_diffusers_group(module, device, record_stream=True)
        else:
            module.to(device)
    platform.synchronize()
    load_s = time.perf_counter() - t0
    load_rss = process_peak_rss_bytes()
    pipe.set_progress_bar_config(disable=True)
    platform.reset_peak_memory_stats()
    images, marks, wall = timed_call(pipe, call_kwargs(args, pipe, 0, device), platform)
    return {
        "method": args.method,
        "pipeline": args.pipeline,
        "class": type(pipe).__name__,
        "steps": args.steps,
        **step_times(marks),
        "load_s": load_s,
        "wall_s": wall,
        "load_peak_rss_nbytes": load_rss,
        "peak_rss_nbytes": process_peak_rss_bytes(),
        "hbm_peak_nbytes": platform.max_memory_allocated(),
        "output_finite": bool(torch.isfinite(images.float()).all()),
    }


def main(argv: list[str] | None = None) -> int:
    report = run(parse(argv))
    print(json.dumps([report], indent=2))
    return 0 if report["output_finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
