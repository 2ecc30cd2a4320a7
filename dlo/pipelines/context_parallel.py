"""Context (sequence) parallelism on a pipeline's DiTs: diffusers' ``enable_parallelism``
with a ``ContextParallelConfig`` over every rank of the job (``dlo run --pipeline DIR
--context-parallel ulysses|ring``; see [Note: weight gathers beside the attention's
all-to-all] in docs/design.md).

diffusers 0.42.1 builds its device mesh from ``torch.accelerator.device_count()``, which is 0
on a machine without an accelerator (a division by zero): on the CPU the count reads 1 for the
duration of the call, so the same code runs on gloo.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dlo.runtime.gloo_gather import needs_routing, route_gathers

KINDS = ("ulysses", "ring")


RING_BACKEND = "_native_cudnn"
"""The attention backend ring attention runs on when the DiT has the default one: ring
attention asks the backend for the log-sum-exp, which diffusers' default (``native``) does
not return; cuDNN's scaled-dot-product attention does."""


def enable_context_parallel(dits: list[Any], kind: str, degree: int, device: torch.device) -> None:
    """Split every DiT of ``dits`` along the sequence over ``degree`` ranks (all of the
    job's), Ulysses (attention heads exchanged by all-to-all) or ring attention (on
    :data:`RING_BACKEND` where the DiT has the default attention backend).

    Raises:
        ValueError: what :func:`check_context_parallel` refuses; a DiT has no
            ``enable_parallelism`` (not a diffusers model); Ulysses over a head count that
            ``degree`` does not divide; ring attention on :data:`RING_BACKEND` over heads
            whose width 8 does not divide (cuDNN refuses them).
    """
    check_context_parallel(kind, degree, device)
    from diffusers import ContextParallelConfig

    for dit in dits:  # every DiT checked before any is changed
        _check_dit(dit, kind, degree)
    if needs_routing(device, dist.get_backend() if dist.is_initialized() else None):
        route_gathers()
    for dit in dits:
        if kind == "ring" and _default_backend(dit):
            dit.set_attention_backend(RING_BACKEND)
        config = ContextParallelConfig(**{f"{kind}_degree": degree})
        with _accelerator_count():
            dit.enable_parallelism(config=config)


def _check_dit(dit: Any, kind: str, degree: int) -> None:
    """What :func:`enable_context_parallel` refuses of one DiT."""
    name = type(dit).__name__
    if not callable(getattr(dit, "enable_parallelism", None)):
        raise ValueError(
            f"--context-parallel: {name} has no enable_parallelism (a diffusers model with "
            "a context-parallel plan is needed)"
        )
    config = getattr(dit, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if kind == "ulysses" and isinstance(heads, int) and heads % degree:
        raise ValueError(
            f"--context-parallel=ulysses over {degree} ranks: {name} has {heads} attention "
            f"heads, which {degree} does not divide (use a rank count that divides it, or "
            "ring attention)"
        )
    width = getattr(config, "attention_head_dim", None)
    if kind == "ring" and _default_backend(dit) and isinstance(width, int) and width % 8:
        raise ValueError(
            f"--context-parallel=ring: {name}'s attention heads are {width} wide, and the "
            f"{RING_BACKEND} backend it runs on needs a width 8 divides (use ulysses)"
        )


def check_context_parallel(kind: str, degree: int, device: torch.device) -> None:
    """The checks of :func:`enable_context_parallel` that need no model (before any work)."""
    if kind not in KINDS:
        raise ValueError(f"--context-parallel={kind!r}: expected one of {list(KINDS)}")
    if degree < 2:
        raise ValueError(
            f"--context-parallel={kind} needs 2 or more ranks (torchrun --nproc-per-node=N); "
            f"this job has {degree}"
        )
    if kind == "ring" and device.type != "cuda":
        raise ValueError(
            "--context-parallel=ring needs an attention backend that returns the log-sum-exp "
            f"(cuDNN or flash, on a CUDA device); this run's device is {device}: use ulysses"
        )
    built = torch._C._get_accelerator().type
    if device.type == "cpu" and built != "cpu":
        raise ValueError(
            f"--context-parallel on the CPU with a torch built for {built}: diffusers builds "
            f"its device mesh on the build's accelerator ({built}), not on the run's device; "
            "run on the GPU, or with a CPU build of torch"
        )


def _default_backend(dit: Any) -> bool:
    """Whether every attention processor of ``dit`` uses diffusers' default backend."""
    backends = {
        getattr(getattr(m, "processor", None), "_attention_backend", None)
        for m in dit.modules()
        if hasattr(m, "processor")
    }
    return backends <= {None, "native"}


@contextlib.contextmanager
def _accelerator_count() -> Iterator[None]:
    """``torch.accelerator.device_count()`` at least 1 while diffusers builds its mesh."""
    count = torch.accelerator.device_count
    if count() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.device_count = count  # type: ignore[assignment]
