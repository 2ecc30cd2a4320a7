"""The device side of the layerwise install, after the startup agreement: non-block state
and resident blocks on the device (through the transports of
:mod:`dlo.backends.layer_transports`), the rings and their hooks. Every step is journaled; the sizes come from the layer plan (see [Note: layer
plan] in :mod:`dlo.plan.layers`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from dlo import faults
from dlo.backends.layer_block import LayerBlock
from dlo.backends.layer_host import LayerHost, leave_host, restore_wrappers
from dlo.backends.layer_transports import Transports
from dlo.backends.lora import AdapterCalls
from dlo.backends.lora_fuse import BlockFuse
from dlo.backends.model_hooks import (
    enclosing_paths,
    gathered_loss,
    install_apply_refusal,
    install_load_refusal_on_ancestors,
    install_state_dict_hooks,
    mark_released,
    refuse_released_forward,
)
from dlo.backends.replan_setup import ReplanSetup, install_replanners
from dlo.codec.on_disk import EncodedOnDisk
from dlo.hooks.dispatch import ModelHook
from dlo.hooks.foreign import foreign_offloader, is_dtensor
from dlo.hooks.registry import HookRegistry
from dlo.hooks.step_caches import StepCaches
from dlo.host.shards import shard_view, unpack_tensor
from dlo.journal import Journal
from dlo.plan.checks import non_block_state
from dlo.plan.declarations import get_by_path
from dlo.plan.subclasses import move_tensor, tensor_nbytes
from dlo.plan.topology import ResolvedOffloadPlan
from dlo.platform.device import Platform
from dlo.runtime.ring import BlockRing, RingScheduler, StreamedBlock
from dlo.runtime.slots import SlotPool

logger = logging.getLogger(__name__)

HOOK_NAME = "dlo.ring"


def place_non_block_state(
    platform: Platform,
    pipeline: Any,
    plan: ResolvedOffloadPlan,
    blocks: list[LayerBlock],
    journal: Journal,
) -> int:
    """Move the non-block state of the streamed components and the declared resident
    modules to the device (journaled); returns the bytes moved."""
    device = platform.device
    faults.check("device_placement")
    moved = 0
    for _name, t in non_block_state(pipeline, plan, {id(t) for b in blocks for t in b.tensors}):
        if t.device == device or is_dtensor(t):
            continue  # DTensors belong to FSDP2 (see [Note: one owner per parameter])
        origin = t.device
        move_tensor(t, device)
        moved += tensor_nbytes(t)
        journal.record("place", functools.partial(move_tensor, t, origin))
    return moved


def _gather(platform: Platform, b: LayerBlock, transports: Transports) -> torch.Tensor:
    """Enqueue the load of block ``b`` into a device buffer of its own."""
    buffer = torch.empty(b.layout.padded_nbytes, dtype=torch.uint8, device=platform.device)
    transports.of(b).load(
        b.layout,
        b.shard,
        buffer,
        free_event=platform.new_event(),
        ready_event=platform.new_event(),
        index=b.index,
    )
    return buffer


def load_resident(
    platform: Platform, host: LayerHost, transports: Transports, journal: Journal
) -> None:
    """Load every resident block once into its own device buffer."""
    for b in host.blocks:
        if not b.resident:
            continue
        buffer = b.device_buffer = _gather(platform, b, transports)
        if b.layout.group_size > 1:
            leave_host(b, platform.device)
        for spec, t in zip(b.layout.tensors, b.tensors):
            t.data = shard_view(buffer, spec)
        if b.layout.group_size > 1:  # group size 1: the release step's undo restores it
            journal.record(f"resident {b.name}", functools.partial(host.release_gathered, b))
        else:  # ... from the host region: in-place writes go back there first
            versions = [t._version for t in b.tensors]
            journal.record(
                f"keep writes {b.name}",
                functools.partial(host.keep_resident_writes, b, versions),
            )
    transports.drain()
    platform.synchronize()


def install_rings(
    platform: Platform,
    pipeline: Any,
    host: LayerHost,
    transports: Transports,
    pool: SlotPool,
    *,
    owner: str,
    rank: int,
    journal: Journal,
    replan: ReplanSetup | None = None,
) -> RingScheduler:
    """One ring per stack of streamed blocks, sharing ``pool``; hooks, state-dict views and
    refusals on the model; block 0 of each ring preloaded; the DiTs' rings of ``replan``
    re-planned, their pins loaded."""
    scheduler = RingScheduler(platform, pool, rank=rank)
    blocks = host.blocks

    def unbind() -> None:
        platform.synchronize()
        scheduler.unbind_all()
        scheduler.close()
        gone = [b for b in blocks if b.layout.group_size > 1 and not (b.restored or b.from_disk)]
        for b in gone:
            mark_released(b.tensors, gathered_loss(b.layout.group_size))
        refuse_released_forward(
            [(b.name, b.module, gathered_loss(b.layout.group_size)) for b in gone], rank=rank
        )

    journal.record("rings", unbind)
    # one ring per component, across its stacks (see [Note: prefetch chain])
    by_component: dict[str, list[StreamedBlock]] = {}
    for b in blocks:
        if b.resident:
            continue
        sb = StreamedBlock(
            name=b.name,
            module=b.module,
            layout=b.layout,
            shard=b.shard,
            tensors=b.tensors,
            transport=transports.of(b),
            index=b.index,
            host_writable=b.host_writable,
        )
        by_component.setdefault(b.stack.component_path, []).append(sb)
    for component, sbs in by_component.items():
        scheduler.add_ring(BlockRing(component, sbs))

    registry = HookRegistry(owner=owner)
    journal.record("hooks", registry.remove_all)
    faults.check("hook_install")
    adapters = AdapterCalls(
        lambda: [sb for ring in scheduler.rings for sb in ring.blocks],
        platform.device,
        busy=scheduler.guard.busy,
        rank=rank,
        fuser=BlockFuse(
            platform, scheduler, blocks, rank=rank, codec=host.codec, decoders=transports.decoders
        ),
    )
    shared_names = {b.name for b in blocks if b.node_shared}
    # state_dict() of a block read encoded from disk serves its raw checkpoint's bytes, as
    # on the raw disk tier ([Note: encoded blocks on disk])
    raw_of = {b.name: b.mapped for b in blocks if isinstance(b.encoded, EncodedOnDisk)}
    ring_hooks = {}
    for ring in scheduler.rings:
        for sb in ring.blocks:
            ring_hooks[sb.name] = scheduler.hook_for(sb)
            registry.register(sb.module, HOOK_NAME, ring_hooks[sb.name])
            install_state_dict_hooks(
                registry,
                sb.module,
                sb.name,
                sb.layout,
                raw_of.get(sb.name) or functools.partial(getattr, sb, "shard"),
                sb.tensors,
                rank=rank,
                copy=sb.name in shared_names,
                allow=adapters.allows_load,
                shapes_only=adapters.active,
            )
    streamed = [sb.name for ring in scheduler.rings for sb in ring.blocks]
    install_load_refusal_on_ancestors(
        registry, pipeline, streamed, rank=rank, allow=adapters.allows_load
    )
    install_apply_refusal(registry, pipeline, [b.name for b in blocks], rank=rank)
    # [Note: adapters while streaming]
    adapters.install(registry, pipeline, sorted(enclosing_paths([b.name for b in blocks])), journal)
    for b in blocks:
        if not b.resident and b.layout.group_size > 1:  # what restore=True gives back
            leave_host(b, platform.device)
    for ring in scheduler.rings:
        for sb in ring.blocks:
            for t, ph in zip(sb.tensors, sb.placeholders):
                t.data = ph
    scheduler.caches = follow_step_caches(pipeline, scheduler, registry, ring_hooks, journal)
    if replan is not None and replan.dits:
        install_replanners(
            platform, blocks, scheduler, transports.drain, registry, journal, replan, rank=rank
        )
    scheduler.preload()  # after the pins: the first blocks that stream
    platform.synchronize()
    return scheduler


def follow_step_caches(
    pipeline: Any,
    scheduler: RingScheduler,
    registry: HookRegistry,
    ring_hooks: dict[str, ModelHook],
    journal: Journal,
) -> StepCaches:
    """Each DiT's ring hooks follow its step cache ([Note: loads inside step caches] in
    :mod:`dlo.hooks.step_caches`): inside it on a ring of its own, outside where blocks
    gather."""
    caches = StepCaches(registry, HOOK_NAME, busy=scheduler.guard.busy, rank=scheduler.rank)
    journal.record("step caches", caches.close)
    # the rings share the slots: where any ring gathers, a skip on one rank would change
    # which slots the gathering ring finds loaded there, and the ranks' collectives part
    inner = not scheduler.gathers()
    for ring in scheduler.rings:
        dit = get_by_path(pipeline, ring.name) if ring.name else pipeline
        if isinstance(dit, nn.Module) and foreign_offloader(dit) is None:
            caches.manage(
                dit, [(sb.module, ring_hooks[sb.name]) for sb in ring.blocks], inner=inner
            )
    return caches


def restore_gathered(platform: Platform, host: LayerHost, transports: Transports) -> None:
    """Gather every AllGather block back into ordinary tensors on its original device (a
    collective: every rank of each weight group calls it, in manifest order; bounded by the
    groups' timeouts), for ``disable(restore=True)``. A disk-tier block is gathered too (its
    peers may hold it in memory) but aliases its file again at the rollback instead: a
    private copy of it would take the host memory ``host_budget_gb`` spares."""
    for b in host.blocks:
        if b.layout.group_size == 1 or b.restored:
            continue
        buffer = b.device_buffer if b.resident else _gather(platform, b, transports)
        platform.synchronize()
        assert buffer is not None
        if not b.from_disk:
            for spec, t, dev in zip(b.layout.tensors, b.tensors, b.original_devices):
                t.data = unpack_tensor(buffer, spec, dev)
            restore_wrappers(b)
        b.restored, b.device_buffer = True, None
