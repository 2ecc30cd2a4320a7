"""``load_pipeline``: a pipeline built on ``meta``, filled from a checkpoint, offloaded.

The composition of :mod:`dlo.io.materialize` (check, then map or copy) and a backend's ``enable``
(see [Note: loading from a checkpoint]). Either the whole sequence succeeds, or the skeleton
is back on ``meta`` and nothing is held (dlo's ledger reads zero): never a half-loaded model.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dlo.backends.base import OffloadBackend
from dlo.backends.factory import get_offload_backend
from dlo.backends.layerwise import LayerwiseBackend
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.config.unset import for_device
from dlo.io.checkpoint import Checkpoint
from dlo.io.materialize import (
    LoadPlan,
    LoadReport,
    forget_derived_copies,
    materialize,
    plan_load,
)
from dlo.journal import Journal, atomic
from dlo.parallel.groups import current_world
from dlo.pipelines import folder
from dlo.plan.topology import resolve_offload_plan
from dlo.platform.device import get_platform, warm_up
from dlo.platform.env import process_peak_rss_bytes

logger = logging.getLogger(__name__)


CheckpointLike = str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | Checkpoint


@torch.inference_mode(False)  # [Note: no inference tensors] in dlo.backends.base
def load_pipeline(
    factory: Callable[[], Any] | nn.Module | str | os.PathLike[str],
    checkpoint: CheckpointLike | OffloadConfig | None = None,
    config: OffloadConfig | None = None,
    parallel: ParallelConfig | None = None,
    device: torch.device | str | None = None,
    *,
    copy: bool = False,
    prepare: Callable[[Any], Any] | None = None,
    dtype: torch.dtype | str | None = None,
    verify_checksum: bool = False,
    torch_dtype: torch.dtype | str | None = None,
) -> tuple[Any, OffloadBackend | None]:
    """Build a pipeline on ``meta``, fill it from safetensors, and enable offload on it.

    With ``mode="layer"`` each rank reads from the (memory-mapped) checkpoint only the byte
    ranges of its own slices of the streamed blocks plus the non-block weights, so no rank
    ever holds a pageable copy of the model (see [Note: loading from a checkpoint]).

    Args:
        factory: a diffusers pipeline folder (a directory with ``model_index.json``, see
            [Note: pipeline folders] in :mod:`dlo.pipelines.folder`); or a callable returning
            the pipeline (an ``nn.Module``), called under ``torch.device("meta")``; or a
            skeleton module already built on ``meta``.
        checkpoint: for a factory or skeleton: a ``.safetensors`` file, a directory (with or
            without a ``*.safetensors.index.json``), an index file, a ``{prefix: path}``
            mapping, or a :class:`~dlo.io.checkpoint.Checkpoint`. A folder holds its own
            weights: then this is the offload config, if given positionally.
        config: the offload config; None or ``mode="none"`` returns the model on ``device``
            without offload.
        parallel: the job's parallel layout (as for :func:`get_offload_backend`).
        device: the compute device (None: this rank's GPU, else the CPU).
        copy: copy every tensor into its own host memory first (the ordinary path, for
            comparison) instead of mapping the checkpoint.
        prepare: called with the filled pipeline before offload is enabled, for what must
            happen in between, such as ``lambda p: shard_non_block(p, config, parallel)``
            for HSDP (:mod:`dlo.backends.hsdp`). A failure rolls the load back; what
            ``prepare`` itself changed is its own to undo. ``prepare`` may read and
            replace the streamed blocks' weights (quantize them with torchao, fuse a
            LoRA): with a ``prepare``, a block tensor whose data is not aligned to its
            dtype in the file is read into memory instead of served from the file.
        dtype: folders only: the dtype floating weights run in (cast on load, except the
            classes' keep-in-fp32 modules): a ``torch.dtype`` (float16, bfloat16, float32)
            or its name (``"bfloat16"``); None or ``"auto"`` keeps each tensor's stored
            dtype. diffusers 0.42's name for ``from_pretrained``'s argument.
        verify_checksum: check every byte read from the checkpoint against the checksums
            ``dlo save-checkpoint`` wrote with it (see [Note: checkpoint checksums] in
            :mod:`dlo.io.checksums`): corrupted data fails the load, which rolls back. Files
            without checksums are refused. For a :class:`Checkpoint` given here, set it on
            the checkpoint.
        torch_dtype: the deprecated name of ``dtype`` (a ``FutureWarning``), as in diffusers.
    Returns:
        ``(pipeline, backend)``; ``backend`` is None when offload is disabled (the model is
        then on ``device``). With ``mode="layer"`` every non-block tensor is copied straight
        to ``device``, including components the backend does not manage (a VAE); with
        ``mode="module"`` they are on the CPU for the swap backend to move.
    Raises:
        dlo.io.checkpoint.CheckpointError: the checkpoint or folder cannot serve the model
            (raised before anything is changed), naming the file.
        dlo.OffloadError / ValueError / TypeError: as ``backend.enable``; the skeleton is
            put back on ``meta``.
        ValueError / TypeError: ``dtype`` is not a dtype dlo builds in, or both ``dtype``
            and ``torch_dtype`` are given (before anything is read).

    Example:
        >>> pipe, backend = dlo.load_pipeline(
        ...     lambda: build_pipeline("wan14b-like", device="meta"), "ckpt/",
        ...     dlo.OffloadConfig(mode="layer", transfer="allgather"))
        >>> pipe, backend = dlo.load_pipeline("Wan2.1-T2V-14B-Diffusers/",
        ...     dlo.OffloadConfig(mode="layer"), dtype=torch.bfloat16)
    """
    t0 = time.perf_counter()
    dtype, dtype_arg = _dtype_of(dtype, torch_dtype)
    warmed = warm_up(device)  # the device's context is made while the skeleton is built
    try:
        pipe, loaded, ckpt, cast, config = _skeleton(
            factory, checkpoint, config, dtype, dtype_arg, verify_checksum, t0
        )
        try:
            plan = plan_load(loaded, ckpt, cast=cast)  # every check, before any change
        except BaseException:
            ckpt.close()
            raise
    finally:
        warmed()
    backend = _fill_and_enable(pipe, plan, config, parallel, device, copy, prepare)
    logger.info(
        "dlo: loaded %s from %s in %.2fs (peak RSS %.2f GiB)",
        type(pipe).__name__,
        os.fspath(factory) if isinstance(factory, (str, os.PathLike)) else ckpt.files[0],
        time.perf_counter() - t0,
        process_peak_rss_bytes() / (1 << 30),
    )
    return pipe, backend


def _skeleton(
    factory: Callable[[], Any] | nn.Module | str | os.PathLike[str],
    checkpoint: CheckpointLike | OffloadConfig | None,
    config: OffloadConfig | None,
    dtype: torch.dtype | None,
    dtype_arg: str,
    verify_checksum: bool,
    t0: float,
) -> tuple[Any, nn.Module, Checkpoint, bool, OffloadConfig | None]:
    """:func:`load_pipeline`'s pipeline on ``meta``, the module whose state-dict names are
    the checkpoint's, the checkpoint, whether to cast, and the offload config."""
    if isinstance(factory, (str, os.PathLike)):
        if isinstance(checkpoint, OffloadConfig):
            if config is not None:
                raise TypeError("load_pipeline(folder, config, config=...): config given twice")
            checkpoint, config = None, checkpoint
        if checkpoint is not None:
            raise TypeError(
                f"load_pipeline({os.fspath(factory)!r}, checkpoint={checkpoint!r}): a pipeline "
                "folder holds its own weights; pass the offload config second"
            )
        index = folder.read_index(factory)
        folder.pipeline_class(index)  # a name that is no pipeline class fails before the build
        components = folder.module_components(index)
        ckpt = folder.open_checkpoint(
            (spec for spec, _ in components.values()), verify_checksum=verify_checksum
        )
        try:
            modules = folder.build_modules(components, ckpt, dtype)
            pipe = folder.assemble(index, {**modules, **folder.load_others(index, modules)})
        except BaseException:
            ckpt.close()
            raise
        loaded: nn.Module = nn.ModuleDict(modules)  # state-dict names = checkpoint names
        logger.info(
            "dlo: built %s from %s in %.2fs", type(pipe).__name__, factory, time.perf_counter() - t0
        )
        cast = dtype is not None
    else:
        if isinstance(checkpoint, OffloadConfig) or checkpoint is None:
            raise TypeError("load_pipeline(factory, checkpoint, config): the checkpoint is missing")
        if dtype is not None:
            raise TypeError(f"{dtype_arg} is for pipeline folders; a factory builds its own dtypes")
        if isinstance(factory, nn.Module):
            pipe = factory
        elif callable(factory):
            with torch.device("meta"):
                pipe = factory()
        else:
            raise TypeError(
                f"factory must be a folder, a callable or an nn.Module, got {type(factory).__name__}"
            )
        if isinstance(checkpoint, Checkpoint):
            if verify_checksum and not checkpoint.verify_checksum:
                raise ValueError(
                    "verify_checksum=True with a Checkpoint opened without it: pass "
                    "Checkpoint(..., verify_checksum=True)"
                )
            ckpt = checkpoint
        else:
            ckpt = Checkpoint(checkpoint, verify_checksum=verify_checksum)
        loaded, cast = pipe, False
    return pipe, loaded, ckpt, cast, config


def _dtype_of(
    dtype: torch.dtype | str | None, torch_dtype: torch.dtype | str | None
) -> tuple[torch.dtype | None, str]:
    """``load_pipeline``'s dtype (None: the stored dtypes) and the argument that gave it."""
    name = "dtype"
    if torch_dtype is not None:
        if dtype is not None:
            raise TypeError(
                f"load_pipeline got dtype={dtype!r} and torch_dtype={torch_dtype!r}: pass "
                "dtype only (torch_dtype is its deprecated name)"
            )
        warnings.warn(
            "load_pipeline(torch_dtype=...) is deprecated: pass dtype=... (diffusers 0.42's name)",
            FutureWarning,
            stacklevel=4,  # the caller of load_pipeline (under inference_mode's wrapper)
        )
        dtype, name = torch_dtype, "torch_dtype"
    if dtype is None or dtype == "auto":
        return None, name
    value = dtype
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)  # type: ignore[assignment]
        if not isinstance(value, torch.dtype):
            raise ValueError(
                f"{name}={dtype!r} is not a torch dtype: pass torch.bfloat16 (or its name, "
                "'bfloat16'), float16 or float32, or None/'auto' for the stored dtypes"
            )
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{name} must be a torch.dtype, its name or None, got {dtype!r} "
            f"({type(dtype).__name__})"
        )
    if not value.is_floating_point or value.itemsize < 2:
        raise ValueError(
            f"{name}={dtype!r}: components are built in float16, bfloat16 or float32 (float8 "
            f"and integer weights load as stored: {name}=None)"
        )
    return value, name


