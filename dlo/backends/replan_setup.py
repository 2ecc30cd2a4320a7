"""Which DiT rings are re-planned between forwards, and the blocks they hold as pins from
enable on ([Note: re-plan between forwards] in :mod:`dlo.plan.replan`).

A DiT whose resident count the policy chose (``resident_layers`` unset or ``"auto"``) keeps
no resident block: the blocks the policy would keep resident are in its ring, pinned (a
device buffer of their own, loaded at enable), so a later re-plan may unpin them before a
larger input, and pin them back. Not with an explicit ``num_slots`` or a stack that gathers
(the slots cannot follow the pins: a fixed count, symmetric slots), nor under a
``pin_budget_gb`` (the kept blocks would take the pinned host memory the streamed ones
need): there the kept blocks stay resident and only the blocks enable left streaming are
pinned and unpinned. The blocks of an explicit ``resident_layers`` stay resident
and are never touched, as is a DiT whose blocks another mechanism manages (HSDP's
``fully_shard``) or that ``OffloadPlan.resident_dit_paths`` leaves out.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from dlo.backends.layer_block import LayerBlock
from dlo.config.offload import OffloadConfig
from dlo.config.unset import codec_by_measurement
from dlo.hooks.foreign import foreign_offloader
from dlo.hooks.registry import HookRegistry
from dlo.journal import Journal
from dlo.plan.declarations import get_by_path
from dlo.plan.discovery import resident_dit_paths_of
from dlo.plan.topology import ResolvedOffloadPlan
from dlo.platform.device import Platform
from dlo.runtime.late_codec import LateCodec
from dlo.runtime.replan import Replanner, ResidentBlockHook
from dlo.runtime.ring import RingScheduler

logger = logging.getLogger(__name__)

REPLAN_HOOK = "dlo.replan"

LATE_CODEC = "ans"
"""The codec ``codec="auto"`` turns on by measurement."""


@dataclass(frozen=True)
class ReplanSetup:
    """What enable re-plans (see the module docstring)."""

    dits: frozenset[str] = frozenset()
    """Component paths of the DiTs whose rings are re-planned."""
    pins: frozenset[str] = frozenset()
    """Block paths the policy chose to keep (its leading blocks): enable pins as many, spread
    over the ring as a re-plan pins them (:meth:`~dlo.runtime.replan.Replanner.pin_initial`)."""
    keep_slots: bool = False
    """``num_slots`` was given: the slots are never resized."""
    late_codec: frozenset[str] = frozenset()
    """The DiTs whose rings may turn :data:`LATE_CODEC` on by measurement (``codec="auto"``,
    given or unset on a GPU, resolved to ``"none"`` for want of a compute time, no host or
    pin budget: see [Note: codec turned on by measurement] in :mod:`dlo.runtime.late_codec`);
    never with an explicit ``"none"`` or an unset codec on a CPU device."""
    pin_late: bool = True
    """Page-lock the copies it encodes (``pin_memory``)."""


def replan_setup(
    pipeline: Any,
    plan: ResolvedOffloadPlan,
    requested: OffloadConfig,
    state: Any,
    device_type: str,
) -> ResolvedOffloadPlan:
    """``plan`` with the re-planned DiTs' resident blocks made pins (their stacks keep no
    resident block); what enable re-plans goes to ``state.replan`` (a
    :class:`~dlo.backends.layer_state.LayerState`). ``requested`` is the user's config, its
    unset codec resolved for ``device_type`` ([Note: automatic by default])."""
    state.replan = ReplanSetup()
    if requested.mode != "layer" or requested.resident_layers_for("dit") not in (None, "auto"):
        return plan
    eligible = resident_dit_paths_of(pipeline)
    dits: set[str] = set()
    for s in plan.stacks:
        if s.component != "dit" or (eligible is not None and s.component_path not in eligible):
            continue
        dits.add(s.component_path)
    for s in plan.stacks:  # a DiT any of whose blocks another mechanism manages: as planned
        if s.component_path in dits and any(
            foreign_offloader(get_by_path(pipeline, p)) is not None for p in s.block_paths
        ):
            logger.info("dlo: %s's blocks have other hooks: no re-plans", s.component_path)
            dits.discard(s.component_path)
    keep = requested.num_slots not in (None, "auto")
    # pins only where the slots follow them (the layer plan sizes the pool as if every block
    # streamed): not with an explicit num_slots, nor where a stack gathers (symmetric slots,
    # and a kept block's host shards are released), nor under a host pin budget (kept blocks
    # would take it before the blocks that load every forward): those keep resident blocks
    pinning = (
        not keep
        and requested.pin_budget_gb is None
        and not any(s.group_size > 1 for s in plan.stacks)
    )
    pins = frozenset(
        p
        for s in plan.stacks
        if pinning and s.component_path in dits
        for p in s.resident_block_paths
    )
    stacks = tuple(
        dataclasses.replace(s, num_resident=0) if pinning and s.component_path in dits else s
        for s in plan.stacks
    )
    # the codec turned on by measurement: where enable could not decide ("auto", given or
    # unset on a GPU, without a compute time), and no host or pin budget would be overrun by
    # the encoded copies
    late = (
        codec_by_measurement(requested, device_type)
        and requested.block_compute_ms is None
        and requested.host_budget_gb is None
        and requested.pin_budget_gb is None
    )
    state.replan = ReplanSetup(
        frozenset(dits),
        pins,
        keep,
        late_codec=frozenset(
            d
            for d in dits
            if late and all(s.codec == "none" for s in plan.stacks if s.component_path == d)
        ),
        pin_late=requested.pin_memory,
    )
    if pins and state.policy is not None:
        state.policy["explanation"] += (
            f"\n  the {len(pins)} kept DiT block(s) are pinned in the ring, spread over it (a "
            "streamed block's copy overlaps the pinned blocks' compute): between forwards a "
            "re-plan may unpin some before a larger input, and pin more into measured room"
        )
    return dataclasses.replace(plan, stacks=stacks)


def install_replanners(
    platform: Platform,
    blocks: list[LayerBlock],
    scheduler: RingScheduler,
    drain: Any,
    registry: HookRegistry,
    journal: Journal,
    setup: ReplanSetup,
    *,
    rank: int,
) -> None:
    """A re-planner for the ring of each DiT of ``setup``, with hooks on any resident block
    of it, and its pins loaded."""
    made = []
    for ring in scheduler.rings:
        path = ring.name
        if path not in setup.dits:
            continue
        r = Replanner(
            platform, scheduler, ring, drain=drain, keep_slots=setup.keep_slots, rank=rank
        )
        journal.record(f"re-plans of {path or 'the model'}", r.close)
        if path in setup.late_codec:
            r.late = LateCodec(
                platform, ring, LATE_CODEC, r.records.append, pin=setup.pin_late, rank=rank
            )
            journal.record(f"late codec of {path or 'the model'}", r.late.close)
        for b in blocks:
            if b.resident and b.stack.component_path == path:
                registry.register(b.module, REPLAN_HOOK, ResidentBlockHook(r, b.name))
        made.append(r)
    for r in made:  # every re-planner made (with enable's slots) before any pins
        r.pin_initial(setup.pins)
