"""The transports of one layerwise enable: device slots, the disk tier's read-aheads, the
staging of blocks read from their file, one transport per weight axis and the decoders of
encoded blocks (see [Note: layer plan] in :mod:`dlo.plan.layers` for the sizes). Every step
is journaled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dlo import faults
from dlo.backends.layer_block import LayerBlock
from dlo.codec.on_disk import EncodedOnDisk
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.errors import InjectedFault
from dlo.journal import Journal
from dlo.parallel.groups import weight_group
from dlo.plan.layers import ENCODED_AXIS, LayerPlan
from dlo.platform.device import Platform
from dlo.runtime.ce_gather import CopyEngineGather
from dlo.runtime.decoding import Decoder
from dlo.runtime.read_ahead import ReadAhead
from dlo.runtime.sequence import SequenceCheck
from dlo.runtime.slots import SlotPool
from dlo.runtime.staged import NUM_STAGING_BUFFERS, StagedTransport
from dlo.runtime.transport import BlockTransport, TransferCounters, Transport

logger = logging.getLogger(__name__)


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
        if axis == ENCODED_AXIS:  # the largest encoded block read (never over its raw bytes)
            nbytes = max(
                b.encoded.read_nbytes for b in blocks if isinstance(b.encoded, EncodedOnDisk)
            )
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
        on_disk = any(isinstance(b.encoded, EncodedOnDisk) for b in encoded)
        reader = out.aheads[ENCODED_AXIS] if on_disk else None  # [Note: encoded blocks on disk]
        if reader is not None or not isinstance(transport, BlockTransport):
            assert all(b.layout.group_size == 1 for b in encoded)
            transport = BlockTransport(
                platform,
                group=None,
                group_rank=0,
                group_size=1,
                copy_stream=copy_stream,
                comm_stream=comm_stream,
                max_chunks=0,
                counters=counters,
                ahead=reader,
            )
        faults.check("staging_allocation")
        shards = [(e.layout, b.layout.num_chunks) for b in encoded if (e := b.encoded)]
        decoder = Decoder.for_shards(platform, name, shards, rank=rank)
        out.decoders.append(decoder)
        out.encoded_by_axis[axis] = transport.with_decoder(decoder)
    return out
