"""Brief bandwidth probes: host-to-device copies, AllGather, free device memory.

Shared by the automatic policy (:mod:`dlo.backends.auto`, at enable) and ``dlo bench`` (its
physical limits). Each probe moves one buffer a few times and reports the median rate: on
CUDA timed with events on the current stream, on the CPU platform timed on the host (a
memcpy and a gloo gather), so the whole policy path runs, and is tested, without a GPU.

Besides :mod:`dlo.runtime.collectives` (which it calls for its gathers), this is the only
module of the runtime that issues collectives (the probes' barrier); the probes run on setup
paths only, never on the hot path.

[Note: one set of numbers]
Every rank measures its own link and its own group, so the raw numbers differ from rank to
rank (and from run to run). Decisions taken from them change the layout (a stack's group
size), so every rank must decide from the same numbers: :func:`agree` publishes each rank's
:class:`RankMeasurement` through one store exchange (:func:`dlo.parallel.store.share`) and every
rank takes the minimum of each quantity over all ranks. The job then runs at the pace of its
slowest link, which is what a lock-step group does anyway. The non-block weight bytes a rank
holds (and still has to place on the device) are published too and combined by their
maximum: under HSDP FSDP2 may shard a non-block weight unevenly, so each rank sees its own
byte count, and a resident count or a too-small-budget error sized from local bytes would
differ between ranks (:func:`combine_non_block`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dlo.codec.codecs import codec_available
from dlo.config.fields import MIB
from dlo.errors import OffloadError
from dlo.host.region import HostRegion
from dlo.parallel.groups import current_world
from dlo.parallel.store import share
from dlo.plan.layout import ALIGN
from dlo.plan.policy_model import Measurements
from dlo.platform.device import Platform
from dlo.platform.env import host_name, shared_memory_free_nbytes
from dlo.runtime.collectives import all_gather_into, all_gather_objects

logger = logging.getLogger(__name__)


GB = 1e9


PROBE_MAX_NBYTES = 128 * MIB
"""Largest buffer the enable-time probes move (about 2.5 ms at 54 GB/s)."""


PROBE_MIN_NBYTES = 1 * MIB


def probe_nbytes(block_nbytes: int) -> int:
    """The probe size for blocks of ``block_nbytes``: the block, clamped to 1..128 MiB."""
    return max(PROBE_MIN_NBYTES, min(PROBE_MAX_NBYTES, block_nbytes))


def sample_seconds(
    platform: Platform, fn: Any, reps: int, on_sample: Callable[[], object] | None = None
) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn()``: device time between two events on the
    current stream on CUDA, wall time on the CPU platform (no warm-up; the caller's).
    ``on_sample()`` runs after each sample, outside its timed span (a progress bar)."""
    times = []
    for _ in range(reps):
        if platform.has_streams:
            s, e = platform.new_event(timing=True), platform.new_event(timing=True)
            s.record(platform.current_stream())
            fn()
            e.record(platform.current_stream())
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if on_sample is not None:
            on_sample()
    return times


def device_peak_nbytes(platform: Platform, stats: Mapping[str, Any] | None = None) -> int:
    """Peak device bytes since the last reset: torch's allocator peak plus what a backend
    holds outside that allocator (its symmetric-memory slots, ``device_symmetric_nbytes`` in
    its ``stats()``), which ``max_memory_allocated`` does not see."""
    return platform.max_memory_allocated() + int((stats or {}).get("device_symmetric_nbytes", 0))


