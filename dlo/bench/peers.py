"""The peers ``dlo bench`` measures dlo against: diffusers group offloading, FSDP2 with CPU
offload, dlo's own model-level swap.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dlo.backends.factory import get_offload_backend
from dlo.bench.methods import _build_dit, _clean, _peak, time_row
from dlo.commands.args import compile_blocks
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.models import build_pipeline
from dlo.platform.device import Platform
from dlo.runtime.measure import (
    GB,
)

logger = logging.getLogger(__name__)


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
    if importlib.util.find_spec("diffusers") is None:
        logger.warning("diffusers-group: diffusers is not installed; method skipped")
        return
    if not platform.has_streams:  # said by the runner's _skipped
        return
    dit = _build_dit(preset, "cpu", dtype)
    t0 = time.perf_counter()
    apply_diffusers_group(dit, platform.device, record_stream=False)
    enable_s = time.perf_counter() - t0
    compile_blocks(dit, args.compile)  # after the hooks, as diffusers documents
    for tokens in tokens_list:
        t = time_row(dit, preset, tokens, platform, dtype, args, f"diffusers-group tokens={tokens}")
        record(
            "diffusers-group",
            tokens,
            t,
            {"peak_device_nbytes": _peak(platform), "enable_s": enable_s},
        )
    del dit
    _clean(platform)


def apply_diffusers_group(model: nn.Module, device: torch.device, *, record_stream: bool) -> None:
    """diffusers group offloading as the bench runs it: block level, one block per group,
    on streams (its fastest documented setting)."""
    from diffusers.hooks import apply_group_offloading

    apply_group_offloading(
        model,
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=True,
        record_stream=record_stream,
    )


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


def _fsdp2(dit: nn.Module, world_size: int, platform: Platform) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cuda", (world_size,))
    policy = CPUOffloadPolicy(pin_memory=True)
    for blk in dit.blocks:  # type: ignore[union-attr]
        fully_shard(blk, mesh=mesh, offload_policy=policy)
    fully_shard(dit, mesh=mesh, offload_policy=policy)
