"""The automatic policy's inputs and outputs, and its cost model (see [Note: policy model] in
:mod:`dlo.plan.policy`): modeled load time of a block per transfer, slots needed to hide a
slot's cycle, padded bytes. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dlo.config.fields import (
    GIB,
    TRANSFERS,
    _check_int,
    _check_int_or_auto,
    _check_positive_number,
)
from dlo.plan.layout import chunking

GB = 1e9


FREE_MEMORY_HEADROOM = 0.2
"""Fraction of the free device memory ``resident_layers="auto"`` leaves for activations."""


MAX_AUTO_SLOTS = 4


SHARED_MEMORY_HEADROOM = 0.2
"""Fraction of the free shared memory an automatic node-shared copy leaves to others."""


@dataclass(frozen=True)
class Measurements:
    """The numbers every rank of the job decides from (the group-wide minimum of each)."""

    h2d_bps: float
    """Host-to-device bytes per second of one rank while every rank copies at once."""
    allgather_bps: Mapping[str, float] = field(default_factory=dict)
    """Weight axis -> AllGather output bytes per second of that axis's group."""
    free_device_nbytes: int | None = None
    """Free device memory at enable, before dlo allocates (None: unknown)."""
    held_device_nbytes: int | None = None
    """Device bytes the process held at enable, the largest over the ranks (None: unknown;
    a ``device_budget_gb`` counts them)."""
    shared_memory_nbytes: int | None = None
    """Free bytes in the shared-memory folder of the fullest node (None: unknown)."""
    num_ranks: int = 1
    """How many ranks measured (the minimum is over all of them)."""
    codec_available: bool = True
    """Every rank has a block codec (nvCOMP on CUDA): ``codec="auto"`` may take ``"ans"``."""


DECODE_STAGING_BUFFERS = 2
"""Device staging buffers of each decoder (:mod:`dlo.runtime.decoding`)."""

CODEC_TRANSFER_BOUND = 0.95
"""``codec="auto"`` takes ``"ans"`` where the block's compute is under this fraction of its
modeled copy (at equality the decode's share of the SMs would be pure cost)."""


@dataclass(frozen=True)
class StackSpec:
    """One block stack as the policy sees it."""

    name: str
    """The stack's container path."""
    component: str
    """``"dit"`` or ``"encoder"``."""
    dit_path: str
    """The component path; resident counts are per DiT over its stacks, in order."""
    block_nbytes: tuple[int, ...]
    """Payload bytes of each block, in execution order."""
    transfer: str
    """Requested: ``"rank-local"``, ``"allgather"`` or ``"auto"``."""
    group_axis: str
    """The weight axis AllGather would use."""
    group_size: int
    """Ranks on that axis (1: nobody to gather with)."""
    num_resident: int = 0
    """Resident leading blocks when ``resident_layers`` is explicit."""
    resident_eligible: bool = True
    """May keep resident blocks (a DiT allowed by ``OffloadPlan.resident_dit_paths``)."""
    codec: str = "none"
    """Requested codec: ``"none"``, ``"ans"`` (kept) or ``"auto"`` (decided)."""
    optional: bool = False
    """An encoder stack the policy may keep whole on the device instead of streaming
    ([Note: encoders kept or streamed] in :mod:`dlo.plan.encoder_choice`)."""


