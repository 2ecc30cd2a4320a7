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
import gc
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dlo.backends.factory import get_offload_backend
from dlo.config import OffloadConfig, ParallelConfig
from dlo.measure import (
    GB,
    allgather_bandwidth,
    barrier,
    device_peak_nbytes,
    h2d_limits,
    over_ranks,
    sample_seconds,
)
from dlo.models import build_pipeline, get_preset
from dlo.parallel import current_world
from dlo.platform import Platform, get_platform, process_rss_bytes

logger = logging.getLogger(__name__)

METHODS = (
    "resident",
    "dlo-ring",
    "dlo-rank-local",
    "dlo-node-shared",
    "dlo-allgather",
    "dlo-allgather-copy",
    "dlo-allgather-copy-kernel",
    "dlo-auto",
    "dlo-auto-compute",
    "dlo-swap",
    "fsdp2-offload",
    "diffusers-group",
)
"""Every method ``--methods`` accepts (each runs where the platform and world size allow)."""


# ----------------------------------------------------------------------------- timing
def time_forward(
    fn: Callable[[], Any], platform: Platform, *, warmup: int, reps: int
) -> dict[str, float]:
    """Median/min device time of ``fn`` in ms (wall time on the CPU platform)."""
    for _ in range(warmup):
        fn()
    barrier()
    times = [t * 1e3 for t in sample_seconds(platform, fn, reps)]
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def _max_over_ranks(value: float) -> float:
    return max(over_ranks(value))


# ----------------------------------------------------------------------------- methods
def _inputs(preset: str, tokens: int, device: torch.device, dtype: torch.dtype) -> tuple[Any, ...]:
    p = get_preset(preset)
    g = torch.Generator().manual_seed(1234 + tokens)
    latents = torch.randn(1, tokens, p.latent_channels, generator=g).to(device, dtype)
    text = torch.randn(1, p.text_len, p.text_dim, generator=g).to(device, dtype)
    t = torch.full((1,), 500.0, device=device)
    return latents, t, text


