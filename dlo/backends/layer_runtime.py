"""The device side of the layerwise install, after the startup agreement: device slots, one
transport per weight axis, non-block state and resident blocks on the device, the rings and
their hooks. Every step is journaled; the sizes come from the layer plan (see [Note: layer
plan] in :mod:`dlo.plan.layers`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dlo import faults
from dlo.backends.layer_host import LayerBlock, LayerHost, leave_host, restore_wrappers
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
from dlo.codec.codecs import get_codec
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.errors import InjectedFault
from dlo.hooks.dispatch import ModelHook
from dlo.hooks.foreign import foreign_offloader, is_dtensor
from dlo.hooks.registry import HookRegistry
from dlo.hooks.step_caches import StepCaches
from dlo.host.shards import shard_view, unpack_tensor
from dlo.journal import Journal
from dlo.parallel.groups import weight_group
from dlo.plan.checks import non_block_state
from dlo.plan.declarations import get_by_path
from dlo.plan.layers import LayerPlan
from dlo.plan.subclasses import move_tensor, tensor_nbytes
from dlo.plan.topology import ResolvedOffloadPlan
from dlo.platform.device import Platform
from dlo.runtime.ce_gather import CopyEngineGather
from dlo.runtime.decoding import Decoder
from dlo.runtime.read_ahead import ReadAhead
from dlo.runtime.ring import BlockRing, RingScheduler, StreamedBlock
from dlo.runtime.sequence import SequenceCheck
from dlo.runtime.slots import SlotPool
from dlo.runtime.staged import NUM_STAGING_BUFFERS, StagedTransport
from dlo.runtime.transport import BlockTransport, TransferCounters, Transport

logger = logging.getLogger(__name__)

HOOK_NAME = "dlo.ring"


def allocate_slots(
    platform: Platform, plan: LayerPlan, gather_engine: str, journal: Journal
) -> SlotPool:
    """The ring's slots; in symmetric memory when the copy-engine gather may be used
    (``"copy"``; ``"auto"`` on CUDA, falling back to ordinary slots if that allocation
    fails)."""

    def allocate(symmetric: bool) -> SlotPool:
        return SlotPool.allocate(
            platform, plan.allocated_slots, plan.slot_nbytes, symmetric=symmetric
        )

    pool: SlotPool | None = None
    if plan.gathers and gather_engine == "auto" and platform.has_streams:
        if platform.dist_backend == "gloo" or not platform.peers_accessible():  # shared GPUs
            logger.info(
                "ranks share a GPU or lack peer access: gather_engine='auto' uses NCCL/gloo"
            )
            pool = allocate(False)
        else:
            try:
                pool = allocate(True)
            except InjectedFault:
                raise
            except (RuntimeError, ImportError, OSError) as e:  # an allocation, not a config
                logger.info("no symmetric-memory slots (%s): gather_engine='auto' uses NCCL", e)
    if pool is None:
        pool = allocate(plan.gathers and gather_engine == "copy")

    def release() -> None:
        platform.synchronize()
        pool.release()

    journal.record("device slots", release)
    return pool


@dataclass
class Transports:
    """The transport of each weight axis, and what the ring's stats report of them."""

    by_axis: dict[str, Transport] = field(default_factory=dict)
    staging: StagedTransport | None = None
    group_rank: int = 0
    group_size: int = 1
    """Stats' group: the first gathering stack's, else one rank."""
    gather_sync: str | None = None
    """The copy-engine gather's barrier (``"stream"`` or ``"kernel"``), None with NCCL."""
    encoded_by_axis: dict[str, Transport] = field(default_factory=dict)
    """The transports of the encoded blocks, per weight axis (see [Note: decode pipeline])."""
    decoders: list[Decoder] = field(default_factory=list)
    aheads: dict[str, ReadAhead] = field(default_factory=dict)
    """The disk tier's readers, per weight axis (``"local"``: whole blocks)."""

    def drain(self) -> None:
        """Wait until the staged transport issued every load (a no-op without one)."""
        if self.staging is not None:
            self.staging.drain()

    def of(self, b: LayerBlock) -> Transport:
        """The transport that loads block ``b``."""
        if b.encoded is not None:
            return self.encoded_by_axis[b.stack.group_axis]
        return self.by_axis[b.stack.group_axis]


