"""``dlo run --pipeline DIR``: a user's diffusers pipeline folder, loaded per rank
(:func:`dlo.load_pipeline`), then the pipeline's own ``__call__``.

Data-parallel ranks (``torchrun``) run the same shapes in lock step with their own request:
rank r takes prompt ``r mod len(--prompt)`` and seed ``--seed + r``, and writes
``--output`` with ``.rankR`` before the suffix, or after a directory's name (rank 0 the path
itself). With ``--context-parallel ulysses|ring`` (:mod:`dlo.pipelines.context_parallel`) the ranks
instead run one request together (the first prompt, ``--seed``), every DiT split along the
sequence over all of them, and rank 0 alone writes it. ``--output`` is a directory (a PNG per
frame) when it is one already, whatever its name, ends in ``/`` or has no suffix; a ``.png``
for more than one frame is refused before any work. Rank 0 prints what will run before the
load, shows the progress (:mod:`dlo.platform.progress`, not diffusers' bar) and prints the
results: step time, peak HBM, host memory, cold start (process start to the first DiT
forward), where the output went and its frame count. ``--check`` runs the same call on a
resident pipeline (``DiffusionPipeline.from_pretrained`` on the device; context-parallel the
same way) and compares bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dlo.commands.args import (
    check_ranges,
    compile_blocks,
    count_nonfinite,
    disk_fields,
    parity_word,
    report_ranks,
)
from dlo.commands.pipeline_calls import (
    call_kwargs,
    dits_of,
    resident_reference,
    result_of,
    step_times,
    timed_call,
)
from dlo.commands.run_flags import (
    PIPELINE_CALL_RANGES,
    config_of,
    save_encoded_if_asked,
)
from dlo.config.parallel import ParallelConfig
from dlo.plan.policy_explain import disk_explained, late_codecs, replans_explained
from dlo.platform.env import process_peak_rss_bytes, process_start_time, torchrun_env
from dlo.platform.progress import progress_bar

if TYPE_CHECKING:
    from dlo.pipelines.folder import FolderIndex

logger = logging.getLogger(__name__)

_NOT_WITH_PIPELINE = {"preset": "--preset", "tokens": "--tokens", "checkpoint": "--checkpoint"}


def output_kind(path: str) -> str:
    """What ``--output`` names: ``"dir"`` (an existing directory whatever its name, a path
    ending in ``/``, or one without a suffix), else its suffix, lower case."""
    p = Path(path)
    if p.is_dir() or path.endswith(("/", os.sep)) or not p.suffix:
        return "dir"
    return p.suffix.lower()


def _output_path(path: str, rank: int, world: int) -> Path:
    p = Path(path)
    if rank == 0 or world == 1:
        return p
    if output_kind(path) == "dir":
        return p.with_name(f"{p.name}.rank{rank}")
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def check_output(path: str | None, num_frames: int = 1) -> None:
    """Refuse an ``--output`` that cannot be written, before any work: another suffix than
    .png or .mp4, one PNG for ``num_frames`` > 1, an MP4 without imageio, a file where
    its folder should be."""
    if path is None:
        return
    p, kind = Path(path), output_kind(path)
    if kind not in ("dir", ".png", ".mp4"):
        raise ValueError(
            f"--output={path!r}: write a .png (image), .mp4 (video) or a directory (an "
            "existing one, or a path ending in /)"
        )
    if kind == ".png" and num_frames > 1:
        raise ValueError(
            f"--output={path!r} is one PNG but the run makes {num_frames} frames: write a "
            ".mp4, or a directory (a PNG per frame), or pass --frames 1"
        )
    if kind == ".mp4":
        try:
            import imageio  # noqa: F401  (diffusers' export_to_video writes with imageio)
        except ImportError:
            raise ValueError(
                f"--output={path!r}: MP4 needs imageio (pip install imageio imageio-ffmpeg); "
                "or pass a directory to write the frames as PNG files"
            ) from None
    parent = p if kind == "dir" else p.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"--output={path!r}: {parent} is not a directory")


def planned_frames(args: argparse.Namespace, index: FolderIndex) -> int:
    """The frames the call makes, as known before the load: ``--frames``, else the default
    of the ``num_frames`` of ``index``'s pipeline class (1 where it takes none)."""
    from dlo.pipelines.folder import pipeline_class

    if args.frames is not None:
        return int(args.frames)
    cls = pipeline_class(index)
    param = inspect.signature(cls.__call__).parameters.get("num_frames")  # type: ignore[operator]
    default = param.default if param is not None else None
    return default if isinstance(default, int) else 1


