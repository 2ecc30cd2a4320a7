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

KINDS = ("ulysses", "ring")


def enable_context_parallel(dits: list[Any], kind: str, degree: int) -> None:
    """Split every DiT of ``dits`` along the sequence over ``degree`` ranks (all of the
    job's), Ulysses (attention heads exchanged by all-to-all) or ring attention.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`, ``degree`` is below 2, a DiT has no
            ``enable_parallelism`` (not a diffusers model), or ring attention on the CPU
            (its native attention returns no log-sum-exp, which ring attention needs).
    """
    check_context_parallel(kind, degree)
    from diffusers import ContextParallelConfig

    for dit in dits:
        if not callable(getattr(dit, "enable_parallelism", None)):
            raise ValueError(
                f"--context-parallel: {type(dit).__name__} has no enable_parallelism (a "
                "diffusers model with a context-parallel plan is needed)"
            )
        config = ContextParallelConfig(**{f"{kind}_degree": degree})
        with _accelerator_count():
            dit.enable_parallelism(config=config)


def check_context_parallel(kind: str, degree: int) -> None:
    """The checks of :func:`enable_context_parallel` that need no model (before any work)."""
    if kind not in KINDS:
        raise ValueError(f"--context-parallel={kind!r}: expected one of {list(KINDS)}")
    if degree < 2:
        raise ValueError(
            f"--context-parallel={kind} needs 2 or more ranks (torchrun --nproc-per-node=N); "
            f"this job has {degree}"
        )
    if kind == "ring" and not torch.accelerator.is_available():
        raise ValueError(
            "--context-parallel=ring needs an attention backend that returns the log-sum-exp "
            "(flash or cuDNN on a GPU); the CPU's native attention does not: use ulysses"
        )


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
