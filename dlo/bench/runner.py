"""``dlo bench``: every method on one model and one set of inputs, against the physical limits.

Methods (those that can run on the platform and world size at hand):

* ``resident`` -- the DiT fully on the device (the compute floor);
* ``dlo-ring`` -- dlo's ring, rank-local (group of one);
* ``dlo-node-shared`` -- whole blocks over each rank's own link from one host copy the
  node's ranks share (N > 1; [Note: node-shared host copy]);
* ``dlo-allgather`` -- dlo's AllGather transfer over all ranks (N > 1), NCCL's kernels;
* ``dlo-allgather-copy`` -- the same with the copy-engine gather (N > 1, CUDA);
* ``dlo-allgather-copy-kernel`` -- the copy-engine gather held to torch's barrier kernel
  instead of stream memory operations (the A/B of [Note: barriers without kernels]);
* ``dlo-auto`` -- every setting automatic (``transfer``, ``num_slots``, the gather engine);
* ``dlo-auto-compute`` -- the same, told each row's compute per block (``block_compute_ms``:
  the resident row's time / blocks; needs ``resident``): enabled once per token count;
* ``fsdp2-offload`` -- FSDP2 ``fully_shard`` per block and at the root with
  ``CPUOffloadPolicy(pin_memory=True)`` (N > 1), the peer with the same memory promise;
* limits measured on the spot: pinned and pageable host-to-device bandwidth (this rank alone
  and all ranks at once), AllGather bandwidth of one block, resident time per block.

Times are device-side (CUDA events around each forward), medians over repeated forwards
after warm-up; every rank runs the same shapes in lock step and the report keeps the slowest
rank. Results go to JSON and a markdown table with each time also as a ratio to its limit.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import torch
from torch import nn

from dlo.backends.factory import get_offload_backend
from dlo.bench.budgets import like_budgets, markdown_budgets
from dlo.bench.cost import (
    LIKE_DEFAULT_TOKENS,
    bench_cost,
    default_preset,
    default_tokens,
    describe,
    matmul_flops_per_s,
)
from dlo.bench.disk_row import OPT_IN_METHODS, bench_disk
from dlo.bench.flags import int_list
from dlo.bench.like import markdown_like, run_like
from dlo.bench.methods import (
    MANUAL_DLO_METHODS,
    METHODS,
    _build_dit,
    _clean,
    _fwd,
    _inputs,
    _max_over_ranks,
    _peak,
    _profile,
    codec_list,
    manual_codecs,
    time_forward,
    time_row,
)
from dlo.bench.peers import _bench_diffusers_group, _bench_swap, _fsdp2
from dlo.bench.report import _ratios, markdown, plot, write_json
from dlo.commands.args import check_minimums, compile_blocks
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.models import get_preset
from dlo.parallel.groups import current_world
from dlo.platform.device import get_platform
from dlo.platform.env import process_rss_bytes
from dlo.platform.progress import progress
from dlo.runtime.measure import (
    GB,
    allgather_bandwidth,
    h2d_limits,
)

logger = logging.getLogger(__name__)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad counts and output paths before anything is measured (``ValueError``
    naming the flag and the value)."""
    check_minimums(
        (
            ("--reps", args.reps, 1),
            ("--warmup", args.warmup, 0),
            ("--nccl-max-ctas", args.nccl_max_ctas, 1),
        )
    )
    for flag, path in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        if path is not None and not os.path.isdir(os.path.dirname(path) or "."):
            raise ValueError(
                f"{flag}={path!r}: its folder {os.path.dirname(path)!r} does not exist"
            )


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every requested method; returns the report (rank 0's view, slowest rank)."""
    world = current_world()
    platform = get_platform(None)
    dtype = getattr(torch, args.dtype)
    # see [Note: bench defaults by platform]
    preset = get_preset(
        default_preset(platform.has_streams) if args.preset is None else args.preset
    )
    tokens_list = int_list(
        "--tokens", default_tokens(preset.name) if args.tokens is None else args.tokens
    )
    slots = int_list("--num-slots", args.num_slots)
    chunks = int_list("--chunk-mb", args.chunk_mb)
    # every (slots, chunk) pair for each manual dlo method; dlo-auto picks its own slots
    settings = [(s, c) for s in slots for c in chunks]
    sweep = len(settings) > 1
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS) - set(OPT_IN_METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; known: {sorted(METHODS + OPT_IN_METHODS)}")
    requested = list(dict.fromkeys(methods))
    if {"dlo-ring", "dlo-rank-local"} & set(methods):
        methods += ["dlo-ring", "dlo-rank-local"]  # the group-of-one ring at any world size
    block_nbytes = preset.block_nbytes(dtype)
    report: dict[str, Any] = {
        "preset": preset.name,
        "dtype": args.dtype,
        "world_size": world.size,
        "device": torch.cuda.get_device_name(platform.device) if platform.has_streams else "cpu",
        "torch": torch.__version__,
        "num_blocks": preset.num_blocks,
        "block_nbytes": block_nbytes,
        "date": time.strftime("%Y-%m-%d"),
        "chunk_mb": chunks,
        "num_slots": slots,
        "compile": args.compile,
        "limits": {},
        "results": [],
    }
    if world.rank == 0:
        logger.warning(
            "dlo bench: preset %s (%d blocks x %.1f MB = %.2f GB, %s), tokens %s, %d rank(s) "
            "on %s; methods: %s",
            preset.name,
            preset.num_blocks,
            block_nbytes / 1e6,
            preset.num_blocks * block_nbytes / 1e9,
            args.dtype,
            ",".join(map(str, tokens_list)),
            world.size,
            report["device"],
            ",".join(requested),
        )
        if not platform.has_streams:
            logger.warning(
                "dlo bench: CPU platform: nothing overlaps (no streams) and every copy is a "
                "memcpy, so the timings and ratios below are NOT meaningful; they check that "
                "every method runs. Measure on a GPU."
            )
    skipped = _skipped(requested, world.size, platform.has_streams)
    for method, why in skipped:
        logger.warning("%s: skipped: %s", method, why)
    if world.rank == 0:
        gone = {m for m, _ in skipped}
        rows = sum(
            len(settings) * len(manual_codecs(codec_list(args.codec)))
            if m in MANUAL_DLO_METHODS
            else 1
            for m in requested
            if m not in gone
        )
        cost = bench_cost(preset, tokens_list, rows, warmup=args.warmup, reps=args.reps)
        rate = None if platform.has_streams else matmul_flops_per_s(dtype)
        logger.warning("dlo bench: about %s", describe(cost, rate))
    lim = report["limits"]
    lim.update(h2d_limits(platform, block_nbytes))
    lim["allgather_GBps"] = allgather_bandwidth(platform, block_nbytes) / GB
    logger.info("limits: %s", lim)

    def record(method: str, tokens: int, timing: dict[str, float], extra: dict[str, Any]) -> None:
        row = {
            "method": method,
            "tokens": tokens,
            "median_ms": _max_over_ranks(timing["median_ms"]),
            "min_ms": _max_over_ranks(timing["min_ms"]),
            "first_forward_ms": _max_over_ranks(timing["first_ms"]),
            "compile": args.compile,
            **extra,
        }
        report["results"].append(row)
        if world.rank == 0:
            logger.warning("%-16s tokens=%-6d %.2f ms", method, tokens, row["median_ms"])
            if args.json:  # a run cut short (a time limit, a failure) keeps the rows it has
                write_json(args.json, {**report, "partial": True})

    streamed_bytes = preset.num_blocks * block_nbytes
    if "resident" in methods:
        dit = compile_blocks(_build_dit(preset.name, platform.device, dtype), args.compile)
        for tokens in tokens_list:
            desc = f"resident tokens={tokens}"
            t = time_row(dit, preset.name, tokens, platform, dtype, args, desc)
            record("resident", tokens, t, {"peak_device_nbytes": _peak(platform)})
        del dit  # nothing may keep the resident model alive into the next method's peak
        _clean(platform)

    cpu_dit: nn.Module | None = None
    # whole blocks first: their disable restores the model; AllGather's disable consumes it
    dlo_methods = (
        ["dlo-ring"]
        if world.size == 1
        else [
            "dlo-rank-local",
            "dlo-node-shared",
            "dlo-allgather",
            "dlo-allgather-copy",
            "dlo-allgather-copy-kernel",
        ]
    )
    # (method, slots, chunk, token counts, block_compute_ms, codec): every manual dlo row
    # runs once per explicit codec (rank-local, node-shared and AllGather all take one)
    codecs = codec_list(args.codec)
    explicit_codecs = manual_codecs(codecs)
    auto_codec = "auto" if "auto" in codecs else "none"  # the dlo-auto rows' policy decides
    runs: list[tuple[str, int | str, int, list[int], float | None, str]] = [
        (m, s, c, tokens_list, None, k)
        for m in dlo_methods
        if m in methods
        for s, c in settings
        for k in explicit_codecs
    ]
    if "dlo-auto" in methods:
        runs.append(("dlo-auto", "auto", chunks[0], tokens_list, None, auto_codec))
    if "dlo-auto-compute" in methods:
        per_block = {
            r["tokens"]: r["median_ms"] / preset.num_blocks
            for r in report["results"]
            if r["method"] == "resident"
        }
        if not per_block:
            logger.warning("dlo-auto-compute: needs the resident rows; method skipped")
        runs += [
            ("dlo-auto-compute", "auto", chunks[0], [t], per_block[t], auto_codec)
            for t in tokens_list
            if t in per_block
        ]
    for method, num_slots, chunk_mb, row_tokens, compute_ms, codec in progress(
        runs, desc="dlo bench: dlo methods", unit="setting"
    ):
        copy = method.startswith("dlo-allgather-copy")
        if copy and not platform.has_streams:
            continue  # said by _skipped
        transfer = (
            "allgather" if method.startswith("dlo-allgather") else
            "node-shared" if method == "dlo-node-shared" else
            "auto" if method.startswith("dlo-auto") else "rank-local"
        )  # fmt: skip
        cpu_dit = cpu_dit or compile_blocks(_build_dit(preset.name, "cpu", dtype), args.compile)
        rss0 = process_rss_bytes()
        cfg = OffloadConfig(
            mode="layer",
            transfer=transfer,
            resident_layers=0,  # the rows measure streaming (the defaults would keep blocks)
            num_slots=num_slots,
            chunk_mb=chunk_mb,
            verify_block_sequence=not args.no_verify,
            nccl_max_ctas=args.nccl_max_ctas,
            # dlo-auto: the defaults' engine choice; the manual AllGather rows name theirs
            gather_engine="copy" if copy else "auto" if transfer == "auto" else "nccl",
            gather_sync="kernel" if method.endswith("-kernel") else "auto",
            block_compute_ms=compute_ms,
            codec=codec,
        )
        backend = get_offload_backend(cfg, ParallelConfig.for_world(world.size))
        assert backend is not None
        platform.reset_peak_memory_stats()
        t0 = time.perf_counter()
        backend.enable(cpu_dit)
        enable_s = time.perf_counter() - t0
        bw = lim["h2d_pinned_concurrent_GBps" if world.size > 1 else "h2d_pinned_alone_GBps"]
        for tokens in row_tokens:
            inp = _inputs(preset.name, tokens, platform.device, dtype)
            st0 = backend.stats()
            fwd = _fwd(cpu_dit, inp)
            # every row: its own forwards' peak (not enable's transients, not a larger row's)
            platform.reset_peak_memory_stats()
            label = f"{method} tokens={tokens}" + (f" codec={codec}" if codec != "none" else "")
            t = time_forward(fwd, platform, warmup=args.warmup, reps=args.reps, desc=label)
            st = backend.stats()
            if args.profile:  # every rank runs the forward; rank 0 writes the files
                tag = f"{method}_s{num_slots}_c{chunk_mb}" if sweep else method
                _profile(
                    fwd, platform, args.profile if world.rank == 0 else None, f"{tag}_{tokens}"
                )
            # what crossed this rank's link per forward: its shards, or whole blocks (rank-
            # local, node-shared: not the 1/L of host memory a node-shared rank is charged)
            fwds = t["forwards"]
            link_nbytes = (st["h2d_nbytes"] - st0["h2d_nbytes"]) / fwds
            # with a codec the limit is the raw bytes' (what the codec spares the link)
            decoded = st["decoded_nbytes"] - st0["decoded_nbytes"]
            encoded = st["encoded_h2d_nbytes"] - st0["encoded_h2d_nbytes"]
            raw_nbytes = link_nbytes + (decoded - encoded) / fwds
            limit_ms = raw_nbytes / (bw * GB) * 1e3 if bw else 0.0
            record(
                method,
                tokens,
                t,
                {
                    "h2d_limit_ms": limit_ms,
                    "exposed_wait_ms_per_fwd": (st["exposed_wait_ms"] - st0["exposed_wait_ms"])
                    / fwds,
                    "peak_device_nbytes": _peak(platform, st),
                    "device_slot_nbytes": st["device_slot_nbytes"],
                    "device_non_block_nbytes": st["device_non_block_nbytes"],
                    "host_pinned_nbytes": st["host_pinned_nbytes"],
                    "host_nbytes": st["host_nbytes"],
                    "rss_delta_nbytes": process_rss_bytes() - rss0,
                    "enable_s": enable_s,
                    "transfer": st["transfer"],
                    "num_slots": st["num_slots"],
                    "chunk_mb": chunk_mb,
                    "gather_sync": st.get("gather_sync"),
                    "setting": ", ".join(
                        ([f"{st['num_slots']} slots, {chunk_mb} MiB"] if sweep else [])
                        + (
                            [
                                f"codec {codec}: {st['codec']} ({st['codec_ratio']:.3f} of the "
                                f"bytes; decode {st['decode_gbps']:.0f} GB/s, "
                                f"+{st['decode_tail_ms_per_load']:.2f} ms per load)"
                            ]
                            if codec != "none"
                            else []
                        )
                    )
                    or None,
                    "codec": codec,
                    "codec_ratio": st["codec_ratio"],
                    "link_h2d_limit_ms": link_nbytes / (bw * GB) * 1e3 if bw else 0.0,
                    "host_encoded_nbytes": st["host_encoded_nbytes"],
                    "decode_ms_per_load": st["decode_ms_per_load"],
                    "decode_tail_ms_per_load": st["decode_tail_ms_per_load"],
                    "decode_gbps": st["decode_gbps"],
                },
            )
            if st.get("policy") is not None:
                report.setdefault("policy", st["policy"])
        backend.disable()
        if st["transfer"] == "allgather" and st["group_size"] > 1:
            cpu_dit = None  # its streamed tensors are gone (see [Note: what disable restores])
        _clean(platform)

    if "fsdp2-offload" in methods and world.size > 1 and platform.has_streams:
        del cpu_dit
        cpu_dit = None
        _clean(platform)
        dit = _build_dit(preset.name, "cpu", dtype)
        _fsdp2(dit, world.size, platform)
        compile_blocks(dit, args.compile)
        for tokens in tokens_list:
            desc = f"fsdp2-offload tokens={tokens}"
            t = time_row(dit, preset.name, tokens, platform, dtype, args, desc)
            record("fsdp2-offload", tokens, t, {"peak_device_nbytes": _peak(platform)})
        del dit
        _clean(platform)

    if "diffusers-group" in methods:
        _bench_diffusers_group(preset.name, platform, dtype, tokens_list, args, record)

    if "dlo-disk" in methods and world.size == 1:  # [issue 37] opt-in: it writes to disk
        bench_disk(preset.name, platform, dtype, tokens_list, args, record, lim)
    if "dlo-swap" in methods and world.size == 1 and platform.has_streams:
        report["swap"] = _bench_swap(
            preset.name, platform, dtype, lim["h2d_pinned_alone_GBps"], reps=args.reps
        )
        _clean(platform)

    _ratios(report, streamed_bytes)
    return report


def _skipped(methods: list[str], world_size: int, gpus: bool) -> list[tuple[str, str]]:
    """The requested methods this run cannot measure, and why."""
    out = []
    for m in dict.fromkeys(methods):
        if m == "dlo-ring" and world_size > 1:
            out.append((m, f"one rank only (this run has {world_size}; see dlo-rank-local)"))
        elif (
            m in MANUAL_DLO_METHODS and m not in ("dlo-ring", "dlo-rank-local") and world_size == 1
        ):
            out.append((m, "needs 2 or more ranks (torchrun --nproc-per-node=N)"))
        elif m == "dlo-rank-local" and world_size == 1:
            out.append((m, "with one rank it is dlo-ring (reported under that name)"))
        elif m.startswith("dlo-allgather-copy") and not gpus:
            out.append((m, "the copy-engine gather needs CUDA GPUs with peer access"))
        elif m == "fsdp2-offload" and (world_size == 1 or not gpus):
            out.append((m, "needs 2 or more CUDA ranks"))
        elif m in ("dlo-swap", "dlo-disk") and world_size > 1:
            out.append((m, "one rank only"))
        elif m == "dlo-swap" and not gpus:
            out.append((m, "its load times need CUDA streams and events"))
        elif m == "diffusers-group" and not gpus:
            out.append((m, "needs CUDA streams"))
    return out


def main(args: argparse.Namespace) -> int:
    if args.like is not None:
        check_args(args)
        check_minimums((("--like-slots", args.like_slots, 1),))
        methods = [m for m in args.methods.split(",") if m]
        tokens = int_list("--tokens", LIKE_DEFAULT_TOKENS if args.tokens is None else args.tokens)
        if args.budgets is not None:
            report = like_budgets(args, tokens, methods)
            _write(args, report, markdown_budgets(report["results"], capped=report["capped"]))
            return 0
        if args.methods == ",".join(METHODS):  # the default: the three --like serves
            methods = ["resident", "dlo-ring", "diffusers-group"]
        report = run_like(args, tokens, methods)
        _write(args, report, markdown_like(report))
        return 0
    if args.budgets is not None:
        raise ValueError(f"--budgets={args.budgets!r} needs --like NAME")
    report = run_bench(args)
    if current_world().rank == 0:
        _write(args, report, markdown(report))
        if args.plot:
            plot(report, args.plot)
    return 0


def _write(args: argparse.Namespace, report: dict[str, Any], text: str) -> None:
    """Print the table; write the JSON and markdown files the flags ask for."""
    print(text)
    if args.json:
        write_json(args.json, report)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")