def save_output(images: torch.Tensor, path: Path, kind: str) -> list[Path]:
    """Write a pipeline's ``output_type="pt"`` result: an image ``[B, C, H, W]`` or a
    video ``[B, F, C, H, W]`` (first of the batch), in [0, 1], as ``kind`` (of
    :func:`output_kind`) says."""
    from PIL import Image

    arr = (images[0].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    frames = [arr] if arr.dim() == 3 else list(arr)
    pil = [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in frames]
    if kind == ".png" and len(pil) == 1:
        path.parent.mkdir(parents=True, exist_ok=True)
        pil[0].save(path)
        return [path]
    if kind == ".mp4":
        from diffusers.utils import export_to_video

        path.parent.mkdir(parents=True, exist_ok=True)
        export_to_video(pil, str(path), fps=16)
        return [path]
    if kind == ".png":  # frames no check foresaw (no num_frames): all of them, beside it
        path.parent.mkdir(parents=True, exist_ok=True)
        out = [path.with_name(f"{path.stem}_{i:04d}.png") for i in range(len(pil))]
        logger.warning("--output %s: %d frames: %s ... %s", path, len(pil), out[0], out[-1].name)
    else:
        path.mkdir(parents=True, exist_ok=True)
        out = [path / f"frame_{i:04d}.png" for i in range(len(pil))]
    for img, p in zip(pil, out):
        img.save(p)
    return out


def run_pipeline(args: argparse.Namespace, parser_defaults: dict[str, Any]) -> int:
    """``dlo run --pipeline``: see the module docstring."""
    entered = time.time()
    from dlo.parallel.groups import init, shutdown
    from dlo.pipelines.context_parallel import check_context_parallel, enable_context_parallel
    from dlo.pipelines.folder import read_index
    from dlo.pipelines.load import load_pipeline
    from dlo.platform.device import default_device, get_platform
    from dlo.runtime.measure import device_peak_nbytes

    for dest, flag in _NOT_WITH_PIPELINE.items():
        if getattr(args, dest) != parser_defaults[dest]:
            raise ValueError(f"{flag} is for the demo pipeline; --pipeline loads the folder's")
    for dest in ("hsdp_shard", "hsdp_replicate"):  # its ranks are data-parallel ranks
        if getattr(args, dest) != parser_defaults[dest]:
            raise ValueError(f"--{dest.replace('_', '-')} is for the demo pipeline, not --pipeline")
    cfg = config_of(args, parser_defaults)
    check_ranges(
        (
            ("--steps", args.steps, 1, None),
            ("--seed", args.seed, 0, None),
            *[
                (f"--{dest.replace('_', '-')}", getattr(args, dest), low, high)
                for dest, (low, high) in PIPELINE_CALL_RANGES.items()
            ],
        )
    )
    index = read_index(args.pipeline)  # a bad folder fails here, before the process group
    one_png = args.output is not None and output_kind(args.output) == ".png"
    check_output(args.output, planned_frames(args, index) if one_png else 1)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device) if args.device else default_device()
    par = ParallelConfig(data_parallel_size=torchrun_env().world_size)
    world = init(par, device=device)
    cp = args.context_parallel
    if cp is not None:  # every rank runs rank 0's request, split along the sequence
        check_context_parallel(cp, world.size, device)
    request = 0 if cp is not None else world.rank
    split = (  # the pipeline's DiTs split along the sequence (the run's and --check's)
        None
        if cp is None
        else lambda p: enable_context_parallel(dits_of(p), cp, world.size, device)
    )
    platform = get_platform(device)
    init_s = time.time() - entered
    rank0 = world.rank == 0
    transfer = cfg.transfer if cfg.mode == "layer" else "-"
    if rank0:  # what will run, before the load (stdout carries --json's JSON); its phases
        header = (
            f"dlo run: pipeline={args.pipeline} ({index.pipeline_class}) mode={cfg.mode} "
            f"transfer={transfer} steps={args.steps} ranks={world.size}"
            + (f" codec={cfg.codec}" if cfg.codec not in (None, "none") else "")
            + (f" output={args.output}" if args.output else "")
        )
        print(header, file=sys.stderr if args.json else sys.stdout, flush=True)
        logging.getLogger("dlo.pipelines.load").setLevel(logging.INFO)
    t0 = time.perf_counter()
    pipe, backend = load_pipeline(
        args.pipeline,
        cfg,
        parallel=par,
        device=device,
        dtype=dtype,
        verify_checksum=args.verify_checksum,
        prepare=split,
    )
    load_s = time.perf_counter() - t0
    try:
        save_error = save_encoded_if_asked(args, backend, rank0)  # raised after the report
        for dit in dits_of(pipe):
            compile_blocks(dit, args.compile)
        load_rss = process_peak_rss_bytes()
        pipe.set_progress_bar_config(disable=True)  # dlo's progress instead (bars or lines)
        kw = call_kwargs(args, pipe, request, device)
        platform.reset_peak_memory_stats()

        called = time.time()
        enabled = rank0 and not args.json
        bar = progress_bar(
            total=args.steps, desc="dlo run: denoising", unit="step", enabled=enabled, leave=True
        )
        with contextlib.closing(bar):
            images, marks, wall = timed_call(pipe, kw, platform, bar)
        pipeline_class = type(pipe).__name__
        stats = backend.stats() if backend is not None else {}
        if args.explain and rank0:  # the decision, then what the forwards changed
            out = sys.stderr if args.json else sys.stdout
            print((stats.get("policy") or {}).get("explanation", "dlo policy: none"), file=out)
            print(replans_explained(stats.get("policy")), file=out, flush=True)
            if stats.get("num_disk_blocks"):
                print(disk_explained(stats), file=out, flush=True)
        hbm_peak = device_peak_nbytes(platform, stats)
        run_rss = process_peak_rss_bytes()
        written: list[Path] = []
        location = None
        if args.output and (cp is None or rank0):  # context parallel: one output, rank 0's
            location = _output_path(args.output, world.rank, world.size)
            written = save_output(images, location, output_kind(args.output))
        parity: bool | None = None
        if args.check:
            if backend is not None:
                backend.disable()  # host and device memory back before the reference loads
            pipe = None
            gc.collect()
            ref = resident_reference(args.pipeline, dtype, device)
            if split is not None:  # the same split on the same ranks, every weight resident
                split(ref)
            for dit in dits_of(ref):
                compile_blocks(dit, args.compile)
            with torch.inference_mode():
                expect = result_of(ref(**call_kwargs(args, ref, request, device)))
            parity = bool(torch.equal(expect, images))
            del ref
        nonfinite = count_nonfinite(images)  # NaN and inf values of the output
        report = {
            "rank": world.rank,
            "world_size": world.size,
            "pipeline": args.pipeline,
            "class": pipeline_class,
            "mode": cfg.mode,
            "transfer": stats.get("transfer", "-"),
            "steps": args.steps,
            "prompt": kw["prompt"],
            "seed": args.seed + request,
            "context_parallel": cp,
            **step_times(marks),
            # the cold start's phases: process start to dlo's entry (interpreter, imports), the
            # process group and the device, the load, the call to its first DiT forward (the
            # text encoders, first kernels)
            "startup_s": entered - process_start_time(),
            "init_s": init_s,
            "load_s": load_s,
            "to_first_forward_s": (marks[0] - called) if marks else 0.0,
            "enable_s": stats.get("enable_time_s", 0.0),
            "fill_s": stats.get("fill_time_s", 0.0),
            "pin_s": stats.get("pin_time_s", 0.0),
            "wall_s": wall,
            "load_peak_rss_nbytes": load_rss,
            "peak_rss_nbytes": run_rss,
            "hbm_peak_nbytes": hbm_peak,
            "host_nbytes": stats.get("host_nbytes", 0),
            "host_pinned_nbytes": stats.get("host_pinned_nbytes", 0),
            **disk_fields(stats),
            "codec": stats.get("codec", "none"),
            "codec_ratio": stats.get("codec_ratio", 1.0),
            "encoded_read_blocks": stats.get("encoded_read_blocks", 0),
            "codec_late": stats.get("codec_late", {}),
            "num_slots": stats.get("num_slots", 0),
            "num_resident_blocks": stats.get("num_resident_blocks", 0),
            "num_streamed_blocks": stats.get("num_streamed_blocks", 0),
            "num_pinned_blocks": stats.get("num_pinned_blocks", 0),
            "policy": stats.get("policy"),
            "output": [str(p) for p in written],
            "output_location": None if location is None else str(location),
            "output_frames": 1 if images[0].dim() == 3 else int(images[0].shape[0]),
            "output_finite": nonfinite == 0,
            "output_nonfinite": nonfinite,
            "parity": parity,
        }
        ok = report_ranks(
            report,
            world.size,
            rank0,
            lambda rs: json.dumps(rs, indent=2) if args.json else summary(rs, transfer),
        )
    finally:
        # dlo's groups go before the process group; disable keeps the blocks where they are
        # (no restore: that would only double the peak RSS at exit) and gives back the host
        # and device memory, also to a caller that runs main() in-process
        if backend is not None:
            backend.disable()
    del pipe, backend
    gc.collect()
    shutdown()
    if save_error is not None:
        raise save_error  # one "dlo: error:" line, exit 2; the report is printed above
    return 0 if ok else 1


