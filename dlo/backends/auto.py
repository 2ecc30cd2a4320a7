"""Resolving the automatic settings of a layer config at enable.

``transfer="auto"``, ``num_slots="auto"``, ``resident_layers="auto"`` and
``device_budget_gb`` are decided here, after the topology is resolved and before any block
is laid out: the decision changes a stack's group size, hence its layout, its manifest
digest and the groups compared at the startup agreement. Steps:

0. every rank that exchanges anything at enable compares its requested settings
   (:func:`agree_requests`), so an ``"auto"`` on one rank only is named, not a timeout;
1. local sizing (pure): every block's payload bytes, the non-block weights;
2. a readiness exchange through the store (a rank that failed step 1, or never came, is
   named on every rank before anyone enters a probe collective);
3. probes (:func:`dlo.runtime.measure.measure_rank`): free device memory, host-to-device bandwidth
   with every rank copying, and the AllGather of each weight group an ``"auto"`` stack
   would use (the groups are created here, once, and reused by the ring);
4. one exchange of the measurements and of each rank's non-block bytes; every rank takes
   the minimum of each measurement and the maximum of the non-block bytes
   ([Note: one set of numbers]) and calls the pure :func:`dlo.plan.policy.decide`
   ([Note: policy model]);
5. the plan's stacks and the config are rewritten with concrete values, so the rest of the
   install sees no ``"auto"``.

[Note: device budget]
``device_budget_gb`` is everything the run may hold on the device, as on a device of that
size: weights already there (the process's allocations at enable, the largest over the
ranks), the non-block weights dlo places, slots, resident blocks, decode staging, and the
activations and workspace of the forwards. The policy plans against it as against a device
whose free memory is the budget less what is already held, keeping the same
``FREE_MEMORY_HEADROOM`` for activations, and enable caps the process's allocator at the
budget where the platform can (``torch.cuda.set_per_process_memory_fraction``; restored at
disable), so a run that would not fit such a device fails there too instead of borrowing the
larger device's memory. A budget above the free memory plans against the free memory. Blocks
already on the device at enable do not count as held (enable moves them off). The cap covers
PyTorch's caching allocator only (not the CUDA context or NCCL's buffers), and budgets
stack: the smallest in force binds (:mod:`dlo.platform.memory_cap`); ``disable(restore=True)``
lifts it before gathering whole blocks back. Known gap: under HSDP the non-block weights are
counted at their shard size, but FSDP2 keeps them unsharded on the device after the first
forward (``reshard_after_forward=False``), so a tight budget can run out there. (Until
2026-12-06 the budget counted the weights only.)

Nothing here is journaled but :func:`cap_to_budget`'s cap: no host or device memory outlives it, and a failure raises on
every rank (from the exchanges) before the backend has touched the model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from dlo.config.fields import COMPONENTS, GIB
from dlo.config.offload import LayerOptions, OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.config.unset import for_device, given_only, is_automatic, unset_fields
from dlo.errors import OffloadError
from dlo.hooks.foreign import is_dtensor
from dlo.journal import Journal, atomic
from dlo.parallel.groups import World, axis_groups, weight_group
from dlo.parallel.store import share
from dlo.plan.checks import non_block_state
from dlo.plan.discovery import resident_dit_paths_of
from dlo.plan.layers import TensorDescription, payload_nbytes
from dlo.plan.policy import decide
from dlo.plan.policy_model import Measurements, PolicyDecision, PolicyInput, StackSpec
from dlo.plan.subclasses import tensor_nbytes
from dlo.plan.topology import ResolvedOffloadPlan, transfer_groups
from dlo.platform.device import Platform
from dlo.runtime import measure

logger = logging.getLogger(__name__)


def cap_to_budget(
    platform: Platform, budget_gb: float | None, journal: Journal
) -> Callable[[], None]:
    """Cap this process's device allocations at ``budget_gb`` where the platform can
    ([Note: device budget]); the journal lifts the cap at disable or a failed enable, and
    the returned undo (idempotent; a no-op where nothing was capped) lifts it earlier: a
    restore gathers whole blocks."""
    undo = None
    if budget_gb is not None:
        with atomic():  # the cap and the record of its undo, or neither
            undo = platform.cap_memory(int(budget_gb * GIB))
            if undo is not None:
                journal.record("device budget cap", undo)
    return undo if undo is not None else _nothing


def _nothing() -> None:
    return None


def requested_settings(cfg: OffloadConfig) -> tuple[tuple[str, Any], ...]:
    """The settings the policy may decide, as this rank asked for them (pure)."""
    return (
        *((f"transfer for {k!r}", cfg.transfer_for(k)) for k in COMPONENTS),
        *((f"codec for {k!r}", cfg.codec_for(k)) for k in COMPONENTS),
        ("num_slots", cfg.num_slots),
        ("resident_layers", cfg.resident_layers_for("dit")),
        ("device_budget_gb", cfg.device_budget_gb),
        # the hint only shapes automatic decisions: explicit ranks may differ in it
        ("block_compute_ms", cfg.block_compute_ms if is_automatic(cfg) else None),
    )


def differing_requests(replies: list[tuple[tuple[str, Any], ...]]) -> str:
    """The requested settings that differ between ranks where at least one rank left the
    value to the policy, as ``"field: rank 0=..., rank 1=..."`` (pure; ``""`` when none).
    Differences between explicit values are left to the startup agreement."""
    values = [dict(r) for r in replies]
    out = []
    for name, _ in replies[0]:
        got = [v.get(name) for v in values]
        automatic = any(
            g == "auto" or (name in ("device_budget_gb", "block_compute_ms") and g is not None)
            for g in got
        )
        if automatic and len(set(got)) > 1:
            out.append(f"{name}: " + ", ".join(f"rank {r}={g!r}" for r, g in enumerate(got)))
    return "; ".join(out)


def agree_requests(
    requested: OffloadConfig, plan: ResolvedOffloadPlan, world: World, device_type: str
) -> None:
    """Every rank that takes part in an exchange at enable (it is automatic, or one of its
    stacks gathers or is node-shared) first compares what it asked the policy to decide
    (``requested`` with its unset fields resolved for ``device_type``): an ``"auto"`` on one
    rank and a value on another would send the first into the policy's exchanges and the
    second into the startup agreement, and both would wait out the timeout.

    Raises:
        OffloadError: the ranks asked for different automatic settings (named, with every
            rank's value, the same on every rank), or a rank never arrived.
    """
    cfg = for_device(requested, device_type)
    if not policy_world(requested, plan, world).distributed:
        return
    if not is_automatic(cfg) and not plan.exchanges:
        return
    replies = share(
        requested_settings(cfg),
        rank=world.rank,
        world_size=world.size,
        timeout_s=cfg.collective_timeout_s,
        topic="policy-request",
        what="automatic settings exchange",
    )
    differ = differing_requests(replies)
    if differ:
        raise OffloadError(
            f"ranks asked for different automatic settings ({differ}): every rank must leave "
            "the same settings to the policy, with the same device_budget_gb and "
            "block_compute_ms",
            rank=world.rank,
        )


def policy_world(requested: OffloadConfig, plan: ResolvedOffloadPlan, world: World) -> World:
    """The ranks that decide the automatic settings together: the job's, or this rank alone
    where its stacks exchange nothing at enable and only unset fields are automatic (the
    defaults on a GPU). Rank-local ranks hold their own memory, and a job that never asked
    for a collective must not wait on, or fail with, another rank at enable
    ([Note: automatic by default] in :mod:`dlo.config.unset`)."""
    if world.distributed and not plan.exchanges and not is_automatic(given_only(requested)):
        return World(world.rank, 1, world.backend)
    return world


def resolve_automatic(
    pipeline: Any,
    plan: ResolvedOffloadPlan,
    requested: OffloadConfig,
    par: ParallelConfig,
    platform: Platform,
    world: World,
    tensors: Mapping[str, TensorDescription],
    block_tensors: Mapping[int, torch.Tensor],
    sizing_error: Exception | None = None,
) -> tuple[OffloadConfig, ResolvedOffloadPlan, dict[str, Any]]:
    """Decide every automatic setting (see the module docstring) of ``requested`` (the
    user's config; its unset fields are resolved for the device here too). ``tensors``
    describes every block of ``plan`` (block path -> tensor description, as the layer plan
    reads them) and ``block_tensors`` holds the blocks' tensors by id (the rest is
    non-block state); ``sizing_error`` is this rank's failure to read them (sized like any
    other failure). The ranks of :func:`policy_world` decide together.

    Returns:
        ``(config, plan, policy)``: the config with concrete ``num_slots`` and
        ``resident_layers`` (no budget left to re-check), the plan with a concrete transfer,
        group and resident count per stack, and the policy record for ``stats()["policy"]``.
    Raises:
        ValueError: a device budget too small for the non-block weights and one slot.
        OffloadError: a rank failed to size or measure, or never arrived (named).
    """
    cfg = for_device(requested, platform.device.type)
    deciders = policy_world(requested, plan, world)
    alone, world = deciders.size < world.size, deciders
    ready: tuple[bool, str] = (True, "")
    inp: PolicyInput | None = None
    try:
        if sizing_error is not None:  # reading the blocks' tensors failed on this rank
            raise sizing_error
        inp = _policy_input(pipeline, plan, cfg, platform, tensors, set(block_tensors))
        inp = dataclasses.replace(inp, defaults=unset_fields(requested), alone=alone)
    except Exception as e:
        if not world.distributed:
            raise
        ready = (False, f"{type(e).__name__}: {e}")
    replies = share(
        ready,
        rank=world.rank,
        world_size=world.size,
        timeout_s=cfg.collective_timeout_s,
        topic="policy-ready",
        what="policy readiness exchange",
    )
    failed = [(r, msg) for r, (ok, msg) in enumerate(replies) if not ok]
    if failed:
        raise OffloadError(
            "the automatic policy could not size the model on rank(s) "
            f"{[r for r, _ in failed]}: " + "; ".join(f"rank {r}: {m}" for r, m in failed),
            rank=world.rank,
        )
    assert inp is not None

    # every axis a stack may gather on: "auto" chooses by it, and an explicit AllGather
    # stack's slot count depends on it too (num_slots="auto")
    axes = sorted(
        {
            s.group_axis
            for s in plan.stacks
            if s.transfer in ("auto", "allgather") and s.group_size > 1
        }
    )
    if any(s.transfer == "auto" and s.group_size > 1 for s in plan.stacks) and not (
        world.distributed
    ):
        raise OffloadError(
            "transfer='auto' with a weight group of more than one rank needs a process group: "
            "run under torchrun with the ParallelConfig's world size",
            rank=world.rank,
        )
    groups = {
        a: weight_group(
            par,
            a,
            rank=world.rank,
            timeout_s=cfg.collective_timeout_s,
            max_ctas=cfg.nccl_max_ctas,
        )[0]
        for a in axes
    }
    largest = max((b for s in inp.stacks for b in s.block_nbytes), default=0)
    mine = measure.measure_rank(
        platform,
        rank=world.rank,
        nbytes=measure.probe_nbytes(largest),
        pinned=cfg.pin_memory,
        groups=groups,
        non_block_nbytes=inp.non_block_nbytes,
        non_block_to_place_nbytes=inp.non_block_to_place_nbytes,
        leaving_nbytes=_on_device(block_tensors.values(), platform),
    )
    measured, records = measure.agree(
        mine, world_size=world.size, timeout_s=cfg.collective_timeout_s
    )
    non_block, to_place = measure.combine_non_block(records)
    shared_axes = {s.group_axis for s in plan.stacks if s.transfer == "auto" and s.group_size > 1}
    shared_axes |= {s.share_axis for s in plan.stacks if s.transfer == "node-shared"}
    copies = max(
        (measure.copies_per_node(records, axis_groups(par, a)) for a in shared_axes), default=1
    )
    decision = decide(
        dataclasses.replace(
            inp,
            measured=measured,
            non_block_nbytes=non_block,
            non_block_to_place_nbytes=to_place,
            shared_copies_per_node=copies,
        )
    )
    if world.rank == 0:
        logger.info("%s", decision.explanation)
    else:
        logger.debug("%s", decision.explanation)
    record = decision.as_dict()
    record["per_rank"] = [
        {
            "rank": r.rank,
            "h2d_GBps": r.h2d_bps / measure.GB,
            "allgather_GBps": {a: v / measure.GB for a, v in sorted(r.allgather_bps.items())},
            "free_device_nbytes": r.free_device_nbytes,
            "held_device_nbytes": r.held_device_nbytes,
            "shared_memory_nbytes": r.shared_memory_nbytes,
            "non_block_nbytes": r.non_block_nbytes,
        }
        for r in records
    ]
    return _concrete_config(cfg, decision), _concrete_plan(plan, decision), record


def _on_device(block_tensors: Iterable[torch.Tensor], platform: Platform) -> int:
    """Bytes of the blocks' tensors on the device now: enable moves them off, so the device
    memory the process holds at enable does not count them ([Note: device budget]). 0 on a
    CPU device: the host is the device, and enable moves nothing off it."""
    if platform.device.type == "cpu":
        return 0
    return sum(tensor_nbytes(t) for t in block_tensors if t.device == platform.device)


def _policy_input(
    pipeline: Any,
    plan: ResolvedOffloadPlan,
    cfg: OffloadConfig,
    platform: Platform,
    tensors: Mapping[str, TensorDescription],
    block_tensor_ids: set[int],
) -> PolicyInput:
    eligible = resident_dit_paths_of(pipeline)
    specs = tuple(
        StackSpec(
            name=s.container_path,
            component=s.component,
            dit_path=s.component_path,
            block_nbytes=tuple(payload_nbytes(p, tensors[p]) for p in s.block_paths),
            transfer=s.transfer,
            group_axis=s.group_axis,
            group_size=s.group_size,
            num_resident=s.num_resident,
            resident_eligible=eligible is None or s.component_path in eligible,
            codec=s.codec,
            optional=s.optional,
        )
        for s in plan.stacks
    )
    non_block, to_place = 0, 0
    for _name, t in non_block_state(pipeline, plan, block_tensor_ids):
        local = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
        nbytes = tensor_nbytes(local)
        non_block += nbytes
        if local.device != platform.device:
            to_place += nbytes
    resident = cfg.resident_layers_for("dit")
    # resolved for the device at enable (dlo.config.unset.for_device): nothing is unset here
    assert resident is not None and cfg.num_slots is not None
    return PolicyInput(
        stacks=specs,
        chunk_nbytes=cfg.chunk_nbytes,
        measured=Measurements(h2d_bps=1.0),  # replaced once measured
        num_slots=cfg.num_slots,
        resident_layers=resident,
        device_budget_gb=cfg.device_budget_gb,
        non_block_nbytes=non_block,
        non_block_to_place_nbytes=to_place,
        block_compute_s=cfg.block_compute_ms / 1e3 if cfg.block_compute_ms else None,
        host_backing=cfg.host_backing,
        host_budget=cfg.host_budget_gb is not None,
    )


def _concrete_config(cfg: OffloadConfig, d: PolicyDecision) -> OffloadConfig:
    def fix(o: LayerOptions) -> LayerOptions:
        if o.resident_layers == "auto":
            return dataclasses.replace(o, resident_layers=d.resident_layers)
        return o

    options = {k: fix(o) for k, o in cfg.layer_options.items()}
    resident = cfg.resident_layers
    if resident == "auto":
        resident = d.resident_layers
    return cfg.replace(
        num_slots=d.num_slots,
        resident_layers=resident,
        layer_options=options,
        device_budget_gb=None,
    )


def _concrete_plan(plan: ResolvedOffloadPlan, d: PolicyDecision) -> ResolvedOffloadPlan:
    """``plan`` as decided: the stacks kept whole leave it (their encoder's weights are then
    non-block state, placed on the device by the enable), the others get their values."""
    stacks = []
    kept = [s for s in plan.stacks if s.container_path not in d.whole]
    for s, c in zip(kept, d.stacks, strict=True):
        assert s.container_path == c.name
        # an automatic stack's group is its weight axis; an explicit one keeps its groups
        groups = (
            transfer_groups(c.transfer, s.group_axis, s.group_size) if s.transfer == "auto" else {}
        )
        stacks.append(
            dataclasses.replace(
                s, transfer=c.transfer, num_resident=c.num_resident, codec=c.codec, **groups
            )
        )
    return dataclasses.replace(plan, stacks=tuple(stacks))