def build_transports(
    platform: Platform,
    plan: LayerPlan,
    blocks: list[LayerBlock],
    *,
    config: OffloadConfig,
    parallel: ParallelConfig,
    pool: SlotPool,
    copy_gather: bool,
    counters: TransferCounters,
    rank: int,
    journal: Journal,
) -> Transports:
    """One transport per weight axis of the plan, on one pair of streams."""
    cfg = config
    copy_stream, comm_stream = platform.new_stream(), platform.new_stream()
    out = Transports()
    stacks = list(dict.fromkeys(b.stack for b in blocks))
    budgets = plan.read_ahead_pin_budgets()
    for axis, nbytes in plan.read_ahead_sizes.items():  # [Note: disk read-ahead]
        ahead = out.aheads[axis] = ReadAhead(
            platform,
            buffer_nbytes=nbytes,
            pin=cfg.pin_memory,
            rank=rank,
            pin_budget_nbytes=budgets[axis],
            # built after the agreement: one rank failing here would leave its peers to the
            # timeout, so a buffer that cannot be pinned stays pageable (slower, same bits)
            require_pinned=False,
        )
        journal.record(f"read-ahead {axis}", ahead.close)
    if plan.mapped or "local" in out.aheads:  # whole blocks read from their file
        staging = StagedTransport(
            platform,
            copy_stream=copy_stream,
            chunk_nbytes=max(b.layout.chunk_nbytes for b in blocks),
            counters=counters,
            pin=cfg.pin_memory,
            pin_budget_nbytes=plan.pin_budget_nbytes,
            require_pinned=cfg.pin_failure_policy == "fail",
            rank=rank,
            num_buffers=NUM_STAGING_BUFFERS if plan.mapped else 0,
            ahead=out.aheads.get("local"),
        )
        out.staging = staging
        journal.record("staging", staging.close)
        out.by_axis = {s.group_axis: staging for s in stacks if s.group_size == 1}
    for stack in stacks:
        if stack.group_axis in out.by_axis:
            continue
        group, ranks = (None, [rank])
        if stack.group_size > 1:
            group, ranks = weight_group(
                parallel,
                stack.group_axis,
                rank=rank,
                timeout_s=cfg.collective_timeout_s,
                max_ctas=cfg.nccl_max_ctas,
            )
        group_rank = ranks.index(rank)
        check = None
        if group is not None and cfg.verify_block_sequence:
            check = SequenceCheck(platform, group, group_rank, len(ranks), [b.name for b in blocks])
        ce = None
        # one axis per symmetric allocation: its barrier counters and tags are indexed by
        # group rank, so a second AllGather axis (every rank calls this in the same order)
        # keeps NCCL
        if group is not None and copy_gather and out.gather_sync is None:
            assert pool.base is not None
            ce = CopyEngineGather(
                platform,
                pool.base,
                group,
                group_rank=group_rank,
                group_size=len(ranks),
                timeout_s=cfg.collective_timeout_s,
                sync=cfg.gather_sync,
            )
            journal.record("copy-engine gather", ce.close)
            out.gather_sync = ce.sync
        out.by_axis[stack.group_axis] = BlockTransport(
            platform,
            group=group,
            group_rank=group_rank,
            group_size=len(ranks),
            copy_stream=copy_stream,
            comm_stream=comm_stream,
            max_chunks=plan.max_chunks(stack.group_axis),
            counters=counters,
            sequence_check=check,
            ce_gather=ce,
            ahead=out.aheads.get(stack.group_axis) if stack.group_size > 1 else None,
        )
        if len(ranks) > 1 and out.group_size == 1:
            out.group_rank, out.group_size = group_rank, len(ranks)
    for axis in dict.fromkeys(b.stack.group_axis for b in blocks if b.encoded is not None):
        encoded = [b for b in blocks if b.encoded is not None and b.stack.group_axis == axis]
        (name,) = {b.stack.codec for b in encoded}
        transport = out.by_axis[axis]
        assert isinstance(transport, BlockTransport)  # encoded blocks are region-backed
        faults.check("staging_allocation")
        decode_stream = platform.new_stream()
        decoder = Decoder(
            platform,
            get_codec(platform, name, decode_stream),
            decode_stream=decode_stream,
            max_nbytes=max(b.encoded.layout.nbytes for b in encoded if b.encoded),
            max_pieces=max(b.layout.num_chunks for b in encoded),
            piece_sizes={
                p.raw_nbytes
                for b in encoded
                if b.encoded
                for p in b.encoded.layout.pieces
                if not p.stored
            },
            rank=rank,
        )
        out.decoders.append(decoder)
        out.encoded_by_axis[axis] = transport.with_decoder(decoder)
    return out


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
    blocks: list[LayerBlock],
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
        fuser=BlockFuse(platform, scheduler, blocks, rank=rank),
    )
    shared_names = {b.name for b in blocks if b.node_shared}
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
                sb.shard,
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