def _fill_and_enable(
    pipe: Any,
    plan: LoadPlan,
    config: OffloadConfig | None,
    parallel: ParallelConfig | None,
    device: torch.device | str | None,
    copy: bool,
    prepare: Callable[[Any], Any] | None,
) -> OffloadBackend | None:
    """Give ``plan``'s skeleton its bytes and enable offload on ``pipe`` (whose streamed
    blocks are in that skeleton under the same names), all or nothing."""
    ckpt = plan.checkpoint
    try:
        backend = get_offload_backend(config, parallel, device)
        target = get_platform(torch.device(device) if device is not None else None).device
        blocks: set[str] = set()
        if isinstance(backend, LayerwiseBackend):  # the plan enable starts from (a found
            # encoder the policy may stream stays in its file until the policy decides)
            requested = for_device(backend.config, target.type)
            layout = resolve_offload_plan(pipe, requested, backend.parallel)
            blocks = {p for s in layout.stacks for p in s.block_paths}
        if copy:
            blocks, target = set(), torch.device("cpu")  # the ordinary path
        elif backend is not None and not isinstance(backend, LayerwiseBackend):
            target = torch.device("cpu")  # model-level swap moves whole components itself
    except BaseException:
        ckpt.close()
        raise
    journal = Journal()
    # a failed read behind the enable would fail this rank alone, after its peers passed
    # the enable's agreement: multi-rank jobs read everything first
    defer = (
        prepare is None
        and not copy
        and (backend is None or isinstance(backend, LayerwiseBackend))
        and not current_world().distributed
    )
    if defer:
        ckpt.retain()  # open until the deferred reads have stopped (a failed enable's
        # rollback may release the files a mapped backing retained)
    report = LoadReport()
    try:
        t0 = time.perf_counter()
        # the non-block weights arrive behind the layerwise enable, which reads none of
        # them (it fills the host shards from the file); prepare may read them, the swap
        # backend packs them, and the ordinary path (copy) packs the blocks from them
        report = materialize(
            plan,
            journal,
            mapped=functools.partial(_in_blocks, blocks),
            device=target,
            defer_reads=defer,
            read_unaligned=prepare is not None,  # prepare may read the blocks' weights
        )
        t_mapped = time.perf_counter()
        if prepare is not None:
            forget_derived_copies(report)  # prepare may write them (a LoRA fused in place)
            prepare(pipe)
        if backend is not None:
            backend.enable(pipe)
        else:
            pipe.to(target)
        t_enabled = time.perf_counter()
        if report.pending is not None:
            report.pending.wait()
    except BaseException:
        with atomic():  # nothing would resume an interrupted cleanup: it runs to its end
            try:
                if backend is not None and backend.is_enabled():
                    backend.disable()
            finally:
                journal.rollback()
        raise
    finally:
        forget_derived_copies(report)  # the enable is done: user code may write them now
        if defer:
            ckpt.release()
        ckpt.close()
    logger.info(
        "dlo: %d tensors mapped, %d copied (%.2f GB; %.2fs before the enable, %.2fs after "
        "it); enable %.2fs",
        report.num_mapped,
        report.num_copied,
        report.copied_nbytes / 1e9,
        t_mapped - t0,
        time.perf_counter() - t_enabled,
        t_enabled - t_mapped,
    )
    return backend


def _in_blocks(blocks: set[str], name: str) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in blocks for i in range(1, len(parts)))
