"""Timing one bench method: building the benchmark DiT and its inputs, timing forwards on every
rank, peak device memory, profiling.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dlo.config.fields import CODECS
from dlo.models.build import build_pipeline
from dlo.models.presets import get_preset
from dlo.platform.device import Platform
from dlo.platform.progress import progress_bar
from dlo.runtime.measure import barrier, device_peak_nbytes, over_ranks, sample_seconds

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


METHODS = (
    "resident",
    *MANUAL_DLO_METHODS,
    *AUTO_METHODS,
    "dlo-swap",
    "fsdp2-offload",
    "diffusers-group",
)
"""Every method ``--methods`` accepts (each runs where the platform and world size allow)."""


# ----------------------------------------------------------------------------- timing
def time_forward(
    fn: Callable[[], Any], platform: Platform, *, warmup: int, reps: int, desc: str = "forwards"
) -> dict[str, float]:
    """Median/min device time of ``fn`` in ms (wall time on the CPU platform), and the wall
    time of the first call (``first_ms``: with ``--compile``, the compile of the first
    forward is in it), and how many forwards ran (``forwards``: that first one runs even
    with ``warmup=0``). ``desc`` names the row in its progress (rank 0), one step a forward
    and never inside a timed span."""
    num_forwards = max(1, warmup) + reps
    bar = progress_bar(total=num_forwards, desc=f"dlo bench: {desc}", unit="forward")
    with contextlib.closing(bar):
        t0 = time.perf_counter()
        fn()  # the first warm-up forward (one even without warm-up: its time is reported)
        platform.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        bar.update(1)
        for _ in range(max(0, warmup - 1)):
            fn()
            bar.update(1)
        barrier()
        times = [t * 1e3 for t in sample_seconds(platform, fn, reps, on_sample=bar.update)]
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "first_ms": first_ms,
        "forwards": float(num_forwards),  # every forward run, for per-forward stats
    }


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


def time_row(
    dit: nn.Module,
    preset: str,
    tokens: int,
    platform: Platform,
    dtype: torch.dtype,
    args: Any,
    desc: str,
) -> dict[str, float]:
    """:func:`time_forward` of ``dit`` on the preset's inputs at ``tokens`` (``args.warmup``
    and ``args.reps`` forwards), the device's peak reset first: every row its own forwards'
    peak. The inputs are freed on return."""
    inp = _inputs(preset, tokens, platform.device, dtype)
    platform.reset_peak_memory_stats()
    return time_forward(_fwd(dit, inp), platform, warmup=args.warmup, reps=args.reps, desc=desc)


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


def codec_list(text: Any) -> list[str]:
    """``--codec``: the comma-separated codecs of the whole-block dlo rows."""
    names = [c for c in str(text).split(",") if c]
    bad = [c for c in names if c not in CODECS]
    if bad or not names:
        raise ValueError(f"--codec: {bad or text!r} not among {list(CODECS)}")
    return list(dict.fromkeys(names))


def manual_codecs(names: list[str]) -> list[str]:
    """The codecs a row with explicit settings runs from ``--codec``: ``"auto"`` is the
    automatic rows' (without a compute time it would only repeat ``"none"``)."""
    return [c for c in names if c != "auto"] or ["none"]
