"""What an enabled layerwise backend holds, and its ``stats()``: plain values of what it holds
and what it moved (DESIGN.md section 2 names the keys every backend reports)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dlo.backends.layer_block import LayerBlock
from dlo.backends.layer_host import LayerHost
from dlo.backends.layer_transports import Transports
from dlo.backends.replan_setup import ReplanSetup
from dlo.codec.blocks import EncodedShard
from dlo.codec.on_disk import EncodedOnDisk
from dlo.config.fields import MIB
from dlo.plan.layers import charged_nbytes
from dlo.platform.device import Platform
from dlo.runtime.read_ahead import ReadAheadStats
from dlo.runtime.ring import RingScheduler
from dlo.runtime.slots import SlotPool
from dlo.runtime.transport import TransferCounters


@dataclass
class LayerState:
    """Everything one enable of the layerwise backend built (a fresh one per enable)."""

    host: LayerHost | None = None
    pool: SlotPool | None = None
    scheduler: RingScheduler | None = None
    transports: Transports | None = None
    counters: TransferCounters = field(default_factory=TransferCounters)
    resident_nbytes: int = 0
    """Device bytes of the resident blocks."""
    placed_nbytes: int = 0
    """Device bytes of the non-block state dlo moved there."""
    enable_time_s: float = 0.0
    print_time_s: float = 0.0
    """Of the enable: the content fingerprints of the exchanged blocks (see [Note: weight
    fingerprints] in :mod:`dlo.host.fingerprint`); logged, not in ``stats()``."""
    fill_time_s: float = 0.0
    """Of the enable: filling the host shards (from the model or the checkpoint file), with
    the pinning of each filled block running behind."""
    pin_time_s: float = 0.0
    """Of the enable: the pinning left after the last block was filled."""
    enable_peak_rss: int = 0
    policy: dict[str, Any] | None = None
    """The automatic policy's record (``stats()["policy"]``), None without one."""
    replan: ReplanSetup = field(default_factory=ReplanSetup)
    """The DiTs re-planned between forwards and the blocks pinned at enable."""
    uncap: Callable[[], None] = lambda: None
    """Lifts the device budget's allocator cap (idempotent; the journal runs it too)."""

    @property
    def blocks(self) -> list[LayerBlock]:
        return self.host.blocks if self.host else []

    def _pinned(self) -> int:
        rings = self.scheduler.rings if self.scheduler else []
        return sum(b.own is not None for r in rings for b in r.blocks)

    def describe(self) -> str:
        """One line saying what the enable built (logged at INFO)."""
        host, pool, blocks = self.host, self.pool, self.blocks
        region, shared = (host.region, host.shared) if host else (None, None)
        return (
            f"dlo layer offload enabled: {sum(not b.resident for b in blocks)} streamed "
            f"({self._pinned()} pinned) + "
            f"{sum(b.resident for b in blocks)} resident blocks, "
            f"{len(pool.slots) if pool else 0} slots x "
            f"{(pool.slot_nbytes if pool else 0) / MIB:.1f} MiB, host "
            f"{region.nbytes / MIB if region else 0:.1f} MiB (pinned "
            f"{region.pinned_nbytes / MIB if region else 0:.1f} MiB), node-shared "
            f"{shared.nbytes / MIB if shared else 0:.1f} MiB over "
            f"{shared.share_ranks if shared else 1} ranks, mapped from the checkpoint "
            f"{sum(b.mapped.mapped_nbytes for b in blocks if b.mapped) / MIB:.1f} MiB, "
            f"{self.enable_time_s:.2f}s (fingerprints {self.print_time_s:.2f}s)"
        )

    def stats(self, platform: Platform, *, enabled: bool, host_backing: str) -> dict[str, Any]:
        """The statistics (see the module docstring); synchronizes the device."""
        sched, host, pool = self.scheduler, self.host, self.pool
        region, shared = (host.region, host.shared) if host else (None, None)
        transports, counters = self.transports, self.counters
        staging = transports.staging if transports else None
        blocks = self.blocks
        encoded = [b.encoded for b in blocks if isinstance(b.encoded, EncodedShard)]  # host
        encoded_nbytes = sum(e.layout.nbytes for e in encoded)
        encoded_raw_nbytes = sum(e.layout.raw_nbytes for e in encoded)
        decoders = transports.decoders if transports else []
        decode_ms = sum(d.decode_ms() for d in decoders)
        decode_loads = sum(d.num_loads for d in decoders)
        tails = [d.decode_tail_ms() for d in decoders]
        tail_ms, tail_loads = sum(t for t, _ in tails), sum(n for _, n in tails)
        if sched is not None:
            platform.synchronize()
            sched.harvest_all()
        streamed = [b for r in sched.rings for b in r.blocks] if sched else []
        # what ran: an AllGather stack whose weight group is one rank copies whole blocks
        transfers = {
            "rank-local"
            if b.stack.transfer == "allgather" and b.stack.group_size == 1
            else b.stack.transfer
            for b in blocks
        }
        return {
            "enabled": enabled,
            "transfer": next(
                (t for t in ("allgather", "node-shared") if t in transfers), "rank-local"
            ),
            "group_size": transports.group_size if transports else 1,
            "group_rank": transports.group_rank if transports else 0,
            "host_backing": host_backing,
            # what this rank holds, a node-shared block's bytes charged 1/L to each sharer
            "host_nbytes": sum(
                b.mapped.private_nbytes
                if b.mapped
                else charged_nbytes(
                    b.encoded.layout.nbytes if b.encoded else b.layout.shard_nbytes,
                    shared.share_ranks if shared and b.node_shared else 1,
                )
                for b in blocks
            ),
            "host_mapped_nbytes": sum(b.mapped.shard_mapped_nbytes for b in blocks if b.mapped),
            "host_region_nbytes": region.nbytes if region else 0,
            "host_shared_nbytes": shared.nbytes if shared else 0,
            "host_share_ranks": shared.share_ranks if shared else 1,
            "host_pinned_nbytes": (region.pinned_nbytes if region else 0)
            + (shared.charged_pinned_nbytes if shared else 0)
            + (staging.pinned_nbytes if staging else 0)
            + sum(a.pinned_nbytes for a in (transports.aheads.values() if transports else [])),
            "num_staging_buffers": staging.num_buffers if staging else 0,
            "staging_buffer_nbytes": staging.buffer_nbytes if staging else 0,
            "staging_host_wait_ms": staging.host_wait_s * 1e3 if staging else 0.0,
            **disk_stats(transports, blocks, host),
            # [Note: block codecs]: what the encoded blocks hold and move
            "codec": next((b.stack.codec for b in blocks if b.encoded), "none"),
            "codec_bitstream": host.codec.bitstream if host and host.codec else None,
            "host_encoded_nbytes": encoded_nbytes,
            "host_encoded_raw_nbytes": encoded_raw_nbytes,
            "encoded_read_blocks": host.codec.read_blocks if host and host.codec else 0,
            "codec_ratio": encoded_nbytes / encoded_raw_nbytes if encoded_raw_nbytes else 1.0,
            "decoded_nbytes": counters.decoded_nbytes,
            "encoded_h2d_nbytes": counters.encoded_h2d_nbytes,
            "decode_ms": decode_ms,
            "decode_ms_per_load": decode_ms / decode_loads if decode_loads else 0.0,
            "decode_tail_ms_per_load": tail_ms / tail_loads if tail_loads else 0.0,
            "decode_gbps": counters.decoded_nbytes / decode_ms / 1e6 if decode_ms else 0.0,
            "device_decode_staging_nbytes": sum(d.staging_nbytes for d in decoders),
            "device_slot_nbytes": pool.nbytes if pool else 0,
            "device_symmetric_nbytes": pool.symmetric_nbytes if pool else 0,
            "device_resident_block_nbytes": self.resident_nbytes,
            "device_non_block_nbytes": self.placed_nbytes,
            "h2d_nbytes": counters.h2d_nbytes,
            "allgather_nbytes": counters.allgather_nbytes,
            "num_loads": counters.num_loads,
            "exposed_wait_ms": sum(b.wait.total_ms for b in streamed if b.wait),
            "block_wait_ms": {b.name: b.wait.total_ms for b in streamed if b.wait},
            "dropped_wait_samples": sum(b.wait.dropped for b in streamed if b.wait),
            "num_demand_loads": sum(b.num_demand_loads for b in streamed),
            "num_wasted_loads": sum(b.num_wasted_loads for b in streamed),
            "wasted_nbytes": sum(
                b.num_wasted_loads * b.layout.nbytes // b.layout.group_size for b in streamed
            ),
            **(
                sched.caches.stats()
                if sched is not None and sched.caches is not None
                else {"num_skipped_blocks": 0, "num_cache_inner_blocks": 0}
            ),
            "num_streamed_blocks": len(streamed),
            "num_resident_blocks": sum(b.resident for b in blocks),
            "num_slots": len(pool.slots) if pool else 0,
            # what gathered: None where nothing did (whole blocks, or a group of one)
            "gather_engine": (
                None
                if not transports or transports.group_size == 1
                else "copy"
                if transports.gather_sync is not None
                else "nccl"
            ),
            "gather_sync": transports.gather_sync if transports else None,
            "pageable_blocks": list(host.pageable) if host else [],
            "enable_time_s": self.enable_time_s,
            "fill_time_s": self.fill_time_s,
            "pin_time_s": self.pin_time_s,
            "enable_peak_rss_nbytes": self.enable_peak_rss,
            "num_pinned_blocks": self._pinned(),
            "device_pinned_block_nbytes": sum(
                b.layout.padded_nbytes for b in streamed if b.own is not None
            ),
            "policy": self._policy(),
            "codec_late": {  # [Note: codec turned on by measurement]: per DiT ring
                r.name: r.replanner.late.state
                for r in (self.scheduler.rings if self.scheduler else [])
                if r.replanner is not None and r.replanner.late is not None
            },
        }

    def _policy(self) -> dict[str, Any] | None:
        """The policy's record, with every re-plan since enable."""
        rings = self.scheduler.rings if self.scheduler else []
        replanners = [r.replanner for r in rings if r.replanner is not None]
        records = [r for p in replanners for r in p.records]
        if not replanners or (self.policy is None and not records):
            return self.policy
        return {**(self.policy or {}), "replans": records}


