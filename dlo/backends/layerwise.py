"""The layerwise backend: the ring at any group size (``mode="layer"``).

The single-rank ring and distributed layerwise offload are one code path: a stack with
group size 1 (rank-local transfer, or no peers) is simply the degenerate case of the
chunked AllGather transport (see :mod:`dlo.plan.layout` and :mod:`dlo.runtime.transport`).

Install sequence (every step journaled; see [Note: one journal for enable and disable]):

1. resolve the plan (pure) and check the selected blocks (:mod:`dlo.plan.checks`);
2. lay out every block for its stack's group size and digest the manifest;
3. local preparation: one exact-size host region, filled block by block with this rank's
   slices, pinned (budgeted); device slots. With group size 1 the pageable originals are
   released as soon as their block is in the region (rollback rebuilds them from it);
4. startup agreement when any stack has group size > 1 ([Note: startup agreement]); a
   multi-rank startup that fails after its first exchange marks the process and the store
   ([Note: one failed startup ends the worker]);
5. weight groups, non-block state and declared resident modules to the device, resident
   blocks loaded once, rings and hooks installed, block 0 of each ring preloaded. With
   group size > 1 the originals are released only here, after every rank agreed, because a
   rank's host shard alone cannot rebuild them.

[Note: what disable restores]
``disable`` undoes the journal: hooks removed, slots and host memory freed, non-block
tensors moved back to the device they came from. Streamed and resident blocks of group size
1 get their original tensors back (same Parameter objects, shapes, strides, dtypes and
bytes, on their original device). Blocks of an AllGather stack (group size > 1) cannot be
rebuilt from one rank's 1/G shard without a collective, which disable never issues; their
tensors stay empty placeholders and the model must be reloaded to be used without dlo.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dlo import faults
from dlo.backends.auto import agree_requests, is_automatic, resolve_automatic
from dlo.backends.base import OffloadBackend, claim_components
from dlo.backends.model_hooks import (
    check_not_released,
    install_apply_refusal,
    install_load_refusal_on_ancestors,
    install_state_dict_hooks,
    mark_released,
    move_tensor,
)
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.errors import BackendPoisonedError, InjectedFault, OffloadError
from dlo.hooks.foreign import is_dtensor
from dlo.hooks.registry import HookRegistry
from dlo.host.mapped import MappedBlock
from dlo.host.node_share import SharedBlock, share_host, sharers
from dlo.host.packer import pack_block
from dlo.host.region import HostRegion, charged_nbytes
from dlo.host.shards import copy_back, shard_view, unpack_tensor, written_tensors
from dlo.io.materialize import mapped_source
from dlo.journal import Journal
from dlo.parallel.agreement import RankReport, decide, exchange, settings_of
from dlo.parallel.groups import World, axis_groups, current_world, group_of, weight_group
from dlo.parallel.store import describe_failure, exchanges_started, startup_failed
from dlo.plan.checks import check_blocks, non_block_tensors
from dlo.plan.declarations import get_by_path
from dlo.plan.layout import (
    MIB,
    BlockLayout,
    build_manifest,
    describe_entries,
    module_tensor_entries,
    plan_block_layout,
)
from dlo.plan.topology import BlockStack, ResolvedOffloadPlan, every_component, resolve_offload_plan
from dlo.platform.device import Platform
from dlo.platform.env import host_name, process_peak_rss_bytes, torchrun_env
from dlo.runtime.ce_gather import CopyEngineGather
from dlo.runtime.ring import BlockRing, RingScheduler, StreamedBlock
from dlo.runtime.sequence import SequenceCheck
from dlo.runtime.slots import SlotPool
from dlo.runtime.staged import StagedTransport
from dlo.runtime.transport import BlockTransport, TransferCounters

logger = logging.getLogger(__name__)

HOOK_NAME = "dlo.ring"


@dataclass(eq=False)
class _Block:
    """A selected block during install."""

    name: str
    module: nn.Module
    stack: BlockStack
    resident: bool
    layout: BlockLayout
    entries: list[tuple[str, str, torch.Tensor]]
    region_index: int = -1
    """Position in the manifest."""
    region: HostRegion | None = None
    """The host region holding this block: this rank's, or the node-shared copy."""
    host_index: int = -1
    """The block's index in ``region``."""
    original_devices: list[torch.device] = field(default_factory=list)
    mapped: MappedBlock | None = None
    """With ``host_backing="mapped"``: the block's host backing (no region bytes)."""

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for _, _, t in self.entries]

    @property
    def node_shared(self) -> bool:
        return self.stack.transfer == "node-shared"

    def host_view(self) -> torch.Tensor:
        """The block's bytes in its host region."""
        assert self.region is not None
        return self.region.view(self.host_index)