@dataclass(frozen=True)
class PolicyInput:
    """Everything :func:`decide` needs."""

    stacks: tuple[StackSpec, ...]
    chunk_nbytes: int
    measured: Measurements
    num_slots: int | str = 2
    """An int is kept; ``"auto"`` is decided (see [Note: policy model])."""
    defaults: frozenset[str] = frozenset()
    """The knobs (``"num_slots"``, ``"resident_layers"``, ``"codec"``) the user left unset
    (resolved for the device at enable): the explanation says so instead of calling them
    explicit."""
    alone: bool = False
    """Decided by this rank alone (its stacks exchange nothing at enable and only unset
    defaults are automatic: [Note: automatic by default]); else the group-wide numbers."""
    resident_layers: int | str = 0
    """``"auto"`` is decided; an int is kept (the stacks' ``num_resident``)."""
    device_budget_gb: float | None = None
    """``OffloadConfig.device_budget_gb``: GiB of device memory for everything the run holds
    (see [Note: device budget])."""
    non_block_nbytes: int = 0
    """Non-block weights of the streamed components and resident modules (device bytes)."""
    non_block_to_place_nbytes: int = 0
    """Of which not on the device yet (they will take free memory at enable)."""
    block_compute_s: float | None = None
    """Known compute time of one DiT block (``OffloadConfig.block_compute_ms``): lets a DiT
    stack take node-shared over a faster AllGather; the slot count keeps ``t_c = P``."""
    shared_copies_per_node: int = 1
    """Node-shared copies the fullest node would hold (one per weight group on it)."""
    host_backing: str = "region"
    """``OffloadConfig.host_backing``: ``"mapped"`` streams rank-local stacks only."""
    host_budget: bool = False
    """``OffloadConfig.host_budget_gb`` is given: blocks beyond it are read from their file,
    with codec ``"none"`` only (for now)."""


@dataclass(frozen=True)
class StackChoice:
    name: str
    transfer: str
    """Concrete: ``"rank-local"``, ``"allgather"`` or ``"node-shared"``."""
    group_axis: str
    group_size: int
    num_resident: int
    requested: str
    rank_local_ms: float | None
    """Modeled latency per block (mean over the stack), rank-local."""
    allgather_ms: float | None
    """Modeled latency per block, AllGather (None: no group or no measurement)."""
    reason: str
    codec: str = "none"
    """Concrete: ``"none"`` or ``"ans"``."""
    codec_reason: str = "explicit"


