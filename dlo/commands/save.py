"""``dlo save-checkpoint``: the embedded pipeline's weights as safetensors, for ``dlo run
--checkpoint`` and :func:`dlo.load_pipeline`."""

from __future__ import annotations

import argparse
import math
import time

import torch

from dlo.commands.args import DTYPES, PRESET_HELP


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The flags of ``dlo save-checkpoint``."""
    s.add_argument("--preset", default="tiny", help=PRESET_HELP)
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype")
    s.add_argument("--seed", type=int, default=0, help="weight seed")
    s.add_argument("--shard-gb", type=float, default=4.0, help="the most GiB per safetensors file")


def save(args: argparse.Namespace) -> int:
    """``dlo save-checkpoint``: the embedded pipeline's weights as safetensors."""
    from dlo.io.checkpoint import save_checkpoint
    from dlo.models import build_pipeline

    if not math.isfinite(args.shard_gb) or args.shard_gb <= 0:
        raise ValueError(f"--shard-gb={args.shard_gb} must be a finite number > 0")
    t0 = time.perf_counter()
    pipe = build_pipeline(args.preset, dtype=getattr(torch, args.dtype), seed=args.seed)
    path = save_checkpoint(pipe, args.out, max_shard_nbytes=int(args.shard_gb * (1 << 30)))
    nbytes = sum(t.numel() * t.element_size() for t in pipe.state_dict().values())
    print(
        f"dlo save-checkpoint: {nbytes / (1 << 30):.2f} GiB -> {path} in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    return 0