def disk_stats(
    transports: Transports | None, blocks: list[LayerBlock], host: LayerHost | None
) -> dict[str, Any]:
    """What the disk tier of ``host_budget_gb`` holds and read (see [Note: disk read-ahead]
    in :mod:`dlo.runtime.read_ahead`), and its model: the probe's rate, and a pass over the
    streamed disk blocks at that rate (their encoded bytes where an encoded checkpoint serves
    them: [Note: encoded blocks on disk] in :mod:`dlo.codec.on_disk`)."""
    disk = [b for b in blocks if b.from_disk]
    probe = host.disk_probe if host else None
    on_disk = {b.index: b.encoded for b in disk if isinstance(b.encoded, EncodedOnDisk)}
    read = {
        b.index: on_disk[b.index].read_nbytes if b.index in on_disk else b.layout.shard_nbytes
        for b in disk
    }
    streamed = sum(read[b.index] for b in disk if not b.resident)
    aheads = list(transports.aheads.values()) if transports else []
    st = ReadAheadStats()
    for a in aheads:
        for k, v in vars(a.stats).items():
            setattr(st, k, getattr(st, k) + v)
    files = host.reads.files if host and host.reads else []
    return {
        "num_disk_blocks": len(disk),
        "disk_nbytes": sum(read.values()),
        "num_disk_encoded_blocks": len(on_disk),
        "disk_direct": all(f.direct for f in files) if files else None,
        "disk_read_nbytes": st.read_nbytes,
        "disk_read_ms": st.read_s * 1e3,
        "disk_read_gbps": st.read_nbytes / st.read_s / 1e9 if st.read_s else 0.0,
        "num_disk_reads": st.num_reads,
        "num_wasted_disk_reads": st.num_wasted_reads,
        "read_ahead_buffers": sum(a.num_buffers for a in aheads),
        "read_ahead_buffer_nbytes": max((a.buffer_nbytes for a in aheads), default=0),
        "read_ahead_wait_ms": st.wait_s * 1e3,
        "num_read_ahead_waits": st.num_waits,
        "disk_probe_gbps": probe[1] / 1e9 if probe else 0.0,
        "disk_limit_ms": streamed / probe[1] * 1e3 if probe and probe[1] else 0.0,
    }
