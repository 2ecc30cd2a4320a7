"""``dlo run``: the main job. A denoising loop of the embedded demo pipeline
(:mod:`dlo.models`) under a chosen strategy, on one process or under ``torchrun``
(data-parallel ranks run different seeds of the same shapes, in lock step). Rank 0 prints
what will run (the ``dlo run:`` line) before it starts, shows progress
(:mod:`dlo.platform.progress`: bars in a terminal, plain lines in a log), and prints the
results; ``--check`` compares every rank's output bit for bit with a fully resident run;
``--checkpoint`` loads the weights into a meta skeleton (:func:`dlo.load_pipeline`) instead
of building them; ``--offload-config`` takes the offload settings as one JSON object
(``OffloadConfig.from_dict``, vLLM-Omni's compact form too).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from typing import Any

import torch

from dlo.commands.args import (
    check_minimums,
    compile_blocks,
    count_nonfinite,
    disk_fields,
    parity_word,
    report_ranks,
    steady_median,
)
from dlo.commands.run_flags import PIPELINE_ONLY, config_of, parallel_of, save_encoded_if_asked
from dlo.config.offload import OffloadConfig
from dlo.config.unset import for_device, unset_fields
from dlo.plan.policy_explain import disk_explained, late_codecs, replans_explained
from dlo.platform.progress import progress_bar


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

    if args.pipeline is not None:
        from dlo.commands.run_pipeline import run_pipeline

        return run_pipeline(args, parser_defaults)
    pipeline_only = [
        f"--{k.replace('_', '-')}" for k in PIPELINE_ONLY if getattr(args, k) is not None
    ]
    if pipeline_only:
        verb = "needs" if len(pipeline_only) == 1 else "need"
        raise ValueError(f"{', '.join(pipeline_only)} {verb} --pipeline DIR (the demo takes none)")
    cfg = config_of(args, parser_defaults)  # bad flag values fail here, before any work
    check_minimums(
        (("--steps", args.steps, 1), ("--seed", args.seed, 0), ("--tokens", args.tokens, 1))
    )
    preset = get_preset(args.preset)
    dtype = getattr(torch, args.dtype)
    device = _device(args.device) if args.device else default_device()
    par = parallel_of(args, torchrun_env().world_size)
    if par.use_hsdp and cfg.mode != "layer":
        raise ValueError(f"--hsdp-shard/--hsdp-replicate compose with --mode layer, not {cfg.mode}")
    if cfg.host_backing == "mapped" and (
        args.checkpoint is None or args.checkpoint_load != "mapped"
    ):
        raise ValueError(
            "--host-backing mapped reads blocks from the checkpoint: it needs --checkpoint "
            "(with --checkpoint-load mapped)"
        )
    if cfg.host_budget_gb is not None and (
        args.checkpoint is None or args.checkpoint_load != "mapped"
    ):
        raise ValueError(
            "--host-budget-gb leaves blocks in the checkpoint file: it needs --checkpoint "
            "(with --checkpoint-load mapped), or --pipeline"
        )
    if args.verify_checksum and args.checkpoint is None:
        raise ValueError("--verify-checksum checks what is read from --checkpoint: give one")
    world = init(par, device=device)
    platform = get_platform(device)
    rank0 = world.rank == 0
    seed = args.seed + world.rank  # DP ranks: different requests, same shapes

    def skeleton() -> Any:
        return build_pipeline(preset, dtype=dtype, device="meta")

    ids, latents = make_inputs(preset, tokens=args.tokens, seed=seed, device=device, dtype=dtype)
    header = _header(args, cfg, preset.name, latents.shape[1], world.size, device)
    if rank0:  # what will run, before the build and the enable (stdout carries --json's JSON)
        print(_fields_line(header), file=sys.stderr if args.json else sys.stdout, flush=True)
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
            verify_checksum=args.verify_checksum,
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
    save_error = save_encoded_if_asked(args, backend, rank0)  # raised after the report
    compile_blocks(pipe.transformer, args.compile)  # after enable, as diffusers documents
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
        bar.update(1)

    bar = progress_bar(
        total=args.steps,
        desc="dlo run: denoising",
        unit="step",
        enabled=rank0 and not args.json,
        leave=True,
    )
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
    bar.close()
    marks = [t_start, *step_events]
    if platform.has_streams:
        step_ms = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    else:
        step_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
    stats = backend.stats() if backend is not None else {}
    if args.explain and rank0 and stats.get("policy"):  # what the forwards changed
        print(replans_explained(stats["policy"]), file=sys.stderr if args.json else sys.stdout)
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
        compile_blocks(ref.transformer, args.compile)
        parity = bool(torch.equal(ref.generate(ids, latents, args.steps), out))
        del ref
    nonfinite = count_nonfinite(out)  # NaN and inf values of the output
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
        "step_ms_median": steady_median(step_ms),
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
        **disk_fields(stats),
        "codec": stats.get("codec", "none"),
        "codec_ratio": stats.get("codec_ratio", 1.0),
        "encoded_read_blocks": stats.get("encoded_read_blocks", 0),
        "codec_late": stats.get("codec_late", {}),
        "exposed_wait_ms": stats.get("exposed_wait_ms", 0.0),
        "peak_rss_nbytes": run_rss,
        "parity": parity,
        "output_finite": nonfinite == 0,
        "output_nonfinite": nonfinite,
        "num_slots": stats.get("num_slots", 0),
        "num_resident_blocks": stats.get("num_resident_blocks", 0),
        "num_streamed_blocks": stats.get("num_streamed_blocks", 0),
        "num_pinned_blocks": stats.get("num_pinned_blocks", 0),
        "policy": stats.get("policy"),
    }
    ok = report_ranks(
        report,
        world.size,
        rank0,
        lambda rs: json.dumps(rs, indent=2) if args.json else _summary(rs, header),
    )
    del pipe, backend, out  # FSDP2 state and dlo groups go before the process group
    gc.collect()
    shutdown()
    if save_error is not None:
        raise save_error  # one "dlo: error:" line, exit 2; the report is printed above
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
    gather += "\n" + disk_explained(stats) if stats.get("num_disk_blocks") else ""
    if policy is not None:
        return str(policy["explanation"]) + gather
    if cfg.mode != "layer":
        return f"dlo policy: nothing to decide for mode={cfg.mode!r}"
    device = backend.platform.device.type if backend is not None else "cpu"
    shown, unset = for_device(cfg, device), unset_fields(cfg)

    def value(name: str) -> str:  # a CPU device's default, or the user's value
        return f"{getattr(shown, name)}" + (
            " (unset: a CPU device's default)" if name in unset else ""
        )

    return (
        f"dlo policy: nothing automatic: transfer={shown.transfer!r}, "
        f"num_slots={value('num_slots')}, resident_layers={value('resident_layers')}, "
        f"codec={value('codec')} (pass 'auto', or --device-budget-gb with them unset, to let "
        "dlo measure and decide)" + gather
    )


def _header(
    args: argparse.Namespace,
    cfg: OffloadConfig,
    preset: str,
    tokens: int,
    world_size: int,
    device: torch.device,
) -> dict[str, str]:
    """What will run: the ``dlo run:`` line printed before the build, as its fields."""
    layer = cfg.mode == "layer"
    fields = {
        "preset": preset,
        "mode": cfg.mode,
        "transfer": cfg.transfer if layer else "-",
        "steps": str(args.steps),
        "tokens": str(tokens),
        "ranks": str(world_size),
        "device": str(device),
        "weights": "built" if args.checkpoint is None else f"checkpoint-{args.checkpoint_load}",
        "host": cfg.host_backing if layer else "-",
    }
    if args.compile:
        fields["compile"] = str(args.compile)
    if cfg.codec not in (None, "none"):  # given (unset: the device's default, as the slots)
        fields["codec"] = cfg.codec
    return fields


def _fields_line(fields: dict[str, str]) -> str:
    return "dlo run: " + " ".join(f"{k}={v}" for k, v in fields.items())


def _summary(reports: list[dict[str, Any]], header: dict[str, str]) -> str:
    """The results: what the run settled that its header could not say (an automatic
    transfer, the gather, the codec's ratio), then a row per rank."""
    r0 = reports[0]
    gib = float(1 << 30)
    settled = [
        f"{key}={r0[name]}"
        for key, name in (("transfer", "transfer"), ("host", "host_backing"))
        if header.get(key) != r0[name]
    ]
    if r0.get("gather_sync"):
        settled.append(f"gather={r0['gather_engine']}/{r0['gather_sync']}")
    if r0.get("codec", "none") != "none":
        settled.append(
            f"codec={r0['codec']} (ratio {r0['codec_ratio']:.3f}, "
            f"{r0['encoded_read_blocks']} block(s) read encoded)"
        )
    settled += late_codecs(r0.get("codec_late", {}))
    lines = [f"dlo run: settled {' '.join(settled)}"] if settled else []
    lines += [
        "| rank | step ms (median) | first step ms | HBM peak GiB | slots GiB | host GiB "
        "private / mapped | pinned host GiB | exposed wait ms | enable s | enable peak RSS GiB "
        "| parity |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        parity = parity_word(r["parity"])
        lines.append(
            f"| {r['rank']} | {r['step_ms_median']:.1f} | {r['first_step_ms']:.1f} | "
            f"{r['hbm_peak_nbytes'] / gib:.2f} | {r['device_slot_nbytes'] / gib:.3f} | "
            f"{r['host_nbytes'] / gib:.3f} / {r['host_mapped_nbytes'] / gib:.3f} | "
            f"{r['host_pinned_nbytes'] / gib:.3f} | {r['exposed_wait_ms']:.1f} | "
            f"{r['enable_s']:.2f} | {r['enable_peak_rss_nbytes'] / gib:.2f} | {parity} |"
        )
    return "\n".join(lines)