def _build_dit(preset: str, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    return build_pipeline(preset, dtype=dtype, device=device).transformer


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad counts and output paths before anything is measured (``ValueError``
    naming the flag and the value)."""
    for flag, value, minimum in (
        ("--reps", args.reps, 1),
        ("--warmup", args.warmup, 0),
        ("--nccl-max-ctas", args.nccl_max_ctas, 1),
    ):
        if value is not None and value < minimum:
            raise ValueError(f"{flag}={value} must be >= {minimum}")
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
    preset = get_preset(args.preset)
    tokens_list = int_list("--tokens", args.tokens)
    slots = int_list("--num-slots", args.num_slots)
    chunks = int_list("--chunk-mb", args.chunk_mb)
    # every (slots, chunk) pair for each manual dlo method; dlo-auto picks its own slots
    settings = [(s, c) for s in slots for c in chunks]
    sweep = len(settings) > 1
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; known: {sorted(METHODS)}")
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
        "limits": {},
        "results": [],
    }
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
            **extra,
        }
        report["results"].append(row)
        if world.rank == 0:
            logger.warning("%-16s tokens=%-6d %.2f ms", method, tokens, row["median_ms"])
            if args.json:  # a run cut short (a time limit, a failure) keeps the rows it has
                write_json(args.json, {**report, "partial": True})

    streamed_bytes = preset.num_blocks * block_nbytes
    if "resident" in methods:
        dit = _build_dit(preset.name, platform.device, dtype)
        for tokens in tokens_list:
            inp = _inputs(preset.name, tokens, platform.device, dtype)
            fwd = _fwd(dit, inp)
            platform.reset_peak_memory_stats()  # every row: its own forwards' peak
            t = time_forward(fwd, platform, warmup=args.warmup, reps=args.reps)
            record("resident", tokens, t, {"peak_device_nbytes": _peak(platform)})
            del fwd, inp
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
    # (method, slots, chunk, token counts, block_compute_ms)
    runs: list[tuple[str, int | str, int, list[int], float | None]] = [
        (m, s, c, tokens_list, None) for m in dlo_methods if m in methods for s, c in settings
    ]
    if "dlo-auto" in methods:
        runs.append(("dlo-auto", "auto", chunks[0], tokens_list, None))
    if "dlo-auto-compute" in methods:
        per_block = {
            r["tokens"]: r["median_ms"] / preset.num_blocks
            for r in report["results"]
            if r["method"] == "resident"
        }
        if not per_block:
            logger.warning("dlo-auto-compute: needs the resident rows; method skipped")
        runs += [
            ("dlo-auto-compute", "auto", chunks[0], [t], per_block[t])
            for t in tokens_list
            if t in per_block
        ]
    for method, num_slots, chunk_mb, row_tokens, compute_ms in runs:
        copy = method.startswith("dlo-allgather-copy")
        if copy and not platform.has_streams:
            logger.warning("%s: needs CUDA GPUs; method skipped", method)
            continue
        transfer = (
            "allgather" if method.startswith("dlo-allgather") else
            "node-shared" if method == "dlo-node-shared" else
            "auto" if method.startswith("dlo-auto") else "rank-local"
        )  # fmt: skip
        cpu_dit = cpu_dit or _build_dit(preset.name, "cpu", dtype)
        rss0 = process_rss_bytes()
        cfg = OffloadConfig(
            mode="layer",
            transfer=transfer,
            num_slots=num_slots,
            chunk_mb=chunk_mb,
            verify_block_sequence=not args.no_verify,
            nccl_max_ctas=args.nccl_max_ctas,
            # dlo-auto: the defaults' engine choice; the manual AllGather rows name theirs
            gather_engine="copy" if copy else "auto" if transfer == "auto" else "nccl",
            gather_sync="kernel" if method.endswith("-kernel") else "auto",
            block_compute_ms=compute_ms,
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
            t = time_forward(fwd, platform, warmup=args.warmup, reps=args.reps)
            st = backend.stats()
            if args.profile:  # every rank runs the forward; rank 0 writes the files
                tag = f"{method}_s{num_slots}_c{chunk_mb}" if sweep else method
                _profile(
                    fwd, platform, args.profile if world.rank == 0 else None, f"{tag}_{tokens}"
                )
            # what crossed this rank's link per forward: its shards, or whole blocks (rank-
            # local, node-shared: not the 1/L of host memory a node-shared rank is charged)
            fwds = args.reps + args.warmup
            link_nbytes = (st["h2d_nbytes"] - st0["h2d_nbytes"]) / fwds
            limit_ms = link_nbytes / (bw * GB) * 1e3 if bw else 0.0
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
                    "setting": f"{st['num_slots']} slots, {chunk_mb} MiB" if sweep else None,
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
        for tokens in tokens_list:
            inp = _inputs(preset.name, tokens, platform.device, dtype)
            platform.reset_peak_memory_stats()
            t = time_forward(_fwd(dit, inp), platform, warmup=args.warmup, reps=args.reps)
            record("fsdp2-offload", tokens, t, {"peak_device_nbytes": _peak(platform)})
        del dit
        _clean(platform)

    if "diffusers-group" in methods:
        _bench_diffusers_group(preset.name, platform, dtype, tokens_list, args, record)

    if "dlo-swap" in methods and world.size == 1:
        report["swap"] = _bench_swap(
            preset.name, platform, dtype, lim["h2d_pinned_alone_GBps"], reps=args.reps
        )
        _clean(platform)

    _ratios(report, streamed_bytes)
    return report


def _bench_diffusers_group(
    preset: str,
    platform: Platform,
    dtype: torch.dtype,
    tokens_list: list[int],
    args: argparse.Namespace,
    record: Callable[[str, int, dict[str, float], dict[str, Any]], None],
) -> None:
    """diffusers group offloading, block level, one block per group, with streams (the
    peer's fastest documented setting), on the same DiT and inputs; skipped (logged) when
    diffusers is not installed or there are no streams."""
    try:
        from diffusers.hooks import apply_group_offloading
    except ImportError:
        logger.warning("diffusers-group: diffusers is not installed; method skipped")
        return
    if not platform.has_streams:
        logger.warning("diffusers-group: needs CUDA streams; method skipped on CPU")
        return
    dit = _build_dit(preset, "cpu", dtype)
    t0 = time.perf_counter()
    apply_group_offloading(
        dit,
        onload_device=platform.device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=True,
    )
    enable_s = time.perf_counter() - t0
    for tokens in tokens_list:
        inp = _inputs(preset, tokens, platform.device, dtype)
        platform.reset_peak_memory_stats()
        t = time_forward(_fwd(dit, inp), platform, warmup=args.warmup, reps=args.reps)
        record(
            "diffusers-group",
            tokens,
            t,
            {"peak_device_nbytes": _peak(platform), "enable_s": enable_s},
        )
        del inp
    del dit
    _clean(platform)


def _bench_swap(
    preset: str, platform: Platform, dtype: torch.dtype, bw_gbps: float, *, reps: int
) -> list[dict[str, Any]]:
    """Model-level swap: time of each component's load against bytes / pinned H2D bandwidth."""
    from dlo.models import make_inputs

    pipe = build_pipeline(preset, dtype=dtype, device="cpu")
    backend = get_offload_backend(OffloadConfig(mode="module"), ParallelConfig())
    assert backend is not None
    backend.enable(pipe)
    ids, latents = make_inputs(preset, tokens=256, device=platform.device, dtype=dtype)
    t = torch.full((1,), 500.0, device=platform.device)
    with torch.inference_mode():
        for _ in range(reps + 1):  # each round loads the encoder, then the DiT
            text = pipe.encode(ids)
            pipe.transformer(latents, t, text)
    st = backend.stats()["components"]
    backend.disable()
    rows = []
    for path, c in st.items():
        if not c["timed_loads"]:
            continue
        ms = c["load_ms"] / c["timed_loads"]
        limit = c["nbytes"] / (bw_gbps * GB) * 1e3 if bw_gbps else 0.0
        rows.append(
            {
                "component": path,
                "nbytes": c["nbytes"],
                "load_ms": ms,
                "h2d_limit_ms": limit,
                "x_h2d_limit": ms / limit if limit else None,
            }
        )
        logger.warning(
            "dlo-swap %-14s %.1f MB in %.2f ms (x%.3f of the H2D limit)",
            path,
            c["nbytes"] / 1e6,
            ms,
            ms / limit if limit else float("nan"),
        )
    return rows


def _profile(fn: Callable[[], Any], platform: Platform, folder: str | None, name: str) -> None:
    """One forward under the torch profiler: a gzipped chrome trace and a kernel table."""
    import os

    from torch.profiler import ProfilerActivity, profile

    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if platform.has_streams:
        activities.append(ProfilerActivity.CUDA)
    platform.synchronize()
    with profile(activities=activities) as prof:
        fn()
        platform.synchronize()
    if folder is None:
        return
    prof.export_chrome_trace(os.path.join(folder, f"{name}.json.gz"))
    sort = "cuda_time_total" if platform.has_streams else "cpu_time_total"
    with open(os.path.join(folder, f"{name}.txt"), "w") as fh:
        fh.write(prof.key_averages().table(sort_by=sort, row_limit=30))


def _fsdp2(dit: nn.Module, world_size: int, platform: Platform) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cuda", (world_size,))
    policy = CPUOffloadPolicy(pin_memory=True)
    for blk in dit.blocks:  # type: ignore[union-attr]
        fully_shard(blk, mesh=mesh, offload_policy=policy)
    fully_shard(dit, mesh=mesh, offload_policy=policy)


def _fwd(model: nn.Module, inp: tuple[Any, ...]) -> Callable[[], Any]:
    def fn() -> Any:
        with torch.no_grad():
            return model(*inp)

    return fn


def _peak(platform: Platform, stats: dict[str, Any] | None = None) -> int:
    return int(_max_over_ranks(device_peak_nbytes(platform, stats)))


def _clean(platform: Platform) -> None:
    gc.collect()
    platform.synchronize()
    platform.empty_cache()
    platform.reset_peak_memory_stats()


MANUAL_DLO_METHODS = (
    "dlo-ring",
    "dlo-rank-local",
    "dlo-node-shared",
    "dlo-allgather",
    "dlo-allgather-copy",
    "dlo-allgather-copy-kernel",
)
"""The dlo methods with hand-picked settings (``dlo-auto`` is compared against them)."""
AUTO_METHODS = ("dlo-auto", "dlo-auto-compute")


def int_list(flag: str, text: Any) -> list[int]:
    """``"2,3"`` -> ``[2, 3]``: positive ints, or a ValueError naming the flag and value."""
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag}={text!r}: expected positive integers separated by commas")
    return values


def label(row: dict[str, Any]) -> str:
    """A result row's name in tables and plots: the method, with its setting in a sweep."""
    setting = row.get("setting")
    return f"{row['method']} [{setting}]" if setting else str(row["method"])


def _listed(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _ratios(report: dict[str, Any], streamed_bytes: int) -> None:
    resident = {r["tokens"]: r["median_ms"] for r in report["results"] if r["method"] == "resident"}
    # the two sides of the ring per block: compute (resident) and one block's copy
    lim = report["limits"]
    lim["resident_ms_per_block"] = {
        str(t): ms / report["num_blocks"] for t, ms in sorted(resident.items())
    }
    bw = lim.get("h2d_pinned_alone_GBps") or 0.0
    lim["h2d_ms_per_block"] = report["block_nbytes"] / (bw * GB) * 1e3 if bw else None
    for r in report["results"]:
        base = resident.get(r["tokens"])
        r["x_resident"] = r["median_ms"] / base if base else None
        lim = r.get("h2d_limit_ms")
        r["x_h2d_limit"] = r["median_ms"] / lim if lim else None
    best_peer: dict[int, float] = {}
    for r in report["results"]:
        if r["method"].startswith(("fsdp2", "diffusers")):
            best_peer[r["tokens"]] = min(best_peer.get(r["tokens"], float("inf")), r["median_ms"])
    for r in report["results"]:
        peer = best_peer.get(r["tokens"])
        r["x_best_peer"] = r["median_ms"] / peer if peer else None
    # the automatic policy against the best manual dlo setting of this run (issue: <= 1.05)
    manual: dict[int, float] = {}
    for r in report["results"]:
        if r["method"] in MANUAL_DLO_METHODS:
            manual[r["tokens"]] = min(manual.get(r["tokens"], float("inf")), r["median_ms"])
    for r in report["results"]:
        if r["method"] in AUTO_METHODS:  # null: no manual row at these tokens in this run
            best = manual.get(r["tokens"])
            r["x_best_manual"] = r["median_ms"] / best if best else None


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    lim = report["limits"]
    lines = [
        f"{report['preset']} ({report['num_blocks']} blocks x {report['block_nbytes'] / 1e6:.0f} MB,"
        f" {report['dtype']}), {report['world_size']} x {report['device']}, torch "
        f"{report['torch']}, {report['date']}; chunk {_listed(report['chunk_mb'])} MiB, "
        f"{_listed(report['num_slots'])} slots",
        "",
        f"Limits: pinned H2D {lim['h2d_pinned_alone_GBps']:.1f} GB/s alone, "
        f"{lim['h2d_pinned_concurrent_GBps']:.1f} GB/s per rank with all ranks copying; pageable "
        f"{lim['h2d_pageable_GBps']:.1f} GB/s; AllGather {lim['allgather_GBps']:.1f} GB/s.",
        "Per block: one pinned copy "
        + (f"{lim['h2d_ms_per_block']:.2f} ms" if lim.get("h2d_ms_per_block") else "-")
        + "; resident compute "
        + (
            ", ".join(
                f"{ms:.2f} ms at {t} tokens"
                for t, ms in lim.get("resident_ms_per_block", {}).items()
            )
            or "-"
        )
        + ".",
        "",
        "| method | tokens | ms / forward | x resident | x H2D limit | x best peer | peak HBM GB |"
        " pinned host GB / rank |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def f(v: Any, fmt: str = "{:.3f}") -> str:
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    for r in report["results"]:
        name = label(r)
        if r["method"] in AUTO_METHODS:
            vs = r.get("x_best_manual")
            versus = f"x{f(vs)} best manual" if vs is not None else "no manual row"
            name += f" ({r['transfer']}, {r['num_slots']} slots, {versus})"
        lines.append(
            f"| {name} | {r['tokens']} | {r['median_ms']:.1f} | {f(r['x_resident'])} | "
            f"{f(r['x_h2d_limit'])} | {f(r['x_best_peer'])} | "
            f"{r['peak_device_nbytes'] / GB:.2f} | {_pinned_gb(r)} |"
        )
    if report.get("swap"):
        lines += ["", "| swap component | MB | load ms | x H2D limit |", "|---|---|---|---|"]
        for r in report["swap"]:
            lines.append(
                f"| {r['component']} | {r['nbytes'] / 1e6:.1f} | {r['load_ms']:.2f} | "
                f"{f(r['x_h2d_limit'])} |"
            )
    return "\n".join(lines)


def _pinned_gb(row: dict[str, Any]) -> str:
    """dlo's pinned bytes per rank; "-" for methods whose host memory dlo does not manage."""
    nbytes = row.get("host_pinned_nbytes")
    return f"{nbytes / GB:.2f}" if nbytes is not None else "-"


def plot(report: dict[str, Any], path: str) -> None:
    """Time per forward vs tokens for each method, and peak device memory per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = sorted({label(r) for r in report["results"]})
    for m in methods:
        rows = sorted((r for r in report["results"] if label(r) == m), key=lambda r: r["tokens"])
        ax_t.plot([r["tokens"] for r in rows], [r["median_ms"] for r in rows], marker="o", label=m)
    # one dashed line per distinct limit (rank-local rows move every byte, AllGather 1/G)
    limits: dict[float, list[str]] = {}
    for r in report["results"]:
        if r.get("h2d_limit_ms"):
            names = limits.setdefault(round(r["h2d_limit_ms"], 3), [])
            if r["method"] not in names:
                names.append(r["method"])
    tokens = sorted({r["tokens"] for r in report["results"]})
    for ms, names in sorted(limits.items()):
        ax_t.hlines(
            ms,
            min(tokens),
            max(tokens),
            colors="gray",
            linestyles="dashed",
            label=f"H2D limit of {', '.join(names)}",
        )
    ax_t.set_xlabel("tokens")
    ax_t.set_ylabel("ms / forward (median)")
    ax_t.set_xscale("log", base=2)
    ax_t.legend(fontsize=8)
    peaks = [
        max(r["peak_device_nbytes"] for r in report["results"] if label(r) == m) / GB
        for m in methods
    ]
    ax_m.barh(methods, peaks)
    ax_m.set_xlabel("peak device memory, GB")
    fig.suptitle(
        f"{report['preset']} on {report['world_size']} x {report['device']}, "
        f"torch {report['torch']}, {report['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="medium")
    p.add_argument("--tokens", default="4096,16384", help="comma-separated token counts")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated; each runs where the platform and world size allow",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--num-slots", default="2", help="slots of the dlo methods; a comma list sweeps them"
    )
    p.add_argument(
        "--chunk-mb", default="64", help="chunk MiB of the dlo methods; a comma list sweeps them"
    )
    p.add_argument("--no-verify", action="store_true", help="skip the lock-step check")
    p.add_argument(
        "--nccl-max-ctas", type=int, default=None, help="cap the SMs NCCL may use for dlo's gathers"
    )
    p.add_argument(
        "--profile",
        default=None,
        help="folder for one profiled forward per dlo method and token count",
    )
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--markdown", default=None, help="write the markdown table here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")


def write_json(path: str, report: dict[str, Any]) -> None:
    """Replace ``path`` with ``report`` in one step (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=2)
    os.replace(tmp, path)


def main(args: argparse.Namespace) -> int:
    report = run_bench(args)
    if current_world().rank == 0:
        text = markdown(report)
        print(text)
        if args.json:
            write_json(args.json, report)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write(text + "\n")
        if args.plot:
            plot(report, args.plot)
    return 0
