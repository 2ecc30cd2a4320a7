"""``dlo run``: the main job. A denoising loop of the embedded demo pipeline
(:mod:`dlo.models`) under a chosen strategy, on one process or under ``torchrun``
(data-parallel ranks run different seeds of the same shapes, in lock step). Rank 0 shows a
progress bar and prints a summary; ``--check`` compares every rank's output bit for bit with
a fully resident run; ``--checkpoint`` loads the weights into a meta skeleton
(:func:`dlo.load_pipeline`) instead of building them; ``--offload-config`` takes the offload
settings as one JSON object (``OffloadConfig.from_dict``, vLLM-Omni's compact form too).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from dlo.commands.args import DTYPES, PRESET_HELP, int_or_auto
from dlo.config.fields import GATHER_ENGINES, GATHER_SYNCS, HOST_BACKINGS, MODES, TRANSFERS
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.platform.progress import progress_enabled

# the flags --offload-config replaces (give them inside the JSON instead)
OFFLOAD_FLAGS = {
    "mode": "--mode",
    "transfer": "--transfer",
    "resident_layers": "--resident-layers",
    "num_slots": "--num-slots",
    "chunk_mb": "--chunk-mb",
    "no_pin": "--no-pin",
    "gather_engine": "--gather-engine",
    "gather_sync": "--gather-sync",
    "device_budget_gb": "--device-budget-gb",
    "block_compute_ms": "--block-compute-ms",
    "host_backing": "--host-backing",
}


def add_arguments(r: argparse.ArgumentParser) -> None:
    """The flags of ``dlo run``."""
    r.add_argument("--preset", default="tiny", help=PRESET_HELP)
    r.add_argument(
        "--mode",
        default="layer",
        choices=MODES,
        help="layer: stream blocks through device slots; module: swap whole components; "
        "none: no offload",
    )
    r.add_argument(
        "--transfer",
        default="rank-local",
        choices=TRANSFERS,
        help="how a block reaches the device: whole blocks per rank (rank-local), 1/N per "
        "rank rebuilt by AllGather (allgather), one host copy per node (node-shared), or "
        "chosen from measured bandwidths (auto)",
    )
    r.add_argument(
        "--resident-layers",
        type=int_or_auto,
        default=0,
        help="leading DiT blocks kept on the device: an int >= 0 or 'auto'",
    )
    r.add_argument(
        "--num-slots",
        type=int_or_auto,
        default=2,
        help="device slots the streamed blocks take turns in: an int >= 1 or 'auto'",
    )
    r.add_argument(
        "--device-budget-gb",
        type=float,
        default=None,
        help="device memory for weights per rank (GiB); sizes the resident blocks",
    )
    r.add_argument(
        "--block-compute-ms",
        type=float,
        default=None,
        help="expected compute time of one block (ms; `dlo bench` prints it): lets "
        "--transfer auto take node-shared where compute hides whole-block copies",
    )
    r.add_argument(
        "--offload-config",
        default=None,
        metavar="JSON",
        help="the offload settings as one JSON object, or the path of a .json file holding "
        "one (OffloadConfig.from_dict: the compact form, vLLM-Omni's diffusion_offload_config "
        "or the legacy flags); replaces --mode, --transfer and the other offload flags",
    )
    r.add_argument(
        "--explain",
        action="store_true",
        help="print the automatic policy's decision and the numbers behind it (rank 0)",
    )
    r.add_argument(
        "--chunk-mb", type=int, default=64, help="AllGather chunk size in MiB (an int >= 1)"
    )
    r.add_argument("--no-pin", action="store_true", help="keep host storage pageable")
    r.add_argument(
        "--gather-engine",
        default="auto",
        choices=GATHER_ENGINES,
        help="AllGather by NCCL kernels or by copy engines over peer access (CUDA, one "
        "node); auto: the copy engines where every rank can use them",
    )
    r.add_argument(
        "--gather-sync",
        default="auto",
        choices=GATHER_SYNCS,
        help="the copy engine's barriers: stream memory operations or the barrier kernel",
    )
    r.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        choices=["default", "max-autotune-no-cudagraphs"],
        help="compile every DiT block (block.compile(), as diffusers' compile_repeated_blocks) "
        "in this torch.compile mode, once offload is enabled; --check compiles the resident "
        "reference the same way",
    )
    r.add_argument("--steps", type=int, default=8, help="denoising steps (an int >= 1)")
    r.add_argument("--tokens", type=int, default=None, help="latent tokens (default: the preset's)")
    r.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype")
    r.add_argument(
        "--seed", type=int, default=0, help="input seed of rank 0 (rank r uses seed + r)"
    )
    r.add_argument("--check", action="store_true", help="bitwise parity against a resident run")
    r.add_argument("--json", action="store_true", help="print a machine-readable report")
    r.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: auto)")
    r.add_argument(
        "--hsdp-shard",
        type=int,
        default=1,
        help="HSDP shard-axis size: FSDP2 shards the non-block weights and dlo's "
        "AllGather runs on this axis (1: no HSDP)",
    )
    r.add_argument(
        "--hsdp-replicate",
        type=int,
        default=1,
        help="HSDP replicate-axis size (ranks = replicate x shard)",
    )
    r.add_argument(
        "--checkpoint",
        default=None,
        help="load the weights from this safetensors checkpoint (file, directory or index) "
        "into a meta skeleton instead of building them (see dlo save-checkpoint)",
    )
    r.add_argument(
        "--checkpoint-load",
        default="mapped",
        choices=["mapped", "copy"],
        help="mapped: each rank reads only its slices; copy: the ordinary path, a full "
        "pageable copy first (for comparison)",
    )
    r.add_argument(
        "--host-backing",
        default="region",
        choices=HOST_BACKINGS,
        help="region: each rank copies its blocks into its own host memory; mapped: "
        "rank-local blocks are read from the --checkpoint file (page cache shared by the "
        "node's ranks) through two pinned staging buffers",
    )


def config_of(args: argparse.Namespace, parser_defaults: dict[str, Any]) -> OffloadConfig:
    """The offload config the flags ask for (bad values raise ValueError/TypeError naming
    the field, before any work)."""
    if args.offload_config is not None:
        given = [
            flag
            for dest, flag in OFFLOAD_FLAGS.items()
            if getattr(args, dest) != parser_defaults[dest]
        ]
        if given:
            raise ValueError(
                f"--offload-config replaces {', '.join(given)}: give those settings inside the "
                "JSON instead"
            )
        return OffloadConfig.from_dict(_json_object(args.offload_config))
    # every flag goes to the config, which refuses layer-only settings with --mode module
    return OffloadConfig(
        mode=args.mode,
        transfer=args.transfer,
        resident_layers=args.resident_layers,
        num_slots=args.num_slots,
        chunk_mb=args.chunk_mb,
        pin_memory=not args.no_pin,
        gather_engine=args.gather_engine,
        gather_sync=args.gather_sync,
        device_budget_gb=args.device_budget_gb,
        block_compute_ms=args.block_compute_ms,
        host_backing=args.host_backing,
    )


def _json_object(text: str) -> Any:
    source = "--offload-config"
    if not text.lstrip().startswith("{"):
        if not os.path.isfile(text):
            raise ValueError(f"--offload-config={text!r} is neither a JSON object nor a file")
        source = f"--offload-config file {text!r}"
        with open(text, encoding="utf-8") as fh:
            text = fh.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source} must hold a JSON object, got {type(data).__name__}")
    return data


def _device(text: str) -> torch.device:
    try:
        return torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"--device={text!r} is not a device: use cpu, cuda or cuda:N") from e


def run(args: argparse.Namespace, parser_defaults: dict[str, Any]) -> int:
    """``dlo run``: see the module docstring."""
    from dlo.backends.factory import get_offload_backend
    from dlo.backends.hsdp import shard_non_block
    from dlo.models import build_pipeline, get_preset, make_inputs
    from dlo.parallel.groups import init, shutdown
    from dlo.pipelines.load import load_pipeline
    from dlo.platform.device import default_device, get_platform
    from dlo.platform.env import process_peak_rss_bytes, torchrun_env
    from dlo.runtime.measure import device_peak_nbytes

    cfg = config_of(args, parser_defaults)  # bad flag values fail here, before any work
    for name, minimum in (("steps", 1), ("seed", 0)):
        if getattr(args, name) < minimum:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= {minimum}")
    if args.tokens is not None and args.tokens < 1:
        raise ValueError(f"--tokens={args.tokens} must be >= 1")
    preset = get_preset(args.preset)
    dtype = getattr(torch, args.dtype)
    device = _device(args.device) if args.device else default_device()
    env_world = torchrun_env().world_size
    par = ParallelConfig(
        data_parallel_size=env_world,
        hsdp_replicate_size=args.hsdp_replicate,
        hsdp_shard_size=args.hsdp_shard,
    )
    if par.use_hsdp and cfg.mode != "layer":
        raise ValueError(f"--hsdp-shard/--hsdp-replicate compose with --mode layer, not {cfg.mode}")
    if cfg.host_backing == "mapped" and (
        args.checkpoint is None or args.checkpoint_load != "mapped"
    ):
        raise ValueError(
            "--host-backing mapped reads blocks from the checkpoint: it needs --checkpoint "
            "(with --checkpoint-load mapped)"
        )
    world = init(par, device=device)
    platform = get_platform(device)
    rank0 = world.rank == 0
    seed = args.seed + world.rank  # DP ranks: different requests, same shapes

    def skeleton() -> Any:
        return build_pipeline(preset, dtype=dtype, device="meta")

    ids, latents = make_inputs(preset, tokens=args.tokens, seed=seed, device=device, dtype=dtype)
    t0 = time.perf_counter()
    if args.checkpoint is not None:
        build_s = 0.0
        pipe, backend = load_pipeline(
            skeleton,
            args.checkpoint,
            cfg,
            par,
            device,
            copy=args.checkpoint_load == "copy",
            prepare=(
                (lambda p: shard_non_block(p, cfg, par, device_type=device.type))
                if par.use_hsdp and cfg.mode == "layer"
                else None
            ),
        )
        if backend is not None and cfg.mode == "layer":
            pipe.vae.to(device)  # the layer backend streams DiT and encoder blocks only
    else:
        pipe = build_pipeline(preset, dtype=dtype, device="cpu" if cfg.enabled else device)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        backend = get_offload_backend(cfg, par, device)
        if backend is not None:
            if cfg.mode == "layer":
                pipe.vae.to(device)  # the layer backend streams DiT and encoder blocks only
            if par.use_hsdp:
                shard_non_block(pipe, cfg, par, device_type=device.type)
            backend.enable(pipe)
    enable_s = time.perf_counter() - t0
    compile_mode = None if args.compile in (None, "default") else args.compile
    if args.compile is not None:  # after enable: dlo keeps its hooks outside the compile
        pipe.transformer.compile_repeated_blocks(mode=compile_mode)
    enable_rss = process_peak_rss_bytes()  # VmHWM now: the build and enable, not the run
    platform.reset_peak_memory_stats()
    if args.explain and rank0:
        # stdout carries the JSON report with --json: the explanation goes to stderr then
        print(_explain(cfg, backend), file=sys.stderr if args.json else sys.stdout, flush=True)

    step_events: list[Any] = []

    def on_step(i: int) -> None:
        if platform.has_streams:
            ev = platform.new_event(timing=True)
            ev.record(platform.current_stream())
            step_events.append(ev)
        else:
            step_events.append(time.perf_counter())
        if bar is not None:
            bar.update(1)

    bar = None
    if rank0 and not args.json and progress_enabled():
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="dlo run: denoising", unit="step", file=sys.stderr)
    t_start: Any
    with torch.inference_mode():
        if platform.has_streams:
            t_start = platform.new_event(timing=True)
            t_start.record(platform.current_stream())
        else:
            t_start = time.perf_counter()
        wall0 = time.perf_counter()
        text = pipe.encode(ids)
        out = pipe.decode(pipe.denoise(latents, text, args.steps, on_step=on_step))
        platform.synchronize()
        wall = time.perf_counter() - wall0
    if bar is not None:
        bar.close()
    marks = [t_start, *step_events]
    if platform.has_streams:
        step_ms = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    else:
        step_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
    stats = backend.stats() if backend is not None else {}
    # both before the teardown and the reference run below
    hbm_peak = device_peak_nbytes(platform, stats)
    run_rss = process_peak_rss_bytes()
    parity: bool | None = None
    if backend is not None:
        backend.disable()  # frees host and device memory before the reference run
    if args.check:
        if args.checkpoint is not None:
            ref, _ = load_pipeline(skeleton, args.checkpoint, None, par, device)
        else:
            ref = build_pipeline(preset, dtype=dtype, device=device)
        if args.compile is not None:
            ref.transformer.compile_repeated_blocks(mode=compile_mode)
        parity = bool(torch.equal(ref.generate(ids, latents, args.steps), out))
        del ref
    report = {
        "rank": world.rank,
        "world_size": world.size,
        "preset": preset.name,
        "mode": cfg.mode,
        "compile": args.compile,
        "transfer": stats.get("transfer", "-"),
        "gather_engine": stats.get("gather_engine"),
        "gather_sync": stats.get("gather_sync"),
        "steps": args.steps,
        "tokens": latents.shape[1],
        "device": str(device),
        "step_ms_median": sorted(step_ms[1:] or step_ms)[len(step_ms[1:] or step_ms) // 2],
        "first_step_ms": step_ms[0],
        "wall_s": wall,
        "load": "built" if args.checkpoint is None else f"checkpoint-{args.checkpoint_load}",
        "build_s": build_s,
        "enable_s": enable_s,
        "enable_peak_rss_nbytes": stats.get("enable_peak_rss_nbytes", enable_rss),
        "hbm_peak_nbytes": hbm_peak,
        "device_slot_nbytes": stats.get("device_slot_nbytes", 0),
        "host_nbytes": stats.get("host_nbytes", 0),
        "host_pinned_nbytes": stats.get("host_pinned_nbytes", 0),
        "host_backing": stats.get("host_backing", "-"),
        "host_mapped_nbytes": stats.get("host_mapped_nbytes", 0),
        "exposed_wait_ms": stats.get("exposed_wait_ms", 0.0),
        "peak_rss_nbytes": run_rss,
        "parity": parity,
        "output_finite": bool(torch.isfinite(out.float()).all()),
        "num_slots": stats.get("num_slots", 0),
        "num_resident_blocks": stats.get("num_resident_blocks", 0),
        "policy": stats.get("policy"),
    }
    reports = [report]
    if dist.is_initialized():
        reports = [None] * world.size  # type: ignore[list-item]
        dist.all_gather_object(reports, report)
    if rank0:
        print(json.dumps(reports, indent=2) if args.json else _summary(reports))
    ok = all(r["output_finite"] and r["parity"] in (None, True) for r in reports)
    del pipe, backend, out  # FSDP2 state and dlo groups go before the process group
    gc.collect()
    shutdown()
    return 0 if ok else 1


def _explain(cfg: OffloadConfig, backend: Any) -> str:
    """The policy's decision (``stats()["policy"]``), or what was set by hand."""
    stats = backend.stats() if backend is not None else {}
    policy = stats.get("policy")
    gather = ""
    if cfg.mode == "layer" and stats.get("group_size", 1) > 1:
        gather = (
            f"\ndlo gather: gather_engine={cfg.gather_engine!r} -> "
            f"{stats.get('gather_engine')}"
            + (f" ({stats['gather_sync']} barriers)" if stats.get("gather_sync") else "")
        )
    if policy is not None:
        return str(policy["explanation"]) + gather
    if cfg.mode != "layer":
        return f"dlo policy: nothing to decide for mode={cfg.mode!r}"
    return (
        f"dlo policy: nothing automatic; explicit transfer={cfg.transfer!r}, "
        f"num_slots={cfg.num_slots}, resident_layers={cfg.resident_layers} (pass 'auto' or "
        "--device-budget-gb to let dlo measure and decide)" + gather
    )


