"""``dlo bench --like NAME``: a real diffusers transformer at its published shape, with random
weights (nothing downloaded), under resident, dlo's ring and diffusers group offloading in
one run, against the measured host-to-device limit.

Random weights are a proxy for speed and memory, never for anything that depends on the
values. Each method gets its own build of the model (the same seed), so none inherits
another's host or device state. Rows carry the ring's demand loads after warm-up (zero when
the prefetch chain covers every stack seam, see [Note: prefetch chain] in
:mod:`dlo.runtime.chain`) and the bytes it copied per forward.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dlo.backends.factory import enable_offload
from dlo.bench.methods import _clean, _peak, codec_list, manual_codecs, time_forward
from dlo.bench.peers import apply_diffusers_group
from dlo.config.offload import OffloadConfig
from dlo.pipelines.classes import quiet_imports
from dlo.pipelines.layouts import FLUX_DEV_TRANSFORMER, TINY_FLUX_TRANSFORMER, WAN_14B_TRANSFORMER
from dlo.pipelines.synth import fill_random, no_init
from dlo.platform.device import Platform, get_platform
from dlo.runtime.measure import GB, h2d_limits

logger = logging.getLogger(__name__)


Inputs = Callable[[int, torch.device, torch.dtype, torch.Generator], dict[str, Any]]


@dataclass(frozen=True)
class Like:
    """A diffusers transformer class and its published config."""

    name: str
    cls: str
    """``module:Class`` in diffusers."""
    config: dict[str, Any]
    inputs: Inputs
    """``inputs(tokens, device, dtype, generator)``: forward kwargs for ``tokens`` tokens."""
    tokens_help: str


def _randn(g: torch.Generator, *shape: int, device: torch.device, dtype: torch.dtype) -> Any:
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _flux_inputs(
    tokens: int, device: torch.device, dtype: torch.dtype, g: torch.Generator, *, text: int = 512
) -> dict[str, Any]:
    side = int(tokens**0.5)
    if side * side != tokens:
        raise ValueError(f"--tokens {tokens} for a FLUX image must be a square (4096: 1024 px)")
    ids = torch.zeros(tokens, 3)
    ids[:, 1] = torch.arange(side).repeat_interleave(side)
    ids[:, 2] = torch.arange(side).repeat(side)
    return {
        "hidden_states": _randn(g, 1, tokens, 64, device=device, dtype=dtype),
        "encoder_hidden_states": _randn(g, 1, text, 4096, device=device, dtype=dtype),
        "pooled_projections": _randn(g, 1, 768, device=device, dtype=dtype),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "guidance": torch.full((1,), 3.5, device=device, dtype=dtype),
        "img_ids": ids.to(device),
        "txt_ids": torch.zeros(text, 3, device=device),
        "return_dict": False,
    }


def _wan_inputs(
    tokens: int, device: torch.device, dtype: torch.dtype, g: torch.Generator
) -> dict[str, Any]:
    per_frame = 30 * 52  # 480 x 832 px: a 60 x 104 latent, patches of 2 x 2
    if tokens % per_frame:
        raise ValueError(
            f"--tokens {tokens} for Wan 480p must be a multiple of {per_frame} (one latent "
            "frame: 1560 is 1 frame, 32760 is 81 frames)"
        )
    frames = tokens // per_frame
    return {
        "hidden_states": _randn(g, 1, 16, frames, 60, 104, device=device, dtype=dtype),
        "timestep": torch.full((1,), 500, device=device, dtype=torch.long),
        "encoder_hidden_states": _randn(g, 1, 512, 4096, device=device, dtype=dtype),
        "return_dict": False,
    }


def _tiny_flux_inputs(
    tokens: int, device: torch.device, dtype: torch.dtype, g: torch.Generator
) -> dict[str, Any]:
    inputs = _flux_inputs(tokens, device, dtype, g, text=8)
    inputs["encoder_hidden_states"] = _randn(g, 1, 8, 32, device=device, dtype=dtype)
    inputs["pooled_projections"] = _randn(g, 1, 32, device=device, dtype=dtype)
    return inputs


_FLUX = "diffusers.models.transformers.transformer_flux:FluxTransformer2DModel"


LIKE: dict[str, Like] = {
    like.name: like
    for like in (
        # black-forest-labs/FLUX.1-dev, transformer/config.json
        Like(
            "flux.1-dev",
            _FLUX,
            FLUX_DEV_TRANSFORMER,
            _flux_inputs,
            "image tokens (a square: 4096 is 1024 x 1024 px)",
        ),
        # Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json
        Like(
            "wan2.1-t2v-14b",
            "diffusers.models.transformers.transformer_wan:WanTransformer3DModel",
            WAN_14B_TRANSFORMER,
            _wan_inputs,
            "video tokens at 480p (1560 per latent frame: 1560 is 1 frame, 32760 is 81)",
        ),
        # the same class at a size CPU tests run
        Like(
            "tiny-flux",
            _FLUX,
            TINY_FLUX_TRANSFORMER,
            _tiny_flux_inputs,
            "image tokens (a square)",
        ),
    )
}


def build(like: Like, dtype: torch.dtype, *, seed: int = 0) -> nn.Module:
    """``like``'s class on the CPU, weights from a pool of N(0, 0.02) values drawn with
    ``seed`` (:func:`~dlo.pipelines.synth.fill_random`)."""
    module, _, name = like.cls.partition(":")
    with quiet_imports():
        cls = getattr(importlib.import_module(module), name)
    with no_init(dtype):
        model = cls(**like.config)
    return fill_random(model, dtype, seed=seed)


def model_nbytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.parameters())


def check_like_input(
    like: Like,
    dtype: torch.dtype,
    tokens_list: list[int],
    methods: list[str],
    known: tuple[str, ...],
    flag: str,
) -> None:
    """Bad input fails before the model (tens of GB) is built: every method one of
    ``known`` (``flag`` names the mode in the error), every token count valid for ``like``."""
    for method in methods:
        if method not in known:
            raise ValueError(f"--methods: {method!r} is not one of {', '.join(known)} ({flag})")
    for tokens in tokens_list:
        like.inputs(tokens, torch.device("meta"), dtype, torch.Generator())


def run_like(args: argparse.Namespace, tokens_list: list[int], methods: list[str]) -> dict:
    """The ``--like`` run: one report dict (``results`` rows like ``dlo bench``'s)."""
    like = LIKE[args.like]
    platform = get_platform(None)
    dtype = getattr(torch, args.dtype)
    known = ("resident", "dlo-ring", "diffusers-group")
    check_like_input(like, dtype, tokens_list, methods, known, "--like")
    nbytes = model_nbytes(build(like, dtype))
    report: dict[str, Any] = {
        "like": like.name,
        "class": like.cls,
        "dtype": args.dtype,
        "model_nbytes": nbytes,
        "tokens": tokens_list,
        "limits": h2d_limits(platform, 256 << 20) if platform.has_streams else {},
        "results": [],
    }
    bw = report["limits"].get("h2d_pinned_alone_GBps")
    reference: dict[int, torch.Tensor] = {}
    for method in methods:
        if method == "diffusers-group" and not platform.has_streams:
            logger.warning("diffusers-group: needs CUDA streams; method skipped on CPU")
            continue
        for codec in (
            manual_codecs(codec_list(getattr(args, "codec", "none")))
            if method == "dlo-ring"
            else ["none"]
        ):
            report["results"] += _run_method(
                method, like, platform, dtype, tokens_list, args, reference, nbytes, codec
            )
    # the limit: the raw bytes a forward must move (the streamed blocks' host bytes, raw
    # where encoded; the non-block weights stay on the device) at the pinned H2D rate
    streamed = [r["streamed_nbytes"] for r in report["results"] if "streamed_nbytes" in r]
    report["streamed_nbytes"] = streamed[0] if streamed else nbytes
    for row in report["results"]:
        limit = report["streamed_nbytes"] / (bw * GB) * 1e3 if bw else None
        row["h2d_limit_ms"] = limit
        row["x_h2d_limit"] = row["median_ms"] / limit if limit else None
    return report


def _run_method(
    method: str,
    like: Like,
    platform: Platform,
    dtype: torch.dtype,
    tokens_list: list[int],
    args: argparse.Namespace,
    reference: dict[int, torch.Tensor],
    nbytes: int,
    codec: str = "none",
) -> list[dict[str, Any]]:
    """Rows of ``method``; the resident run fills ``reference`` (its outputs per token
    count), the others are compared against it bit for bit."""
    model = build(like, dtype)
    t0 = time.perf_counter()
    backend = None
    if method == "resident":
        model.to(platform.device)
    elif method == "dlo-ring":
        cfg = OffloadConfig(
            mode="layer",
            transfer="rank-local",
            resident_layers=0,  # the row measures streaming
            num_slots=args.like_slots,
            codec=codec,
        )
        backend = enable_offload(model, cfg, device=platform.device)
    elif method == "diffusers-group":
        apply_diffusers_group(model, platform.device, record_stream=True)
    platform.synchronize()
    rows = time_rows(
        model,
        backend,
        method,
        like,
        platform,
        dtype,
        tokens_list,
        args,
        reference,
        setup_s=time.perf_counter() - t0,
        codec=codec,
    )
    if backend is not None:
        backend.disable()
    del model, backend
    _clean(platform)
    return rows


def time_rows(
    model: nn.Module,
    backend: Any,
    method: str,
    like: Like,
    platform: Platform,
    dtype: torch.dtype,
    tokens_list: list[int],
    args: argparse.Namespace,
    reference: dict[int, torch.Tensor],
    *,
    setup_s: float,
    codec: str = "none",
) -> list[dict[str, Any]]:
    """One row per token count for ``model`` as set up (``backend``: dlo's, or None): the
    first forward, the steady forwards, the peak, and bitwise against ``reference`` (which
    the resident method fills)."""
    rows = []
    for tokens in tokens_list:
        inputs = like.inputs(tokens, platform.device, dtype, torch.Generator().manual_seed(1))
        platform.reset_peak_memory_stats()

        def forward(inputs: dict[str, Any] = inputs, model: nn.Module = model) -> Any:
            with torch.inference_mode():
                return model(**inputs)

        t0 = time.perf_counter()
        out = forward()[0].float().cpu()  # the first forward learns the ring's order
        first_ms = (time.perf_counter() - t0) * 1e3
        for _ in range(args.warmup - 1):
            forward()
        platform.synchronize()
        before = backend.stats() if backend is not None else {}
        # every forward from here is the steady state (the untimed first one included)
        timing = time_forward(
            forward, platform, warmup=0, reps=args.reps, desc=f"{method} tokens={tokens}"
        )
        row = {
            "method": method,
            "tokens": tokens,
            "median_ms": timing["median_ms"],
            "min_ms": timing["min_ms"],
            "first_forward_ms": first_ms,
            "setup_s": setup_s,
            "peak_device_nbytes": _peak(platform),
        }
        if backend is not None:
            after = backend.stats()
            row["demand_loads_after_warmup"] = after["num_demand_loads"] - before.get(
                "num_demand_loads", 0
            )
            row["streamed_nbytes"] = (
                after["host_nbytes"]
                - after["host_encoded_nbytes"]
                + after["host_encoded_raw_nbytes"]
            )
            row["num_pinned_blocks"] = after.get("num_pinned_blocks", 0)
            row["codec"], row["codec_ratio"] = codec, after["codec_ratio"]
            row["decode_gbps"] = after["decode_gbps"]
            row["decode_tail_ms_per_load"] = after["decode_tail_ms_per_load"]
            row["h2d_nbytes_per_forward"] = (after["h2d_nbytes"] - before["h2d_nbytes"]) / max(
                1.0, timing["forwards"]
            )
        if method == "resident":
            reference[tokens] = out
        elif tokens in reference:  # the first forward, and one after any re-plan
            last = forward()[0].float().cpu()
            row["bitwise_vs_resident"] = torch.equal(out, reference[tokens]) and torch.equal(
                last, reference[tokens]
            )
        rows.append(row)
        logger.warning("%-16s tokens=%-6d %.2f ms", method, tokens, row["median_ms"])
        del inputs, forward
    return rows


def markdown_like(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    lines = [
        f"`{report['like']}` ({report['class']}), {report['dtype']}, "
        f"{report['model_nbytes'] / 1e9:.2f} GB; limits {report['limits']}",
        "",
        "| method | tokens | median ms | x H2D limit | peak HBM GB | setup s | demand loads "
        "after warm-up | H2D GB / forward | bitwise vs resident |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        x = f"{r['x_h2d_limit']:.3f}" if r.get("x_h2d_limit") else "-"
        per = r.get("h2d_nbytes_per_forward")
        name = r["method"] + (
            f" [codec {r['codec']}: {r['codec_ratio']:.3f} of the bytes, decode "
            f"{r.get('decode_gbps', 0.0):.0f} GB/s, +{r.get('decode_tail_ms_per_load', 0.0):.2f}"
            " ms per load]"
            if r.get("codec", "none") != "none"
            else ""
        )
        lines.append(
            f"| {name} | {r['tokens']} | {r['median_ms']:.1f} | {x} | "
            f"{r['peak_device_nbytes'] / 1e9:.2f} | {r['setup_s']:.1f} | "
            f"{r.get('demand_loads_after_warmup', '-')} | "
            f"{'-' if per is None else f'{per / 1e9:.2f}'} | "
            f"{r.get('bitwise_vs_resident', '-')} |"
        )
    return "\n".join(lines)
