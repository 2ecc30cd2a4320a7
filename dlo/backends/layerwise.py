"""The layerwise backend: the ring at any group size (``mode="layer"``).

The single-rank ring and distributed layerwise offload are one code path: a stack with group
size 1 is the degenerate case of the chunked AllGather transport (:mod:`dlo.runtime.transport`).

Install sequence (every step journaled; see [Note: one journal for enable and disable] in
:mod:`dlo.journal`):

1. resolve the topology (pure), agree on and decide what is automatic (:mod:`dlo.backends.auto`),
   the re-planned DiTs' resident blocks made pins (:mod:`dlo.backends.replan_setup`);
2. the layer plan: every block laid out for its group size, the manifest, the slot size and
   the pin budgets (pure; [Note: layer plan] in :mod:`dlo.plan.layers`);
3. local preparation (:mod:`dlo.backends.layer_host`): the selected blocks checked, one
   exact-size host region filled block by block with this rank's slices, pinned within the
   budget; device slots. With group size 1 the pageable originals are released as soon as
   their block is in the region (rollback rebuilds them from it);
4. startup agreement, on each exchanged block's content fingerprint too, when any stack
   gathers or shares a node's copy ([Note: startup agreement] in :mod:`dlo.parallel.agreement`);
   a multi-rank startup that fails after its first exchange marks the process and the store
   ([Note: one failed startup ends the worker] in :mod:`dlo.parallel.store`);
5. the node-shared copy, then (:mod:`dlo.backends.layer_runtime`) weight groups and
   transports, non-block state and declared resident modules to the device, resident blocks
   loaded once, rings and hooks installed, block 0 of each ring preloaded. With group size
   > 1 the originals are released only here, after every rank agreed, because a rank's host
   shard alone cannot rebuild them.

[Note: what disable restores]
``disable`` undoes the journal: hooks removed, slots and host memory freed, non-block
tensors moved back to the device they came from. Streamed and resident blocks of group size
1 get their original tensors back (same Parameter objects, shapes, strides, dtypes and
bytes, on their original device). Blocks of an AllGather stack (group size > 1) cannot be
rebuilt from one rank's 1/G shard without a collective, which a plain disable never issues:
their tensors stay empty placeholders, are marked released (a later enable is refused), and
their forward raises a dlo error saying to reload the model. ``disable(restore=True)`` is
the collective way back: every rank of the group calls it, each AllGather block is gathered
once more (the resident ones are already whole on the device) and unpacked into ordinary
tensors on the device the originals came from, then the same rollback runs; the model runs
without dlo and can be enabled again. A restore that fails (a peer gone, a timeout) still
disables locally, releases what it did not gather, and poisons the backend. A block read
from its checkpoint (mapped backing, disk tier) that can no longer be read back (truncated
or rewritten) is released the same way, whole, and disable raises an error naming it.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dlo import faults
from dlo.backends.auto import agree_requests, cap_to_budget, resolve_automatic
from dlo.backends.base import OffloadBackend, claim_components
from dlo.backends.layer_block import LayerBlock
from dlo.backends.layer_host import LayerHost
from dlo.backends.layer_runtime import (
    install_rings,
    load_resident,
    place_non_block_state,
    restore_gathered,
)
from dlo.backends.layer_state import LayerState
from dlo.backends.layer_transports import allocate_slots, build_transports
from dlo.backends.model_hooks import check_not_released
from dlo.backends.replan_setup import replan_setup
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.config.unset import for_device, is_automatic
from dlo.errors import BackendPoisonedError, OffloadError
from dlo.host.fingerprint import exchanged_prints
from dlo.host.region import HostRegion
from dlo.journal import Journal
from dlo.parallel.agreement import RankReport, decide, exchange, settings_of
from dlo.parallel.groups import World, axis_groups, current_world, expected_sharers, group_of, init
from dlo.parallel.store import announce, describe_failure, exchanges_started, startup_failed
from dlo.plan.checks import block_entries, check_blocks
from dlo.plan.declarations import get_by_path
from dlo.plan.layers import LayerPlan, TensorDescription, check_stacks, plan_layers
from dlo.plan.layout import describe_entries
from dlo.plan.topology import ResolvedOffloadPlan, every_component, resolve_offload_plan
from dlo.platform.device import Platform
from dlo.platform.env import host_name, process_peak_rss_bytes, torchrun_env
from dlo.runtime.ring import RingScheduler

logger = logging.getLogger(__name__)


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
        self.config, self.parallel, self.platform = config, parallel, platform
        self.world: World = current_world()
        if self.world.size > 1:
            announce(self.world.rank)  # [Note: naming a missing rank]
        self.plan: ResolvedOffloadPlan | None = None
        self.layer_plan: LayerPlan | None = None
        self._poisoned: str | None = None
        self._state = LayerState()

    # what the install built, for tests and tools
    @property
    def _blocks(self) -> list[LayerBlock]:
        return self._state.blocks

    @property
    def _region(self) -> HostRegion | None:
        return self._state.host.region if self._state.host else None

    @property
    def _shared(self) -> HostRegion | None:
        return self._state.host.shared if self._state.host else None

    @property
    def _scheduler(self) -> RingScheduler | None:
        return self._state.scheduler

    # ------------------------------------------------------------------ lifecycle
    def _check_can_enable(self) -> None:
        if self._poisoned is not None:
            raise BackendPoisonedError(
                f"enable refused: {self._poisoned}; recreate the worker", rank=self.world.rank
            )
        super()._check_can_enable()

    def disable(self, *, restore: bool = False) -> None:
        """Remove everything enable installed; a no-op when not enabled.

        Args:
            restore: also gather every AllGather block back into ordinary tensors on its
                original device, so the model runs without dlo and can be enabled again (a
                collective: every rank calls it). Without it an AllGather block keeps empty
                placeholders and its forward raises :class:`~dlo.OffloadError` ([Note: what
                disable restores]); a device budget's cap is lifted first.

        Raises:
            dlo.OffloadError: a block's forward runs in another thread, or restore=True inside
                a forward (nothing changed); a restore failed (disabled, poisoned, the blocks
                not gathered released).
        """
        sched, failed = self._state.scheduler, None
        if sched is not None and self.is_enabled():
            if restore and sched.guard.in_forward():
                raise OffloadError(
                    "disable(restore=True) from inside a forward: the running block's weights "
                    "are in use; call it once the forward returned",
                    rank=self.world.rank,
                )
            sched.begin_disable()
            if restore and sched.poisoned is None and self._poisoned is None:
                failed = self._restore()  # not again when an interrupted disable resumes
        if sched is not None and sched.poisoned is not None:
            self._poisoned = sched.poisoned  # the group may be misaligned: no re-enable
        super().disable()
        if failed is not None:
            raise failed

    def _restore(self) -> OffloadError | None:
        """Gather the AllGather blocks back (``disable(restore=True)``); a failure poisons."""
        state = self._state
        assert state.host is not None and state.transports is not None
        try:
            state.uncap()  # whole blocks come back: not under the device budget's cap
            with torch.inference_mode(False):  # [Note: no inference tensors]
                restore_gathered(self.platform, state.host, state.transports)
        except BaseException as e:
            self._poisoned = f"disable(restore=True) failed ({e!r})"
            err = OffloadError(
                f"disable(restore=True) failed: {e!r}; offload is disabled and the blocks not "
                "gathered back are released: reload the model (and recreate the worker)",
                rank=self.world.rank,
            )
            err.__cause__ = e
            return err
        return None

    def _after_failed_enable(self) -> None:
        self._state = LayerState()

    _forget = _after_failed_enable

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
        par, state, dev = self.parallel, self._state, self.platform.device.type
        cfg = for_device(self.config, dev)  # unset: per device
        plan = resolve_offload_plan(pipeline, cfg, par)
        world = self.world = self._world_for(plan)
        if world.distributed:
            par.check_world_size(world.size)
        faults.check("config_validated")
        if not plan.stacks or not any(s.block_paths for s in plan.stacks):
            raise OffloadError(
                "no blocks to stream: the pipeline declares no block stacks for the selected "
                f"components (warnings: {list(plan.warnings) or 'none'})",
                rank=world.rank,
            )
        agree_requests(self.config, plan, world, dev)  # same "auto"s
        sizing_error: Exception | None = None  # read once; reaches peers in readiness/vote
        try:
            entries = {
                p: block_entries(p, get_by_path(pipeline, p), rank=world.rank)
                for p in plan.all_block_paths
            }
            tensors = {p: describe_entries(e) for p, e in entries.items()}
        except Exception as e:
            entries, tensors, sizing_error = {}, {}, e
        if is_automatic(cfg):  # before the layer plan: it may change group sizes
            by_id = {id(t): t for e in entries.values() for _, _, t in e}
            sized = (tensors, by_id, sizing_error)  # the requested config: unset resolved there
            cfg, plan, state.policy = resolve_automatic(
                pipeline, plan, self.config, par, self.platform, world, *sized
            )
        self.plan = plan = replan_setup(pipeline, plan, self.config, state, dev)
        gathers, exchanges = plan.gathers, plan.exchanges
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
        report = RankReport(
            rank=world.rank,
            ok=True,
            host=host_name(),
            token=secrets.token_hex(8),
            settings=settings_of(cfg, plan.stacks),
        )

        # 2-3: the layer plan, local preparation (failures caught for the agreement)
        local_error: BaseException | None = None
        host: LayerHost | None = None
        blocks: list[LayerBlock] = []
        try:  # every failure from here to the vote is the vote's (peers are waiting in it)
            if sizing_error is not None:
                raise sizing_error
            check_stacks(plan.stacks, host_backing=cfg.host_backing, host_budget=cfg.host_budget_gb)
            state.uncap = cap_to_budget(self.platform, self.config.device_budget_gb, journal)
            claim_components(
                [(p, get_by_path(pipeline, p)) for p in plan.streamed_components],
                f"dlo {self.name} backend #{id(self):x}",
                journal,
                rank=world.rank,
            )
            if gathers and cfg.gather_engine == "copy" and self.platform.dist_backend == "gloo":
                shared = ", shared by ranks (DLO_SHARE_GPU=1)" if self.platform.has_streams else ""
                raise ValueError(  # symmetric memory: [Note: ranks sharing a GPU]
                    f"gather_engine='copy' needs a CUDA GPU per rank with peer access; this rank "
                    f"runs on {self.platform.device}{shared} (use gather_engine='auto' or 'nccl')"
                )
            layer = self.layer_plan = self._plan_layers(plan, tensors, cfg)
            blocks = [
                LayerBlock(bp, get_by_path(pipeline, bp.name), entries[bp.name], i)
                for i, bp in enumerate(layer.blocks)
            ]
            host = state.host = LayerHost(self.platform, cfg, blocks)
            check_blocks(
                [(b.name, b.module) for b in blocks],
                every_component(pipeline, plan),
                rank=world.rank,
            )
            check_not_released(
                [(f"{b.name}.{n}", t) for b in blocks for n, _, t in b.entries], rank=world.rank
            )
            faults.check("manifest_build")
            report.digest = layer.manifest.digest
            report.groups = tuple(  # every axis's whole layout: equal on every sound rank
                tuple(tuple(g) for g in axis_groups(par, a)) for a in sorted(group_ranks)
            )
            t_print = time.perf_counter()  # every block still whole: none packed yet
            report.weights = exchanged_prints(blocks, par, world.rank) if exchanges else ()
            state.print_time_s = (t_fill := time.perf_counter()) - t_print
            layer = self.layer_plan = host.prepare(
                layer,
                journal,
                group_rank=lambda axis: (
                    group_ranks[axis].index(world.rank) if world.distributed else 0
                ),
            )
            t_pin = time.perf_counter()
            pin = host.pin()
            state.fill_time_s, state.pin_time_s = t_pin - t_fill, time.perf_counter() - t_pin
            if pin is not None:
                report.unpinned_blocks = tuple(blocks[i].name for i in pin.unpinned_blocks)
            state.pool = allocate_slots(self.platform, layer, cfg.gather_engine, journal)
            report.symmetric_slots = state.pool.base is not None
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
            gather_engine=cfg.gather_engine if gathers else "nccl",  # nothing to gather
        )
        if not verdict.ok:
            if exchanges:
                self._poisoned = f"multi-rank startup failed ({verdict.message})"
            if isinstance(local_error, ValueError):  # this rank's own config was refused
                raise ValueError(verdict.message) from local_error
            raise verdict.error(verdict.message, rank=world.rank) from local_error
        assert host is not None
        host.keep_pageable(host.region, blocks, verdict.fallback_blocks)

        # 5: after agreement; failures here poison a multi-rank backend
        try:
            host.share(layer, journal, reports, self.parallel, self.world, exchanges=exchanges)
            self._build_runtime(pipeline, plan, layer, journal, verdict.copy_gather)
            faults.check("commit")  # 6: commit
        except BaseException as e:
            if exchanges:
                self._poisoned = f"failure after startup agreement ({e!r})"
            raise
        state.enable_time_s = time.perf_counter() - t0
        state.enable_peak_rss = process_peak_rss_bytes()
        logger.info("%s", state.describe())

    # ------------------------------------------------------------------ steps
    def _world_for(self, plan: ResolvedOffloadPlan) -> World:
        """The job's ranks. Under torchrun with no process group, a plan whose stacks exchange
        (gather, node-shared, "auto" over ranks) calls :func:`dlo.parallel.groups.init`."""
        world = current_world()
        if world.distributed or not plan.exchanges or not torchrun_env().is_distributed:
            return world
        logger.info("dlo: no process group under torchrun: initializing it from the environment")
        return init(self.parallel, device=self.platform.device)

    def _plan_layers(
        self,
        plan: ResolvedOffloadPlan,
        tensors: Mapping[str, TensorDescription],
        cfg: OffloadConfig,
    ) -> LayerPlan:
        assert isinstance(cfg.num_slots, int)
        share = next((s for s in plan.stacks if s.transfer == "node-shared"), None)
        return plan_layers(
            plan.stacks,
            tensors,
            chunk_nbytes=cfg.chunk_nbytes,
            num_slots=cfg.num_slots,
            pin_budget_nbytes=cfg.pin_budget_nbytes,
            host_backing=cfg.host_backing,
            host_budget_nbytes=cfg.host_budget_nbytes,
            # the sharers only size the budget's charge (torchrun's layout is read only then)
            node_sharers=(
                expected_sharers(self.parallel, self.world, share.share_axis, share.share_size)
                if share and cfg.pin_budget_nbytes is not None
                else 1
            ),
        )

    def _build_runtime(
        self,
        pipeline: Any,
        plan: ResolvedOffloadPlan,
        layer: LayerPlan,
        journal: Journal,
        copy_gather: bool,
    ) -> None:
        state, pf, rank = self._state, self.platform, self.world.rank
        host, pool = state.host, state.pool
        assert host is not None and pool is not None
        transports = state.transports = build_transports(
            pf,
            layer,
            host.blocks,
            config=self.config,
            parallel=self.parallel,
            pool=pool,
            copy_gather=copy_gather,
            counters=state.counters,
            rank=rank,
            journal=journal,
        )
        state.placed_nbytes = place_non_block_state(pf, pipeline, plan, host.blocks, journal)
        faults.check("first_transfer")
        load_resident(pf, host, transports, journal)
        state.resident_nbytes = layer.resident_nbytes
        state.scheduler = install_rings(
            pf,
            pipeline,
            host,
            transports,
            pool,
            owner=f"dlo.layer#{id(self):x}",
            rank=rank,
            journal=journal,
            replan=state.replan,
        )

    # ------------------------------------------------------------------ telemetry
    def save_encoded(self, *, dry_run: bool = False) -> list[Path]:
        """Write the encoded blocks (``codec`` on, group size 1) as encoded checkpoints, one
        beside each checkpoint they were loaded from, so later enables read them instead of
        encoding (see [Note: encoded checkpoint] in :mod:`dlo.codec.offline`). Call it on
        one rank: every rank of a group of one holds the same encoded blocks; the others may
        check with ``dry_run=True``, which writes nothing and raises the same errors.

        Returns:
            The files written (or that would be).
        Raises:
            ValueError: not enabled, no codec, no encoded block from a checkpoint, or one on disk.
        """
        host = self._state.host
        if not self.is_enabled() or host is None or host.codec is None:
            raise ValueError("save_encoded needs an enabled backend with codec='ans' blocks")
        blocks = [(b.layout, b.index, b.encoded) for b in host.blocks if b.encoded is not None]
        return host.codec.save_targets(blocks) if dry_run else host.codec.save(blocks)

    def stats(self) -> dict[str, Any]:
        """Plain-value statistics (DESIGN.md section 2); synchronizes the device."""
        return self._state.stats(
            self.platform, enabled=self.is_enabled(), host_backing=self.config.host_backing
        )