def _summary(reports: list[dict[str, Any]]) -> str:
    r0 = reports[0]
    gib = float(1 << 30)
    lines = [
        f"dlo run: preset={r0['preset']} mode={r0['mode']} transfer={r0['transfer']} "
        f"steps={r0['steps']} tokens={r0['tokens']} ranks={r0['world_size']} device={r0['device']} "
        f"weights={r0['load']} host={r0['host_backing']}"
        + (f" compile={r0['compile']}" if r0.get("compile") else "")
        + (f" gather={r0['gather_engine']}/{r0['gather_sync']}" if r0.get("gather_sync") else ""),
        "| rank | step ms (median) | first step ms | HBM peak GiB | slots GiB | host GiB "
        "private / mapped | pinned host GiB | exposed wait ms | enable s | enable peak RSS GiB "
        "| parity |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        parity = {None: "not checked", True: "bitwise equal", False: "MISMATCH"}[r["parity"]]
        lines.append(
            f"| {r['rank']} | {r['step_ms_median']:.1f} | {r['first_step_ms']:.1f} | "
            f"{r['hbm_peak_nbytes'] / gib:.2f} | {r['device_slot_nbytes'] / gib:.3f} | "
            f"{r['host_nbytes'] / gib:.3f} / {r['host_mapped_nbytes'] / gib:.3f} | "
            f"{r['host_pinned_nbytes'] / gib:.3f} | {r['exposed_wait_ms']:.1f} | "
            f"{r['enable_s']:.2f} | {r['enable_peak_rss_nbytes'] / gib:.2f} | {parity} |"
        )
    return "\n".join(lines)