def _timed(platform: Platform, fn: Any, reps: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    platform.synchronize()
    return max(statistics.median(sample_seconds(platform, fn, reps)), 1e-9)


def h2d_bandwidth(platform: Platform, nbytes: int, *, pinned: bool, reps: int = 5) -> float:
    """Host-to-device bytes per second from an exact-size host buffer (pinned when asked
    and the platform can pin; on the CPU platform a memcpy)."""
    region = HostRegion([nbytes])
    try:
        if pinned and platform.can_pin:
            region.pin(platform)
        pair = [region.view(0), torch.empty(nbytes, dtype=torch.uint8, device=platform.device)]
        seconds = _timed(platform, lambda: pair[1].copy_(pair[0], non_blocking=True), reps)
        pair.clear()  # no view of the region outlives it
        return nbytes / seconds
    finally:
        region.close()


def allgather_bandwidth(
    platform: Platform, nbytes: int, group: Any = None, *, reps: int = 5
) -> float:
    """AllGather "bus" bandwidth (output bytes per second) of ``group`` (None: the default
    group); 0.0 without a process group."""
    if not dist.is_initialized():
        return 0.0
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nbytes = max(size * ALIGN, nbytes - nbytes % (size * ALIGN))
    out = torch.empty(nbytes, dtype=torch.uint8, device=platform.device)
    part = nbytes // size
    mine = out[rank * part : (rank + 1) * part]
    seconds = _timed(platform, lambda: all_gather_into(out, mine, group), reps)
    return nbytes / seconds


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def over_ranks(value: float) -> list[float]:
    """``value`` of every rank of the default group (collective)."""
    if not dist.is_initialized():
        return [value]
    return [float(v) for v in all_gather_objects(value, None)]


def h2d_limits(platform: Platform, nbytes: int) -> dict[str, float]:
    """Pinned H2D alone (each rank in turn; the slowest link), with every rank copying at
    once (the slowest rank), and pageable H2D alone, in GB/s (collective; for ``dlo bench``)."""
    world = current_world()
    alone, pageable = 0.0, 0.0
    for r in range(world.size):
        barrier()
        if r == world.rank:
            alone = h2d_bandwidth(platform, nbytes, pinned=True) / GB
            pageable = h2d_bandwidth(platform, nbytes, pinned=False) / GB
    barrier()
    concurrent = h2d_bandwidth(platform, nbytes, pinned=True) / GB
    return {
        "h2d_pinned_alone_GBps": min(over_ranks(alone)),
        "h2d_pinned_concurrent_GBps": min(over_ranks(concurrent)),
        "h2d_pageable_GBps": min(over_ranks(pageable)),
    }


# ----------------------------------------------------------------------------- enable time
@dataclass
class RankMeasurement:
    """What one rank measured at enable (published at :func:`agree`)."""

    rank: int
    ok: bool = True
    error: str = ""
    h2d_bps: float = 0.0
    allgather_bps: dict[str, float] = field(default_factory=dict)
    free_device_nbytes: int | None = None
    held_device_nbytes: int | None = None
    """Device bytes this process held at enable (None: unknown; a device budget counts it)."""
    shared_memory_nbytes: int | None = None
    """Free bytes in this node's shared-memory folder (for a node-shared copy)."""
    host: str = ""
    """This rank's host name (ranks with one name share a node's shared memory)."""
    non_block_nbytes: int = 0
    """Non-block weight bytes this rank holds (its local shard under HSDP)."""
    non_block_to_place_nbytes: int = 0
    """Of which not yet on the device."""
    codec_available: bool = True
    """This process has a block codec (:func:`dlo.codec.codecs.codec_available`)."""


def measure_rank(
    platform: Platform,
    *,
    rank: int,
    nbytes: int,
    pinned: bool,
    groups: Mapping[str, Any],
    non_block_nbytes: int = 0,
    non_block_to_place_nbytes: int = 0,
    leaving_nbytes: int = 0,
) -> RankMeasurement:
    """This rank's numbers: free device memory (first, before the probes allocate), pinned
    H2D while the other ranks copy too, then the AllGather of each weight group in
    ``groups`` (axis -> communicator; every rank of a group must probe it). A local failure
    is caught and reported; the gathers still run so no peer waits on this rank. The
    non-block byte counts are this rank's sizing, published with the measurements;
    ``leaving_nbytes`` are the device bytes of blocks enable will move off the device."""
    m = RankMeasurement(
        rank,
        non_block_nbytes=non_block_nbytes,
        non_block_to_place_nbytes=non_block_to_place_nbytes,
    )
    try:
        free = platform.free_memory()  # both as after enable moves the blocks off the device
        m.free_device_nbytes = None if free is None else free + leaving_nbytes
        held = platform.held_memory()
        m.held_device_nbytes = None if held is None else max(0, held - leaving_nbytes)
        m.shared_memory_nbytes = shared_memory_free_nbytes()
        m.host = host_name()
        m.codec_available = codec_available(platform)
        m.h2d_bps = h2d_bandwidth(platform, nbytes, pinned=pinned)
    except Exception as e:
        m.ok, m.error = False, f"{type(e).__name__}: {e}"
    for axis in sorted(groups):
        m.allgather_bps[axis] = allgather_bandwidth(platform, nbytes, groups[axis])
    platform.synchronize()
    return m


def agree(
    mine: RankMeasurement, *, world_size: int, timeout_s: float
) -> tuple[Measurements, list[RankMeasurement]]:
    """Publish ``mine``, read every rank's, and return the group-wide minimum of each number
    (see [Note: one set of numbers]) with every rank's raw record.

    Raises:
        OffloadError: a rank failed to measure (named, on every rank), or a rank never
            published within ``timeout_s``.
    """
    records: list[RankMeasurement] = share(
        mine,
        rank=mine.rank,
        world_size=world_size,
        timeout_s=timeout_s,
        topic="policy",
        what="policy measurement exchange",
        types=(RankMeasurement,),
    )
    failed = [r for r in records if not r.ok]
    if failed:
        raise OffloadError(
            "bandwidth measurement for the automatic policy failed on rank(s) "
            f"{[r.rank for r in failed]}: "
            + "; ".join(f"rank {r.rank}: {r.error}" for r in failed),
            rank=mine.rank,
        )
    return combine(records), records


def combine(records: Sequence[RankMeasurement]) -> Measurements:
    """The minimum of each number over ``records`` (pure)."""
    axes = sorted({a for r in records for a in r.allgather_bps})
    free = [r.free_device_nbytes for r in records if r.free_device_nbytes is not None]
    shm = [r.shared_memory_nbytes for r in records if r.shared_memory_nbytes is not None]
    held = [r.held_device_nbytes for r in records if r.held_device_nbytes is not None]
    return Measurements(
        h2d_bps=min(r.h2d_bps for r in records),
        allgather_bps={
            a: min(r.allgather_bps[a] for r in records if a in r.allgather_bps) for a in axes
        },
        free_device_nbytes=min(free) if len(free) == len(records) else None,
        held_device_nbytes=max(held) if len(held) == len(records) else None,
        shared_memory_nbytes=min(shm) if len(shm) == len(records) else None,
        num_ranks=len(records),
        codec_available=all(r.codec_available for r in records),
    )


def copies_per_node(records: Sequence[RankMeasurement], groups: Sequence[Sequence[int]]) -> int:
    """How many node-shared copies the fullest node would hold: the number of ``groups``
    (one copy each) with a rank on it (pure)."""
    host = {r.rank: r.host for r in records}
    per_node: dict[str, set[int]] = {}
    for i, g in enumerate(groups):
        for rank in g:
            per_node.setdefault(host.get(rank, ""), set()).add(i)
    return max((len(s) for s in per_node.values()), default=1)


def combine_non_block(records: Sequence[RankMeasurement]) -> tuple[int, int]:
    """The largest ``(non_block_nbytes, non_block_to_place_nbytes)`` over ``records`` (pure;
    see [Note: one set of numbers])."""
    return (
        max(r.non_block_nbytes for r in records),
        max(r.non_block_to_place_nbytes for r in records),
    )
