"""Other mechanisms that may manage a module (accelerate, diffusers hooks, FSDP, DTensor
parameters): recognized without importing them, never touched.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- foreign offloaders
INNER_RING_HOOK = "dlo.ring.inner"
"""dlo's ring hook inside a step cache's diffusers chain ([Note: loads inside step caches] in
:mod:`dlo.hooks.step_caches`)."""

STEP_CACHE_HOOKS = frozenset(
    {
        "fbc_leader_block_hook",
        "fbc_block_hook",
        "mag_cache_leader_block_hook",
        "mag_cache_block_hook",
        "sea_cache_root",
        "sea_cache_leader_block",
        "sea_cache_block",
        "sea_cache_post_norm",
        "taylorseer_cache",
        "pyramid_attention_broadcast",
        "faster_cache_denoiser",
        "faster_cache_block",
        "text_kv_cache_transformer",
        "text_kv_cache_block",
        INNER_RING_HOOK,
    }
)
"""diffusers' step-cache hooks (its ``enable_cache``): they skip or reuse computations and
move no weight, so dlo streams the blocks they wrap (see :mod:`dlo.hooks.step_caches`)."""

CONTEXT_PARALLEL_HOOKS = ("cp_input---", "cp_output---")
"""Name prefixes of diffusers' context-parallel hooks (``enable_parallelism`` with a
``ContextParallelConfig``): they split and gather activations along the sequence and move no
weight, so dlo streams (and gathers) the blocks they wrap."""


def _moves_weights(hook_name: str) -> bool:
    """Whether a diffusers hook of this name may manage weights (an offloader's would)."""
    return hook_name not in STEP_CACHE_HOOKS and not hook_name.startswith(CONTEXT_PARALLEL_HOOKS)


def foreign_offloader(module: nn.Module) -> str | None:
    """Name the other mechanism that manages ``module`` itself, or ``None``.

    Only ``module`` is inspected, not its children (see :func:`find_foreign_offloaders`).
    Recognized: accelerate hooks (``_hf_hook``), diffusers hooks (a ``_diffusers_hook``
    registry holding hooks other than step caches' and context parallelism's), FSDP1
    (``FullyShardedDataParallel``), FSDP2 (``fully_shard``, an ``FSDPModule``) and DTensor
    parameters held directly by ``module``. Nothing is imported here: a mechanism whose module
    was never imported cannot be managing anything.

    Args:
        module: the module to inspect.

    Returns:
        ``"accelerate"``, ``"diffusers"``, ``"FSDP"``, ``"FSDP2 fully_shard"``,
        ``"DTensor parameters"`` or ``None``.

    Example:
        >>> foreign_offloader(nn.Linear(2, 2)) is None
        True
    """
    if getattr(module, "_hf_hook", None) is not None:
        return "accelerate"
    diffusers_registry = getattr(module, "_diffusers_hook", None)
    hooks = getattr(diffusers_registry, "hooks", None) if diffusers_registry is not None else None
    if hooks and any(_moves_weights(name) for name in hooks):
        return "diffusers"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        fsdp2_cls = getattr(fsdp, "FSDPModule", None)
        if fsdp2_cls is not None and isinstance(module, fsdp2_cls):
            return "FSDP2 fully_shard"
        fsdp1_cls = getattr(fsdp, "FullyShardedDataParallel", None)
        if fsdp1_cls is not None and isinstance(module, fsdp1_cls):
            return "FSDP"
    if any(is_dtensor(p) for p in module.parameters(recurse=False)):
        return "DTensor parameters"
    return None


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a DTensor (an FSDP2-managed parameter, say); imports nothing: a DTensor can
    only exist once ``torch.distributed.tensor`` is loaded."""
    dtensor_mod = sys.modules.get("torch.distributed.tensor")
    dtensor_cls = getattr(dtensor_mod, "DTensor", None) if dtensor_mod is not None else None
    return dtensor_cls is not None and isinstance(t, dtensor_cls)


def find_foreign_offloaders(root: nn.Module) -> list[tuple[str, str]]:
    """Every module under ``root`` (included) that another mechanism manages.

    Args:
        root: the model (or component) to scan.

    Returns:
        ``(path, mechanism)`` pairs in ``named_modules()`` order; ``path`` is the dotted
        submodule path, ``""`` for ``root`` itself.

    Example:
        >>> find_foreign_offloaders(nn.Sequential(nn.Linear(2, 2)))
        []
    """
    found = []
    for path, module in root.named_modules():
        mechanism = foreign_offloader(module)
        if mechanism is not None:
            found.append((path, mechanism))
    return found
