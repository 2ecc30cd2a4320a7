"""Choosing and creating the one backend a configuration asks for."""

from __future__ import annotations

import logging
from typing import Any

import torch

from dlo.backends.base import OffloadBackend
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.platform.device import Platform, get_platform
from dlo.platform.env import torchrun_env

logger = logging.getLogger(__name__)


def get_offload_backend(
    config: OffloadConfig | None,
    parallel: ParallelConfig | None = None,
    device: torch.device | str | None = None,
) -> OffloadBackend | None:
    """Create the backend ``config`` selects, without installing anything.

    Args:
        config: the offload config; None or ``mode="none"`` disables offload.
        parallel: the job's layout; None means data parallel over ``WORLD_SIZE`` ranks.
        device: the compute device; None picks this rank's GPU, else the CPU.
    Returns:
        The backend, or None when offload is disabled or the device's platform cannot
        serve it (logged).
    Raises:
        ValueError / TypeError: a configuration that cannot work, or a requested device
            this torch cannot use (``device="cuda"`` without CUDA).

    Example:
        >>> backend = get_offload_backend(OffloadConfig(mode="layer"), device="cpu")
        >>> backend.enable(pipeline)
    """
    if config is None:
        return None
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if not config.enabled:
        return None
    if parallel is None:
        parallel = ParallelConfig.for_world(torchrun_env().world_size)
    elif not isinstance(parallel, ParallelConfig):
        raise TypeError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
    platform = _platform_or_none(device)
    if platform is None:
        return None
    if config.mode == "layer":
        from dlo.backends.layerwise import LayerwiseBackend

        return LayerwiseBackend(config, parallel, platform)
    from dlo.backends.model_swap import ModelSwapBackend

    return ModelSwapBackend(config, parallel, platform)


def _platform_or_none(device: torch.device | str | None) -> Platform | None:
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type not in ("cpu", "cuda"):
        logger.warning("dlo: offload disabled: device type %r is not supported", dev.type)
        return None
    return get_platform(dev)


def enable_offload(
    pipeline: Any,
    config: OffloadConfig | None,
    parallel: ParallelConfig | None = None,
    device: torch.device | str | None = None,
) -> OffloadBackend | None:
    """:func:`get_offload_backend` then ``enable(pipeline)``; None when disabled."""
    backend = get_offload_backend(config, parallel, device)
    if backend is not None:
        backend.enable(pipeline)
    return backend
