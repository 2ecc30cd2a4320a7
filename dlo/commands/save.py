"""``dlo save-checkpoint``: the embedded pipeline's weights as safetensors, for ``dlo run
--checkpoint`` and :func:`dlo.load_pipeline`."""

from __future__ import annotations

import argparse
import functools
import logging
import math
import time
from pathlib import Path

import torch

from dlo.commands.args import DTYPES, PRESET_HELP


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The flags of ``dlo save-checkpoint``."""
    s.add_argument("--preset", default="tiny", help=PRESET_HELP)
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype")
    s.add_argument("--seed", type=int, default=0, help="weight seed")
    s.add_argument("--shard-gb", type=float, default=4.0, help="the most GiB per safetensors file")
    s.add_argument(
        "--codec",
        default="none",
        choices=("none", "ans"),
        help="also write the blocks encoded (dlo-encoded.safetensors beside the weights), so "
        "enables with codec='ans' read them instead of encoding; run where the job runs "
        "(nvCOMP's bitstream on a GPU, the reference codec's on a CPU)",
    )
    s.add_argument(
        "--chunk-mb", type=int, default=None, help="with --codec: the job's chunk_mb (default 64)"
    )


def save(args: argparse.Namespace) -> int:
    """``dlo save-checkpoint``: the embedded pipeline's weights as safetensors."""
    from dlo.io.files import check_writable_dir
    from dlo.io.writer import save_checkpoint
    from dlo.models import build_pipeline

    if not math.isfinite(args.shard_gb) or args.shard_gb <= 0:
        raise ValueError(f"--shard-gb={args.shard_gb} must be a finite number > 0")
    check_writable_dir(args.out, "--out")  # before the build
    t0 = time.perf_counter()
    pipe = build_pipeline(args.preset, dtype=getattr(torch, args.dtype), seed=args.seed)
    path = save_checkpoint(pipe, args.out, max_shard_nbytes=int(args.shard_gb * (1 << 30)))
    nbytes = sum(t.numel() * t.element_size() for t in pipe.state_dict().values())
    del pipe
    print(
        f"dlo save-checkpoint: {nbytes / (1 << 30):.2f} GiB -> {path} in "
        f"{time.perf_counter() - t0:.1f}s",
        flush=True,  # a log file sees it before the encode (stdout is buffered there)
    )
    if args.codec != "none":
        _save_encoded(args, path)
    return 0


def _save_encoded(args: argparse.Namespace, path: Path) -> None:
    """Load the checkpoint just written with ``codec`` on every stack, on this machine's
    device, and write the encoded blocks beside it (see [Note: encoded checkpoint] in
    :mod:`dlo.codec.offline`)."""
    from dlo.config.offload import OffloadConfig
    from dlo.models import build_pipeline
    from dlo.pipelines.load import load_pipeline

    t0 = time.perf_counter()
    print(
        f"dlo save-checkpoint: encoding the blocks with codec={args.codec}",
        flush=True,
    )
    chunk = {} if args.chunk_mb is None else {"chunk_mb": args.chunk_mb}
    cfg = OffloadConfig(  # every block streamed, so every block is encoded
        mode="layer", components=("dit", "encoder"), resident_layers=0, codec=args.codec, **chunk
    )
    factory = functools.partial(
        build_pipeline, args.preset, dtype=getattr(torch, args.dtype), device="meta"
    )
    _, backend = load_pipeline(factory, path, cfg)
    assert backend is not None
    try:
        st = backend.stats()
        (out,) = backend.save_encoded()  # type: ignore[attr-defined]
    finally:
        backend.disable()
    print(
        f"dlo save-checkpoint: encoded {st['host_encoded_raw_nbytes'] / (1 << 30):.2f} GiB to "
        f"{st['host_encoded_nbytes'] / (1 << 30):.2f} GiB (ratio {st['codec_ratio']:.3f}, "
        f"{st['codec_bitstream']}) -> {out} in {time.perf_counter() - t0:.1f}s"
    )


def add_pipeline_arguments(s: argparse.ArgumentParser) -> None:
    """The flags of ``dlo save-pipeline``."""
    from dlo.pipelines.layouts import FOLDERS

    s.add_argument(
        "--like",
        required=True,
        choices=sorted(FOLDERS),
        help="the pipeline's layout and published configs (tiny-*: a size CPU tests run)",
    )
    s.add_argument("dir", help="the folder to write (must not exist, or be empty)")
    s.add_argument(
        "--dtype", default=None, choices=DTYPES, help="weight dtype (default: the layout's)"
    )
    s.add_argument("--seed", type=int, default=0, help="weight seed")
    s.add_argument("--shard-gb", type=float, default=5.0, help="the most GiB per safetensors file")


def save_pipeline(args: argparse.Namespace) -> int:
    """``dlo save-pipeline``: a random-weight diffusers pipeline folder in a real layout
    (:mod:`dlo.pipelines.synth`), for ``dlo run --pipeline`` without downloads."""
    from dlo.commands.run_flags import PIPELINE_CALL_FLAGS
    from dlo.pipelines.layouts import FOLDERS
    from dlo.pipelines.synth import save_folder

    if not math.isfinite(args.shard_gb) or args.shard_gb <= 0:
        raise ValueError(f"--shard-gb={args.shard_gb} must be a finite number > 0")
    logging.getLogger("dlo.pipelines.synth").setLevel(logging.INFO)  # build and write times
    t0 = time.perf_counter()
    like = FOLDERS[args.like]
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = save_folder(
        like, args.dir, dtype=dtype, seed=args.seed, max_shard_size=int(args.shard_gb * (1 << 30))
    )
    nbytes = sum(f.stat().st_size for f in out.rglob("*.safetensors"))
    flag_of = {name: dest.replace("_", "-") for dest, name in PIPELINE_CALL_FLAGS.items()}
    flags = " ".join(f"--{flag_of[k]} {v}" for k, v in like.call.items())
    print(
        f"dlo save-pipeline: {like.name} ({like.pipeline}, random weights) "
        f"{nbytes / (1 << 30):.2f} GiB -> {out} in {time.perf_counter() - t0:.1f}s; run it "
        f"with: dlo run --pipeline {out} {flags}"
    )
    return 0