class LayerwiseBackend(OffloadBackend):
    """Streams the plan's block stacks through shared device slots (see module docstring).

    Args:
        config: the offload config (``mode="layer"``).
        parallel: the job's parallel layout.
        platform: device, streams, pinning.
    """

    name = "layer"

    def __init__(self, config: OffloadConfig, parallel: ParallelConfig, platform: Platform) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.platform = platform
        self.world: World = current_world()
        self.plan: ResolvedOffloadPlan | None = None
        self._poisoned: str | None = None
        self._reset_state()

    def _reset_state(self) -> None:
        self._blocks: list[_Block] = []
        self._region: HostRegion | None = None
        self._shared: HostRegion | None = None
        """The node-shared host copy (see [Note: node-shared host copy])."""
        self._pool: SlotPool | None = None
        self._scheduler: RingScheduler | None = None
        self._staging: StagedTransport | None = None
        self._counters = TransferCounters()
        self._resident_nbytes = 0
        self._placed_nbytes = 0
        self._group_rank = 0
        self._group_size = 1
        self._enable_time_s = 0.0
        self._enable_peak_rss = 0
        self._fallback_blocks: tuple[str, ...] = ()
        self._copy_gather = False
        self._gather_sync: str | None = None
        """The copy-engine gather's barrier (``"stream"`` or ``"kernel"``), None with NCCL."""
        self._policy: dict[str, Any] | None = None

    # ------------------------------------------------------------------ lifecycle
    def _check_can_enable(self) -> None:
        if self._poisoned is not None:
            raise BackendPoisonedError(
                f"enable refused: {self._poisoned}; recreate the worker", rank=self.world.rank
            )
        super()._check_can_enable()

    def disable(self) -> None:
        """Remove everything enable installed; a no-op when not enabled.

        Raises:
            dlo.OffloadError: another thread is running a block's forward (nothing changed).
        """
        sched = self._scheduler
        if sched is not None and self.is_enabled():
            sched.begin_disable()
        if sched is not None and sched.poisoned is not None:
            self._poisoned = sched.poisoned  # the group may be misaligned: no re-enable
        super().disable()
        self._reset_state()

    def _install(self, pipeline: Any, journal: Journal) -> None:
        started = exchanges_started()
        try:
            self._install_steps(pipeline, journal)
        except BaseException as e:
            if exchanges_started() != started:  # see [Note: one failed startup ends the worker]
                startup_failed(describe_failure(e), rank=self.world.rank)
            raise

    def _install_steps(self, pipeline: Any, journal: Journal) -> None:
        t0 = time.perf_counter()
        cfg, par, world = self.config, self.parallel, current_world()
        self.world = world
        if world.distributed:
            par.check_world_size(world.size)
        plan = resolve_offload_plan(pipeline, cfg, par)
        faults.check("config_validated")
        if not plan.stacks or not any(s.block_paths for s in plan.stacks):
            raise OffloadError(
                "no blocks to stream: the pipeline declares no block stacks for the selected "
                f"components (warnings: {list(plan.warnings) or 'none'})",
                rank=world.rank,
            )
        agree_requests(cfg, plan, world)  # every exchanging rank: the same "auto"s
        if is_automatic(cfg):  # before any layout: it may change group sizes
            cfg, plan, self._policy = resolve_automatic(
                pipeline, plan, cfg, par, self.platform, world
            )
        self.plan = plan
        distributed = any(s.group_size > 1 for s in plan.stacks)  # gathers
        exchanges = distributed or any(s.share_size > 1 for s in plan.stacks)
        if exchanges and not world.distributed:
            raise OffloadError(
                "an AllGather or node-shared stack needs a process group: run under torchrun "
                "(or call torch.distributed.init_process_group) with the ParallelConfig's "
                "world size",
                rank=world.rank,
            )
        group_ranks = {
            s.group_axis: group_of(par, s.group_axis, world.rank) if world.distributed else [0]
            for s in plan.stacks
        }

        # 2-3: layouts, manifest, local preparation (failures caught for the agreement)
        local_error: BaseException | None = None
        report = RankReport(
            rank=world.rank,
            ok=True,
            host=host_name(),
            token=secrets.token_hex(8),
            settings=settings_of(cfg, plan.stacks),
        )
        blocks: list[_Block] = []
        try:  # every failure from here to the vote is the vote's (peers are waiting in it)
            if cfg.host_backing == "mapped":
                _check_mapped_stacks(plan)
            _check_shared_stacks(plan)
            claim_components(
                [(p, get_by_path(pipeline, p)) for p in _streamed_components(plan)],
                f"dlo {self.name} backend #{id(self):x}",
                journal,
                rank=world.rank,
            )
            if distributed and cfg.gather_engine == "copy" and not self.platform.has_streams:
                raise ValueError(
                    f"gather_engine='copy' needs CUDA GPUs with peer access; this rank runs "
                    f"on {self.platform.device} (use gather_engine='nccl')"
                )
            blocks = self._select_blocks(pipeline, plan)
            self._blocks = blocks
            check_blocks(
                [(b.name, b.module) for b in blocks],
                every_component(pipeline, plan),
                rank=world.rank,
            )
            check_not_released(
                [(f"{b.name}.{n}", t) for b in blocks for n, _, t in b.entries], rank=world.rank
            )
            faults.check("manifest_build")
            manifest = build_manifest([b.layout for b in blocks])
            report.digest = manifest.digest
            # the whole layout of every axis in use: equal on every rank of a sound job
            report.groups = tuple(
                tuple(tuple(g) for g in axis_groups(par, a)) for a in sorted(group_ranks)
            )
            self._prepare_host(blocks, journal, group_ranks)
            assert self._region is not None
            budget = None
            if cfg.pin_budget_gb is not None:
                # node-shared blocks come first (packed after the vote; charged 1/L): they
                # are the streamed stacks a node shares, the private ones here are rank-local
                # leftovers (an encoder not declared replicated)
                budget = int(cfg.pin_budget_gb * (1 << 30)) - sum(
                    charged_nbytes(b.layout.shard_nbytes, self._expected_sharers(b.stack))
                    for b in blocks
                    if b.node_shared and not b.resident
                )
            # resident blocks cross the link once, at enable: pinning them would only take
            # budget from the blocks streamed every forward
            streamed = [i for i, b in enumerate(blocks) if not b.resident]
            pin = (
                self._region.pin(self.platform, budget_nbytes=budget, blocks=streamed)
                if cfg.pin_memory
                else None
            )
            if pin is not None:
                report.unpinned_blocks = tuple(blocks[i].name for i in pin.unpinned_blocks)
            slot_nbytes = (
                max(b.layout.padded_nbytes for b in blocks if not b.resident)
                if any(not b.resident for b in blocks)
                else 0
            )
            self._pool = self._allocate_slots(cfg, slot_nbytes, distributed)
            report.symmetric_slots = self._pool.base is not None
            journal.record("device slots", self._release_slots)
        except Exception as e:
            if not exchanges:
                raise
            local_error = e
            report.ok, report.error = False, f"{type(e).__name__}: {e}"

        # 4: agreement (a group of one agrees with itself)
        if exchanges:
            faults.check("agreement")
            reports = exchange(
                report, rank=world.rank, world_size=world.size, timeout_s=cfg.collective_timeout_s
            )
        else:
            reports = [report]
        verdict = decide(
            reports,
            pin_failure_policy=cfg.pin_failure_policy,
            gather_engine=cfg.gather_engine if distributed else "nccl",  # nothing to gather
        )
        if not verdict.ok:
            if exchanges:
                self._poisoned = f"multi-rank startup failed ({verdict.message})"
            if isinstance(local_error, ValueError):  # this rank's own config was refused
                raise ValueError(verdict.message) from local_error
            raise OffloadError(verdict.message, rank=world.rank) from local_error
        self._keep_pageable(self._region, blocks, verdict.fallback_blocks, "blocks")
        self._copy_gather = verdict.copy_gather

        # 5: after agreement; failures here poison a multi-rank backend
        try:
            self._share_host_copy(blocks, reports, journal, world, exchanges)
            self._build_runtime(pipeline, plan, blocks, journal, world)
            # 6: commit
            faults.check("commit")
        except BaseException as e:
            if exchanges:
                self._poisoned = f"failure after startup agreement ({e!r})"
            raise
        self._enable_time_s = time.perf_counter() - t0
        self._enable_peak_rss = process_peak_rss_bytes()
        logger.info(
            "dlo layer offload enabled: %d streamed + %d resident blocks, %d slots x %.1f MiB, "
            "host %.1f MiB (pinned %.1f MiB), node-shared %.1f MiB over %d ranks, mapped from "
            "the checkpoint %.1f MiB, %.2fs",
            sum(not b.resident for b in blocks),
            sum(b.resident for b in blocks),
            cfg.num_slots,
            (self._pool.slot_nbytes if self._pool else 0) / MIB,
            self._region.nbytes / MIB if self._region else 0,
            self._region.pinned_nbytes / MIB if self._region else 0,
            self._shared.nbytes / MIB if self._shared else 0,
            self._shared.share_ranks if self._shared else 1,
            sum(b.mapped.mapped_nbytes for b in blocks if b.mapped) / MIB,
            self._enable_time_s,
        )

    def _after_failed_enable(self) -> None:
        self._reset_state()

    # ------------------------------------------------------------------ steps
    def _select_blocks(self, pipeline: Any, plan: ResolvedOffloadPlan) -> list[_Block]:
        chunk = self.config.chunk_mb * MIB
        out: list[_Block] = []
        for stack in plan.stacks:
            for i, path in enumerate(stack.block_paths):
                module = get_by_path(pipeline, path)
                entries = module_tensor_entries(module)
                layout = plan_block_layout(
                    path,
                    describe_entries(entries),
                    group_size=stack.group_size,
                    chunk_nbytes=chunk,
                )
                out.append(_Block(path, module, stack, i < stack.num_resident, layout, entries))
        return out

    def _prepare_host(
        self, blocks: list[_Block], journal: Journal, group_ranks: dict[str, list[int]]
    ) -> None:
        if self.config.host_backing == "mapped":
            self._map_blocks(blocks)
            # the files stay open while blocks are read from them, and until disable has
            # rebuilt the blocks from them (load_pipeline's close is deferred until then)
            for ckpt in {
                id(c): c for b in blocks if b.mapped for c in b.mapped.checkpoints
            }.values():
                ckpt.retain()
                journal.record("checkpoint files", ckpt.release)
        region = HostRegion(
            [0 if b.mapped or b.node_shared else b.layout.shard_nbytes for b in blocks]
        )
        self._region = region
        journal.record("host region", self._close_region)
        for i, b in enumerate(blocks):
            b.region_index = i
            if b.node_shared:  # packed after the agreement, into the node's copy
                continue
            b.region, b.host_index = region, i
            if b.mapped is not None:
                # its bytes stay in the checkpoint: nothing to pack, the originals go
                self._release_originals(b)
                journal.record(f"release {b.name}", functools.partial(self._restore_block, b))
                continue
            rank = (
                group_ranks[b.stack.group_axis].index(self.world.rank)
                if self.world.distributed
                else 0
            )
            faults.check("host_fill")
            # pack_shard, or straight from the file for checkpoint-mapped tensors
            pack_block(region.view(i), b.layout, rank, b.tensors)
            if b.layout.group_size == 1:
                # the region now holds every byte of this block: release the originals
                self._release_originals(b)
                journal.record(f"release {b.name}", functools.partial(self._restore_block, b))

    def _map_blocks(self, blocks: list[_Block]) -> None:
        """Give every block its :class:`MappedBlock` (see [Note: mapped host backing])."""
        for b in blocks:
            b.mapped = MappedBlock(
                b.name, b.layout, [mapped_source(t) or t.data for t in b.tensors]
            )
        if not any(b.mapped is not None and b.mapped.mapped_nbytes for b in blocks):
            for b in blocks:
                b.mapped = None
            raise ValueError(
                "host_backing='mapped' serves blocks from the checkpoint they were loaded "
                "from, but no tensor of the streamed blocks aliases a checkpoint: load the "
                "model with dlo.load_pipeline (not copy=True), or use host_backing='region' "
                "(a tensor holds the file's bytes only until a disable gives it private "
                "memory, .to() new memory or an in-place write changes it)"
            )

    def _release_originals(self, b: _Block) -> None:
        b.original_devices = [t.device for t in b.tensors]
        for t in b.tensors:
            t.data = torch.empty(0, dtype=t.dtype, device=self.platform.device)

    def _restore_block(self, b: _Block) -> None:
        if b.mapped is not None:
            for i, (t, dev) in enumerate(zip(b.tensors, b.original_devices)):
                t.data = b.mapped.rebuild(i).to(dev)
            return
        shard = b.host_view()
        for spec, t, dev in zip(b.layout.tensors, b.tensors, b.original_devices):
            t.data = unpack_tensor(shard, spec, dev)

    def _expected_sharers(self, stack: BlockStack) -> int:
        """L before the agreement names the hosts: the share group's ranks on this rank's
        node as torchrun places them (``LOCAL_WORLD_SIZE`` consecutive ranks per node)."""
        world = self.world
        if not world.distributed or stack.share_size == 1:
            return 1
        per_node = max(1, torchrun_env().local_world_size)
        node = world.rank // per_node
        group = group_of(self.parallel, stack.share_axis, world.rank)
        return max(1, sum(r // per_node == node for r in group))

    def _share_host_copy(
        self,
        blocks: list[_Block],
        reports: list[RankReport],
        journal: Journal,
        world: World,
        exchanges: bool,
    ) -> None:
        """Pack the node-shared blocks into the node's copy (see [Note: node-shared host
        copy]). The agreement compared every stack's transfer (``settings_of``), so either
        every exchanging rank has such blocks and meets the others here, or none has."""
        shared = [b for b in blocks if b.node_shared]
        if not shared:
            return
        assert self._region is not None
        cfg = self.config
        axis = shared[0].stack.share_axis
        # no exchange: a share group of one (the weight axis has one rank), or one process
        members = (
            sharers(reports, group_of(self.parallel, axis, world.rank), world.rank)
            if exchanges
            else [world.rank]
        )
        token_of = {r.rank: r.token for r in reports}
        budget = None
        if cfg.pin_budget_gb is not None:
            budget = int(cfg.pin_budget_gb * (1 << 30)) - self._region.charged_pinned_nbytes
        region, fallback = share_host(
            [SharedBlock(b.name, b.layout, b.tensors, streamed=not b.resident) for b in shared],
            tokens=[token_of[r] for r in members],
            members=members,
            rank=world.rank,
            world_size=world.size if exchanges else 1,
            platform=self.platform,
            pin=cfg.pin_memory,
            budget_nbytes=budget,
            pin_failure_policy=cfg.pin_failure_policy,
            timeout_s=cfg.collective_timeout_s,
            journal=journal,
        )
        self._shared = region
        self._keep_pageable(region, shared, fallback, "node-shared blocks")
        for i, b in enumerate(shared):
            b.region, b.host_index = region, i
            self._release_originals(b)
            journal.record(f"release {b.name}", functools.partial(self._restore_block, b))

    def _allocate_slots(self, cfg: OffloadConfig, slot_nbytes: int, distributed: bool) -> SlotPool:
        """Slots in symmetric memory when the copy-engine gather may be used (``"copy"``;
        ``"auto"`` on CUDA, falling back to ordinary slots if that allocation fails)."""
        assert isinstance(cfg.num_slots, int)
        if distributed and cfg.gather_engine == "auto" and self.platform.has_streams:
            if not self.platform.peers_accessible():
                logger.info(
                    "no peer access between this node's GPUs: gather_engine='auto' uses NCCL"
                )
                return SlotPool.allocate(self.platform, cfg.num_slots, slot_nbytes)
            try:
                return SlotPool.allocate(self.platform, cfg.num_slots, slot_nbytes, symmetric=True)
            except InjectedFault:
                raise
            except (RuntimeError, ImportError, OSError) as e:  # an allocation, not a config issue
                logger.info("no symmetric-memory slots (%s): gather_engine='auto' uses NCCL", e)
        symmetric = distributed and cfg.gather_engine == "copy"
        return SlotPool.allocate(self.platform, cfg.num_slots, slot_nbytes, symmetric=symmetric)

    def _close_region(self) -> None:
        if self._region is not None:
            self._region.close()

    def _release_slots(self) -> None:
        self.platform.synchronize()
        if self._pool is not None:
            self._pool.release()

    def _keep_pageable(
        self, region: HostRegion | None, blocks: list[_Block], names: tuple[str, ...], what: str
    ) -> None:
        """The group decided: every rank keeps ``names`` pageable, for equal timing
        (``blocks``: the region's blocks, in its order)."""
        self._fallback_blocks += names
        if names and region is not None:
            keep = set(names)
            region.unpin([i for i, b in enumerate(blocks) if b.name in keep])
            logger.warning(
                "dlo: %d %s stay pageable (pin_failure_policy='whole_block_fallback'): %s",
                len(names),
                what,
                ", ".join(names[:8]),
            )

    def _build_runtime(
        self,
        pipeline: Any,
        plan: ResolvedOffloadPlan,
        blocks: list[_Block],
        journal: Journal,
        world: World,
    ) -> None:
        cfg, pf = self.config, self.platform
        assert self._region is not None and self._pool is not None
        copy_stream, comm_stream = pf.new_stream(), pf.new_stream()
        transports: dict[str, BlockTransport | StagedTransport] = {}
        mapped = [b.mapped for b in blocks if b.mapped is not None]
        if mapped:  # every stack is rank-local (_check_mapped_stacks)
            staging = StagedTransport(
                pf,
                copy_stream=copy_stream,
                chunk_nbytes=max(m.layout.chunk_nbytes for m in mapped),
                counters=self._counters,
                pin=cfg.pin_memory,
                pin_budget_nbytes=(
                    int(cfg.pin_budget_gb * (1 << 30)) if cfg.pin_budget_gb is not None else None
                ),
                require_pinned=cfg.pin_failure_policy == "fail",
                rank=world.rank,
            )
            self._staging = staging
            journal.record("staging", staging.close)
            transports = {s.group_axis: staging for s in plan.stacks}
        for stack in plan.stacks:
            if stack.group_axis in transports:
                continue
            group, ranks = (None, [world.rank])
            if stack.group_size > 1:
                group, ranks = weight_group(
                    self.parallel,
                    stack.group_axis,
                    rank=world.rank,
                    timeout_s=cfg.collective_timeout_s,
                    max_ctas=cfg.nccl_max_ctas,
                )
            max_chunks = max(
                (b.layout.num_chunks for b in blocks if b.stack.group_axis == stack.group_axis),
                default=0,
            )
            group_rank = ranks.index(world.rank)
            check = None
            if group is not None and cfg.verify_block_sequence:
                check = SequenceCheck(pf, group, group_rank, len(ranks), [b.name for b in blocks])
            ce = None
            # one axis per symmetric allocation: its barrier counters and tags are indexed by
            # group rank, so a second AllGather axis (every rank calls this in the same
            # order) keeps NCCL
            if group is not None and self._copy_gather and self._gather_sync is None:
                assert self._pool.base is not None
                ce = CopyEngineGather(
                    pf,
                    self._pool.base,
                    group,
                    group_rank=group_rank,
                    group_size=len(ranks),
                    timeout_s=cfg.collective_timeout_s,
                    sync=cfg.gather_sync,
                )
                journal.record("copy-engine gather", ce.close)
                self._gather_sync = ce.sync
            transports[stack.group_axis] = BlockTransport(
                pf,
                group=group,
                group_rank=group_rank,
                group_size=len(ranks),
                copy_stream=copy_stream,
                comm_stream=comm_stream,
                max_chunks=max_chunks,
                counters=self._counters,
                sequence_check=check,
                ce_gather=ce,
            )
            if len(ranks) > 1 and self._group_size == 1:
                # stats' group: the first gathering stack's (stats' "transfer" is "allgather"
                # when any stack gathers), else one rank
                self._group_rank, self._group_size = group_rank, len(ranks)

        self._place_non_block_state(pipeline, plan, blocks, journal)
        faults.check("first_transfer")
        self._load_resident(blocks, transports, journal)

        scheduler = RingScheduler(pf, self._pool, rank=world.rank)
        self._scheduler = scheduler
        journal.record("rings", self._unbind_rings)
        by_stack: dict[int, list[StreamedBlock]] = {}
        for b in blocks:
            if b.resident:
                continue
            sb = StreamedBlock(
                name=b.name,
                module=b.module,
                layout=b.layout,
                shard=b.mapped or b.host_view(),
                tensors=b.tensors,
                transport=transports[b.stack.group_axis],
                index=b.region_index,
                host_writable=b.layout.group_size == 1 and not b.mapped and not b.node_shared,
            )
            by_stack.setdefault(id(b.stack), []).append(sb)
        for stack in plan.stacks:
            sbs = by_stack.get(id(stack), [])
            if sbs:
                scheduler.add_ring(BlockRing(stack.container_path, sbs))

        registry = HookRegistry(owner=f"dlo.layer#{id(self):x}")
        journal.record("hooks", registry.remove_all)
        faults.check("hook_install")
        shared_names = {b.name for b in blocks if b.node_shared}
        for ring in scheduler.rings:
            for sb in ring.blocks:
                registry.register(sb.module, HOOK_NAME, scheduler.hook_for(sb))
                install_state_dict_hooks(
                    registry,
                    sb.module,
                    sb.name,
                    sb.layout,
                    sb.shard,
                    sb.tensors,
                    rank=world.rank,
                    copy=sb.name in shared_names,
                )
        install_load_refusal_on_ancestors(
            registry,
            pipeline,
            [sb.name for ring in scheduler.rings for sb in ring.blocks],
            rank=world.rank,
        )
        install_apply_refusal(registry, pipeline, [b.name for b in blocks], rank=world.rank)
        for ring in scheduler.rings:
            for sb in ring.blocks:
                for t, ph in zip(sb.tensors, sb.placeholders):
                    t.data = ph
        scheduler.preload()
        pf.synchronize()

    def _place_non_block_state(
        self, pipeline: Any, plan: ResolvedOffloadPlan, blocks: list[_Block], journal: Journal
    ) -> None:
        device = self.platform.device
        block_ids = {id(t) for b in blocks for t in b.tensors}
        targets: list[tuple[str, torch.Tensor]] = []
        for path in _streamed_components(plan):
            targets += non_block_tensors(get_by_path(pipeline, path), block_ids)
        for path in plan.resident_modules:
            targets += non_block_tensors(get_by_path(pipeline, path), block_ids)
        seen: set[int] = set()
        faults.check("device_placement")
        for _name, t in targets:
            if id(t) in seen or t.device == device or is_dtensor(t):
                continue  # DTensors belong to FSDP2 (see [Note: one owner per parameter])
            seen.add(id(t))
            origin = t.device
            t.data = t.data.to(device)
            self._placed_nbytes += t.numel() * t.element_size()
            journal.record("place", functools.partial(move_tensor, t, origin))

    def _load_resident(
        self,
        blocks: list[_Block],
        transports: dict[str, BlockTransport | StagedTransport],
        journal: Journal,
    ) -> None:
        assert self._region is not None
        pf = self.platform
        for b in blocks:
            if not b.resident:
                continue
            buffer = torch.empty(b.layout.padded_nbytes, dtype=torch.uint8, device=pf.device)
            host: Any = b.mapped or b.host_view()
            transports[b.stack.group_axis].load(
                b.layout,
                host,
                buffer,
                free_event=pf.new_event(),
                ready_event=pf.new_event(),
                index=b.region_index,
            )
            for spec, t in zip(b.layout.tensors, b.tensors):
                t.data = shard_view(buffer, spec)
            self._resident_nbytes += b.layout.padded_nbytes
            if b.layout.group_size > 1:  # group size 1: the release step's undo restores it
                journal.record(f"resident {b.name}", functools.partial(self._release_originals, b))
            else:  # ... from the host region: in-place writes go back there first
                versions = [t._version for t in b.tensors]
                journal.record(
                    f"keep writes {b.name}",
                    functools.partial(self._keep_resident_writes, b, versions),
                )
        if self._staging is not None:
            self._staging.drain()
        pf.synchronize()

    def _keep_resident_writes(self, b: _Block, versions: list[int]) -> None:
        """Before a resident block (group size 1) is restored from its host copy, copy the
        tensors its forwards wrote in place into that copy (see [Note: writes into streamed
        tensors] in dlo.runtime.ring); the mapped backing's source is the read-only checkpoint."""
        written = written_tensors(b.layout.tensors, b.tensors, versions)
        if not written:
            return
        if b.mapped is not None or b.node_shared or b.region is None:
            logger.warning(
                "dlo: resident block %s wrote %s in place; its source is %s: the writes are "
                "not kept after disable",
                b.name,
                [spec.name for spec, _ in written],
                "the node-shared host copy" if b.node_shared else "the checkpoint",
            )
            return
        copy_back(b.host_view(), written)

    def _unbind_rings(self) -> None:
        self.platform.synchronize()
        if self._scheduler is not None:
            self._scheduler.unbind_all()
            self._scheduler.close()
        mark_released([t for b in self._blocks if b.layout.group_size > 1 for t in b.tensors])

    # ------------------------------------------------------------------ telemetry
    def stats(self) -> dict[str, Any]:
        """Plain-value statistics (DESIGN.md section 2); synchronizes the device."""
        sched, region, pool, staging = self._scheduler, self._region, self._pool, self._staging
        shared = self._shared
        if sched is not None:
            self.platform.synchronize()
            sched.harvest_all()
        streamed = [b for r in sched.rings for b in r.blocks] if sched else []
        transfers = sorted({b.stack.transfer for b in self._blocks}) if self._blocks else []
        return {
            "enabled": self.is_enabled(),
            "transfer": next(
                (t for t in ("allgather", "node-shared") if t in transfers), "rank-local"
            ),
            "group_size": self._group_size,
            "group_rank": self._group_rank,
            "host_backing": self.config.host_backing,
            # what this rank holds, a node-shared block's bytes charged 1/L to each sharer
            "host_nbytes": sum(
                b.mapped.private_nbytes
                if b.mapped
                else charged_nbytes(
                    b.layout.shard_nbytes, shared.share_ranks if shared and b.node_shared else 1
                )
                for b in self._blocks
            ),
            "host_mapped_nbytes": sum(b.mapped.mapped_nbytes for b in self._blocks if b.mapped),
            "host_region_nbytes": region.nbytes if region else 0,
            "host_shared_nbytes": shared.nbytes if shared else 0,
            "host_share_ranks": shared.share_ranks if shared else 1,
            "host_pinned_nbytes": (region.pinned_nbytes if region else 0)
            + (shared.charged_pinned_nbytes if shared else 0)
            + (staging.pinned_nbytes if staging else 0),
            "num_staging_buffers": staging.num_buffers if staging else 0,
            "staging_buffer_nbytes": staging.buffer_nbytes if staging else 0,
            "staging_host_wait_ms": staging.host_wait_s * 1e3 if staging else 0.0,
            "device_slot_nbytes": pool.nbytes if pool else 0,
            "device_symmetric_nbytes": pool.symmetric_nbytes if pool else 0,
            "device_resident_block_nbytes": self._resident_nbytes,
            "device_non_block_nbytes": self._placed_nbytes,
            "h2d_nbytes": self._counters.h2d_nbytes,
            "allgather_nbytes": self._counters.allgather_nbytes,
            "num_loads": self._counters.num_loads,
            "exposed_wait_ms": sum(b.wait.total_ms for b in streamed if b.wait),
            "block_wait_ms": {b.name: b.wait.total_ms for b in streamed if b.wait},
            "dropped_wait_samples": sum(b.wait.dropped for b in streamed if b.wait),
            "num_demand_loads": sum(b.num_demand_loads for b in streamed),
            "num_streamed_blocks": len(streamed),
            "num_resident_blocks": sum(b.resident for b in self._blocks),
            "num_slots": len(pool.slots) if pool else 0,
            "gather_engine": "copy" if self._gather_sync is not None else "nccl",
            "gather_sync": self._gather_sync,
            "pageable_blocks": list(self._fallback_blocks),
            "enable_time_s": self._enable_time_s,
            "enable_peak_rss_nbytes": self._enable_peak_rss,
            "policy": self._policy,
        }


def _check_mapped_stacks(plan: ResolvedOffloadPlan) -> None:
    for s in plan.stacks:
        if s.group_size > 1 or s.transfer == "node-shared":
            raise ValueError(
                f"host_backing='mapped' applies to rank-local stacks only, but stack "
                f"{s.container_path!r} uses transfer {s.transfer!r} (group size "
                f"{s.group_size}): AllGather stacks keep per-rank shards, node-shared ones "
                "a node's copy in shared memory (use host_backing='region')"
            )


def _check_shared_stacks(plan: ResolvedOffloadPlan) -> None:
    axes = {s.container_path: s.share_axis for s in plan.stacks if s.transfer == "node-shared"}
    if len(set(axes.values())) > 1:
        raise ValueError(
            f"node-shared stacks share one host copy per node along one weight axis, but they "
            f"resolve to different axes: {axes} (set one weight_axis)"
        )


def _streamed_components(plan: ResolvedOffloadPlan) -> list[str]:
    out: list[str] = []
    for s in plan.stacks:
        if s.component_path not in out:
            out.append(s.component_path)
    return out