@dataclass(frozen=True)
class PolicyDecision:
    """What :func:`decide` chose, and why."""

    stacks: tuple[StackChoice, ...]
    num_slots: int
    resident_layers: int
    """Resident leading blocks per eligible DiT (the ``resident_layers`` it amounts to)."""
    slot_nbytes: int
    device_weight_nbytes: int
    """Modeled device bytes of weights: non-block + slots + resident blocks."""
    capacity_nbytes: int | None
    measured: Measurements
    lines: tuple[str, ...]
    whole: tuple[str, ...] = ()
    """The optional stacks kept whole on the device (their container paths): not in
    :attr:`stacks`, their weights counted with the non-block ones."""

    @property
    def explanation(self) -> str:
        return "\n".join(self.lines)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (for ``stats()["policy"]`` and JSON)."""
        m = self.measured
        return {
            "stacks": {
                s.name: {
                    "transfer": s.transfer,
                    "requested": s.requested,
                    "group_axis": s.group_axis,
                    "group_size": s.group_size,
                    "num_resident": s.num_resident,
                    "rank_local_ms_per_block": s.rank_local_ms,
                    "allgather_ms_per_block": s.allgather_ms,
                    "reason": s.reason,
                    "codec": s.codec,
                    "codec_reason": s.codec_reason,
                }
                for s in self.stacks
            },
            "num_slots": self.num_slots,
            "resident_layers": self.resident_layers,
            "slot_nbytes": self.slot_nbytes,
            "device_weight_nbytes": self.device_weight_nbytes,
            "capacity_nbytes": self.capacity_nbytes,
            "kept_whole": list(self.whole),
            "measured": {
                "h2d_GBps": m.h2d_bps / GB,
                "allgather_GBps": {k: v / GB for k, v in sorted(m.allgather_bps.items())},
                "free_device_nbytes": m.free_device_nbytes,
                "held_device_nbytes": m.held_device_nbytes,
                "shared_memory_nbytes": m.shared_memory_nbytes,
                "num_ranks": m.num_ranks,
            },
            "explanation": self.explanation,
        }


def _size(nbytes: float) -> str:
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / (1 << 20):.2f} MiB"


# ----------------------------------------------------------------------------- the model
def padded_nbytes(nbytes: int, group_size: int, chunk_nbytes: int) -> int:
    chunk, n = chunking(nbytes, group_size=group_size, chunk_nbytes=chunk_nbytes)
    return chunk * n


def block_times(
    nbytes: int, *, group_size: int, chunk_nbytes: int, h2d_bps: float, allgather_bps: float
) -> tuple[float, float]:
    """``(latency L, busiest-stage occupancy P)`` of one block's load, in seconds (see
    [Note: policy model]); ``group_size == 1`` is rank-local and ignores ``allgather_bps``."""
    chunk, n = chunking(nbytes, group_size=group_size, chunk_nbytes=chunk_nbytes)
    if n == 0:
        return 0.0, 0.0
    if group_size == 1:
        t = n * chunk / h2d_bps
        return t, t
    c = chunk / group_size / h2d_bps
    g = chunk / allgather_bps
    busiest = n * max(c, g)
    return busiest + min(c, g), busiest


def slots_needed(latency_s: float, occupancy_s: float, compute_s: float | None) -> int:
    """Slots that hide one slot's cycle: ``ceil((L + t_c) / max(P, t_c))``, t_c = P when
    unknown, clamped to ``2..MAX_AUTO_SLOTS``."""
    t_c = occupancy_s if compute_s is None else compute_s
    period = max(occupancy_s, t_c)
    if period <= 0:
        return 2
    return max(2, min(MAX_AUTO_SLOTS, math.ceil((latency_s + t_c) / period - 1e-9)))


def _check_input(inp: PolicyInput) -> None:
    m = inp.measured
    if not (math.isfinite(m.h2d_bps) and m.h2d_bps > 0):
        raise ValueError(f"measured h2d_bps={m.h2d_bps!r} must be a finite number > 0")
    for axis, bw in m.allgather_bps.items():
        if not (math.isfinite(bw) and bw > 0):
            raise ValueError(f"measured allgather_bps[{axis!r}]={bw!r} must be finite and > 0")
    _check_int("chunk_nbytes", inp.chunk_nbytes, minimum=1)
    # the config's own rules for the knobs it hands over (one home: dlo.config.fields)
    _check_int_or_auto("num_slots", inp.num_slots, minimum=1)
    _check_int_or_auto("resident_layers", inp.resident_layers, minimum=0)
    if inp.device_budget_gb is not None:
        _check_positive_number("device_budget_gb", inp.device_budget_gb)
    for s in inp.stacks:
        if s.transfer not in TRANSFERS:
            raise ValueError(f"stack {s.name!r}: transfer={s.transfer!r} is not a transfer")
        if s.group_size < 1:
            raise ValueError(f"stack {s.name!r}: group_size={s.group_size} must be >= 1")


def allocated_slots(stacks: tuple[StackSpec, ...], resident: list[int], num_slots: int) -> int:
    """Slots the ring allocates for this resident split: ``num_slots``, at most one per
    streamed block (:attr:`~dlo.plan.layers.LayerPlan.allocated_slots`)."""
    streamed = sum(len(s.block_nbytes) - r for s, r in zip(stacks, resident))
    return max(1, min(num_slots, streamed))


def staging_nbytes(stacks: tuple[StackSpec, ...], choices: list[StackChoice], chunk: int) -> int:
    """Device bytes of the decoders' staging buffers (see [Note: decode pipeline] in
    :mod:`dlo.runtime.decoding`), each the largest encoded shard of its axis: bounded here
    by the raw shard, since the encoded size is known only once encoded."""
    per_axis: dict[str, int] = {}
    for s, c in zip(stacks, choices):
        if c.codec != "none":
            for b in s.block_nbytes:
                shard = padded_nbytes(b, c.group_size, chunk) // c.group_size
                per_axis[c.group_axis] = max(per_axis.get(c.group_axis, 0), shard)
    return DECODE_STAGING_BUFFERS * sum(per_axis.values())
