"""A diffusers pipeline's call as dlo's commands and benchmarks make it: its arguments from the
flags, the folder loaded by diffusers itself (the resident reference), and the call timed
step by step."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch

from dlo.commands.args import steady_median
from dlo.commands.run_flags import PIPELINE_CALL_FLAGS
from dlo.platform.env import process_start_time


def call_kwargs(args: argparse.Namespace, pipe: Any, rank: int, device: torch.device) -> dict:
    """The ``__call__`` arguments of this rank: its prompt and seed, and the sizes given."""
    prompts = args.prompt or ["a photo of a cat"]
    kw: dict[str, Any] = {
        "prompt": prompts[rank % len(prompts)],
        "num_inference_steps": args.steps,
        "generator": torch.Generator("cpu").manual_seed(args.seed + rank),
        "output_type": "pt",
    }
    for flag, name in PIPELINE_CALL_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            kw[name] = value
    accepted = inspect.signature(type(pipe).__call__).parameters
    unknown = sorted(k for k in kw if k not in accepted)
    if unknown:
        raise ValueError(f"{type(pipe).__name__} takes no {', '.join(unknown)} (drop the flag)")
    return kw


def diffusers_load(folder: str, dtype: torch.dtype) -> Any:
    """``DiffusionPipeline.from_pretrained(folder, dtype=dtype)``, on the CPU."""
    import diffusers

    from dlo.pipelines.classes import quiet_imports

    version = tuple(int(x) for x in diffusers.__version__.split(".")[:2])
    name = "dtype" if version >= (0, 42) else "torch_dtype"  # 0.42 deprecates torch_dtype
    with quiet_imports():
        return diffusers.DiffusionPipeline.from_pretrained(folder, **{name: dtype})


def resident_reference(folder: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The folder through diffusers itself, every weight in its own memory on ``device``
    (diffusers' CPU tensors alias the file, aligned only to their dtype: copies are what a
    resident model holds)."""
    ref = diffusers_load(folder, dtype)
    for module in ref.components.values():
        if isinstance(module, torch.nn.Module):
            for t in [*module.parameters(), *module.buffers()]:
                t.data = t.data.to(device, copy=True)
    ref.set_progress_bar_config(disable=True)
    return ref


def result_of(out: Any) -> torch.Tensor:
    """A pipeline output's images, or a video pipeline's frames."""
    return out.images if hasattr(out, "images") else out.frames  # type: ignore[no-any-return]


def dits_of(pipe: Any) -> list[Any]:
    """The pipeline's DiTs (``transformer``, Wan 2.2's ``transformer_2``)."""
    return [getattr(pipe, n) for n in ("transformer", "transformer_2") if getattr(pipe, n, None)]


def timed_call(
    pipe: Any,
    kw: dict[str, Any],
    platform: Any,
    bar: Any = None,
    latents: list[torch.Tensor] | None = None,
) -> tuple[Any, list[float], float]:
    """``pipe(**kw)`` in inference mode: its images (or frames), the wall-clock marks of
    the first DiT forward and of every step's end (``time.time()``, device synchronized),
    and the wall seconds of the whole call; ``bar`` (of :func:`progress_bar`) advances a
    step at each step's end; ``latents`` (where the pipeline hands them to its step
    callback) gets the last step's latents, the DiTs' result before the decode."""
    marks: list[float] = []
    if latents is not None and "latents" in getattr(pipe, "_callback_tensor_inputs", ()):
        kw = {**kw, "callback_on_step_end_tensor_inputs": ["latents"]}

    def first_forward(*_: Any) -> None:
        if not marks:
            platform.synchronize()
            marks.append(time.time())

    def on_step(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        platform.synchronize()
        marks.append(time.time())
        if latents is not None and "latents" in kwargs:
            latents[:] = [kwargs["latents"].clone()]
        if bar is not None:
            bar.update(1)
        return kwargs

    dits = dits_of(pipe)  # a pipeline without one (a UNet): timed from the call
    handle = dits[0].register_forward_pre_hook(first_forward) if dits else None
    if handle is None:
        marks.append(time.time())
    try:
        with torch.inference_mode():
            wall0 = time.perf_counter()
            out = pipe(**kw, callback_on_step_end=on_step)
            platform.synchronize()
            wall = time.perf_counter() - wall0
    finally:
        if handle is not None:
            handle.remove()
    return result_of(out), marks, wall


def step_times(marks: list[float]) -> dict[str, Any]:
    """Every step's time, the steady median (of the steps after the first, as ``dlo run``;
    the first alone when there is one) and the first (ms), and the cold start (process start
    to the first DiT forward, s) from :func:`timed_call`'s marks."""
    step_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
    return {
        "step_ms_median": steady_median(step_ms),
        "first_step_ms": step_ms[0] if step_ms else 0.0,
        "step_ms": step_ms,
        "cold_start_s": (marks[0] - process_start_time()) if marks else 0.0,
    }


@contextlib.contextmanager
def forward_marks(pipe: Any, platform: Any, *, on: bool) -> Iterator[list[tuple[float, float]]]:
    """A diagnostic (``on``): the (start, end) of every forward of the pipeline's first
    DiT, in seconds, the device synchronized at both (which serializes the forwards' edges:
    the step times of such a call are not the benchmark's)."""
    marks: list[tuple[float, float]] = []
    dits = dits_of(pipe) if on else []
    if not dits:
        yield marks
        return
    starts: list[float] = []

    def pre(*_: Any) -> None:
        platform.synchronize()
        starts.append(time.perf_counter())

    def post(*_: Any) -> None:
        platform.synchronize()
        marks.append((starts[-1], time.perf_counter()))

    handles = [dits[0].register_forward_pre_hook(pre), dits[0].register_forward_hook(post)]
    try:
        yield marks
    finally:
        for h in handles:
            h.remove()