def _output_cell(r: dict[str, Any]) -> str:
    """Where a rank's output went and how many frames, not every file."""
    if r.get("output_location") is None:
        return "-"
    frames = r["output_frames"]
    return r["output_location"] + (f" ({frames} frames)" if frames > 1 else "")


def summary(reports: list[dict[str, Any]], transfer: str) -> str:
    """What the run settled that its header could not say (an automatic ``transfer``, the
    codec's ratio), then a row per rank."""
    r0, gib = reports[0], float(1 << 30)
    settled = [f"transfer={r0['transfer']}"] if r0["transfer"] != transfer else []
    if r0["codec"] != "none":
        settled.append(
            f"codec={r0['codec']} (ratio {r0['codec_ratio']:.3f}, "
            f"{r0['encoded_read_blocks']} block(s) read encoded)"
        )
    settled += late_codecs(r0.get("codec_late", {}))
    lines = [f"dlo run: settled {' '.join(settled)}"] if settled else []
    lines += [
        "| rank | seed | step ms (median) | first step ms | cold start s | load s | "
        "HBM peak GiB | host GiB | pinned GiB | peak RSS GiB | output | parity |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        parity = parity_word(r["parity"])
        lines.append(
            f"| {r['rank']} | {r['seed']} | {r['step_ms_median']:.1f} | {r['first_step_ms']:.1f}"
            f" | {r['cold_start_s']:.2f} | {r['load_s']:.2f} | {r['hbm_peak_nbytes'] / gib:.2f}"
            f" | {r['host_nbytes'] / gib:.3f} | {r['host_pinned_nbytes'] / gib:.3f} | "
            f"{r['peak_rss_nbytes'] / gib:.2f} | {_output_cell(r)} | {parity} |"
        )
    return "\n".join(lines)
