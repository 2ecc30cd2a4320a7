"""HSDP composition: FSDP2 owns the non-block weights of each DiT, dlo owns its blocks.

[Note: one owner per parameter]
The streamed (and resident) blocks are resolved first, purely, from the same plan the
layerwise backend will execute. ``fully_shard`` is then applied to each DiT on the 2-D HSDP
mesh ``("replicate", "shard")`` with every block parameter passed as ``ignored_params``, so
FSDP2 shards exactly the non-block parameters (embeddings, norms, heads) and leaves the block
parameters plain tensors for dlo to stream. dlo's AllGather then runs on the shard axis (its
own communicator over the same ranks, see :mod:`dlo.parallel.groups`); the replicate axis never
joins a weight collective and serves independent requests.

Order matters: ``fully_shard`` moves the buffers of every submodule to the device (keeping
their identity), and it must not see dlo's placeholders, so it runs *before* dlo's enable.
FSDP2 cannot be taken off a module again, which is why this is a separate, explicit step
and not part of the offload transaction: ``shard_non_block`` first, then
``enable_offload``; on failure, discard the model.

The non-block parameters stay unsharded after each forward (``reshard_after_forward=False``):
they are small, and re-gathering them every step would add a collective per forward.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.parallel.groups import hsdp_mesh
from dlo.plan.declarations import get_by_path
from dlo.plan.topology import ResolvedOffloadPlan, resolve_offload_plan

logger = logging.getLogger(__name__)


def shard_non_block(
    pipeline: Any,
    config: OffloadConfig,
    parallel: ParallelConfig,
    *,
    mesh: Any = None,
    device_type: str | None = None,
) -> ResolvedOffloadPlan:
    """Apply FSDP2 HSDP to the non-block weights of every streamed DiT.

    Args:
        pipeline: the pipeline (or bare DiT) ``enable_offload`` will receive next.
        config: the offload config (``mode="layer"``) whose plan decides the blocks.
        parallel: must describe HSDP (``hsdp_shard_size`` / ``hsdp_replicate_size``).
        mesh: an existing 2-D ``("replicate", "shard")`` DeviceMesh; built when None.
        device_type: ``"cuda"`` or ``"cpu"`` for a new mesh (default: the platform's).
    Returns:
        The resolved plan (the one the backend will resolve again, unchanged).
    Raises:
        ValueError: HSDP not configured, or ``mode`` is not ``"layer"``.

    Example:
        >>> par = dlo.ParallelConfig(data_parallel_size=4, hsdp_replicate_size=2,
        ...                          hsdp_shard_size=2)
        >>> cfg = dlo.OffloadConfig(mode="layer", transfer="allgather")
        >>> shard_non_block(pipe, cfg, par)
        >>> backend = dlo.enable_offload(pipe, cfg, par)
    """
    from torch.distributed.fsdp import fully_shard

    if not parallel.use_hsdp:
        raise ValueError(
            "shard_non_block needs HSDP: set hsdp_shard_size (and hsdp_replicate_size) in "
            f"ParallelConfig, got {parallel}"
        )
    if config.mode != "layer":
        raise ValueError(f"HSDP composition applies to mode='layer', got mode={config.mode!r}")
    plan = resolve_offload_plan(pipeline, config, parallel)
    if mesh is None:
        mesh = hsdp_mesh(parallel, device_type)
    for dit_path in plan.dits:
        stacks = [s for s in plan.stacks if s.component_path == dit_path]
        if not stacks:
            continue
        dit = get_by_path(pipeline, dit_path)
        blocks = [get_by_path(pipeline, p) for s in stacks for p in s.block_paths]
        ignored: set[nn.Parameter] = {p for b in blocks for p in b.parameters()}
        fully_shard(dit, mesh=mesh, ignored_params=ignored, reshard_after_forward=False)
        logger.info(
            "dlo: FSDP2 HSDP on %s: %d non-block parameters sharded, %d block parameters "
            "left to dlo",
            dit_path or type(dit).__name__,
            sum(1 for p in dit.parameters() if p not in ignored),
            len(ignored),
        )
    return plan
