"""Moving a block's bytes: host-to-device copies and the AllGather that rebuilds it.

The only dlo module that calls collectives. Everything here only *enqueues* work on the
streams it is given; nothing waits on the host.

[Note: chunk pipeline]
For a block with layout L loaded into device slot S by rank r of a group of G:

    copy_stream:  wait(S.free); for k: copy host slice k -> S[L.slice_range(k, r)];
                  record(chunk_event[k])
    comm_stream:  for k: wait(chunk_event[k]); all_gather(S[L.chunk_range(k)],
                  input=S[L.slice_range(k, r)]); then record(S.ready)

Producer/consumer pairs: ``S.free`` is recorded by the compute stream after the last block
that read S (consumer) and waited on by the copy stream before the first byte is written
(producer); ``chunk_event[k]`` hands slice k from the copy stream to the comm stream;
``S.ready`` hands the whole block from the comm stream to the compute stream. The gather of
chunk k overlaps the copy of chunk k+1. The gather's input is rank r's own range of the
slot, so the gather writes in place and the block needs no staging buffer. With G == 1 the
shard is the whole padded block: one copy, no collective, ``S.ready`` on the copy stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dlo.codec.blocks import EncodedShard
from dlo.codec.on_disk import EncodedOnDisk
from dlo.errors import OffloadError
from dlo.host.mapped import MappedBlock
from dlo.plan.layout import BlockLayout
from dlo.platform.device import Platform
from dlo.platform.timing import nvtx_range
from dlo.runtime.ce_gather import CopyEngineGather
from dlo.runtime.collectives import all_gather_into
from dlo.runtime.decoding import Decoder
from dlo.runtime.read_ahead import ReadAhead
from dlo.runtime.sequence import SequenceCheck

logger = logging.getLogger(__name__)


class Transport(Protocol):
    """What the ring (and the model swap) load a block through: this module's
    :class:`BlockTransport` (host-to-device copies, AllGather) or the staged transport of the
    mapped backing (:class:`~dlo.runtime.staged.StagedTransport`)."""

    group_size: int
    """Ranks that rebuild each block together (1: whole blocks, no collective)."""

    @property
    def writer_stream(self) -> Any:
        """The stream that performs the last write of a load."""
        ...

    def load(
        self,
        layout: BlockLayout,
        shard: Any,
        slot: torch.Tensor,
        *,
        free_event: Any,
        ready_event: Any,
        index: int = -1,
        slot_index: int = -1,
    ) -> None:
        """Enqueue the load of ``shard`` into ``slot`` after ``free_event``; record
        ``ready_event`` once the block is whole."""
        ...

    def wait_enqueued(self, slot_index: int, block: str) -> None:
        """Return once the load into slot ``slot_index`` has recorded its ``ready`` event
        (see [Note: staged ready] in :mod:`dlo.runtime.staged`)."""
        ...

    def agree(self, value: int, describe: str) -> None:
        """Compare ``value`` across the group (a learned order's digest; see [Note:
        prefetch chain] in :mod:`dlo.runtime.chain`); nothing for a group of one."""
        ...

    def upcoming(self, shards: list[Any]) -> None:
        """The shards the ring predicts it loads next, in order (a disk tier reads them
        ahead: see [Note: disk read-ahead] in :mod:`dlo.runtime.read_ahead`)."""
        ...


@dataclass
class TransferCounters:
    h2d_nbytes: int = 0
    allgather_nbytes: int = 0
    num_loads: int = 0
    decoded_nbytes: int = 0
    """Raw bytes decoders wrote into slots (their shards)."""
    encoded_h2d_nbytes: int = 0
    """The encoded bytes it copied for them (counted in ``h2d_nbytes`` too)."""


class BlockTransport:
    """Loads blocks of one group size into device slots (see [Note: chunk pipeline]).

    Args:
        platform: device, streams and events.
        group: the weight-collective process group (None when ``group_size == 1``).
        group_rank, group_size: this rank's place in ``group``.
        copy_stream, comm_stream: the streams owned by the ring.
        max_chunks: the largest ``num_chunks`` of the blocks this transport loads.
        ce_gather: gather into slots with copy engines instead of NCCL kernels ([Note:
            copy-engine gather]); destinations outside its symmetric buffer use ``group``.
        ahead: the reader of this axis's disk-tier shards (``host_budget_gb``).
    """

    def __init__(
        self,
        platform: Platform,
        *,
        group: Any,
        group_rank: int,
        group_size: int,
        copy_stream: Any,
        comm_stream: Any,
        max_chunks: int,
        counters: TransferCounters,
        sequence_check: SequenceCheck | None = None,
        ce_gather: CopyEngineGather | None = None,
        decoder: Decoder | None = None,
        ahead: ReadAhead | None = None,
    ) -> None:
        assert (group is None) == (group_size == 1)
        self.decoder = decoder
        self.ahead = ahead
        self.ce_gather = ce_gather
        self.platform = platform
        self.group = group
        self.group_rank = group_rank
        self.group_size = group_size
        self.copy_stream = copy_stream
        self.comm_stream = comm_stream
        self.counters = counters
        self.sequence_check = sequence_check
        self._chunk_events = [
            platform.new_event() for _ in range(max_chunks if group_size > 1 else 0)
        ]

    def with_decoder(self, decoder: Decoder) -> BlockTransport:
        """A transport of encoded shards on the same group, streams and checks (see [Note:
        decode pipeline] in :mod:`dlo.runtime.decoding`)."""
        return BlockTransport(
            self.platform,
            group=self.group,
            group_rank=self.group_rank,
            group_size=self.group_size,
            copy_stream=self.copy_stream,
            comm_stream=self.comm_stream,
            max_chunks=len(self._chunk_events),
            counters=self.counters,
            sequence_check=self.sequence_check,
            ce_gather=self.ce_gather,
            decoder=decoder,
            ahead=self.ahead,
        )

    @property
    def writer_stream(self) -> Any:
        """The stream that performs the last write of a load."""
        if self.group_size > 1:
            return self.comm_stream
        return self.decoder.stream if self.decoder is not None else self.copy_stream

    def wait_enqueued(self, slot_index: int, block: str) -> None:
        """Nothing: every load is enqueued by the time :meth:`load` returns (a staged
        transport's is not; see [Note: staged ready])."""
        return None

    def agree(self, value: int, describe: str) -> None:
        """Compare ``value`` across the group through the lock-step check, on the comm
        stream (ordered with the gathers); nothing without a check (group of one)."""
        if self.sequence_check is not None:
            self.sequence_check.agree(value, self.comm_stream, describe)

    def upcoming(self, shards: list[Any]) -> None:
        """The shards the ring predicts it loads next: the disk tier's are read ahead (see
        [Note: disk read-ahead] in :mod:`dlo.runtime.read_ahead`)."""
        if self.ahead is not None:
            self.ahead.upcoming([s for s in shards if self._from_disk(s)])

    def _from_disk(self, shard: Any) -> bool:
        """``shard`` is this transport's disk tier's: read ahead, loaded from its buffer."""
        if isinstance(shard, EncodedOnDisk):  # [Note: encoded blocks on disk]
            return self.decoder is not None
        return (
            isinstance(shard, MappedBlock)
            and shard.reads is not None
            and shard.layout.group_size == self.group_size
        )

    def load(
        self,
        layout: BlockLayout,
        shard: torch.Tensor | EncodedShard | MappedBlock | EncodedOnDisk,
        slot: torch.Tensor,
        *,
        free_event: Any,
        ready_event: Any,
        index: int = -1,
        slot_index: int = -1,
    ) -> None:
        """Enqueue the load of block ``index`` into ``slot`` (slot ``slot_index`` of the
        pool; -1 for a buffer outside it) and record ``ready_event``. A disk-tier shard is
        taken from its read-ahead buffer first (this thread waits while it is read; a failed
        read raises before anything is enqueued or gathered).

        Raises:
            OffloadError: the disk read of the shard failed (naming the block).
        """
        if not isinstance(shard, (MappedBlock, EncodedOnDisk)):
            self._load(layout, shard, slot, free_event, ready_event, index, slot_index)
            return
        assert self.ahead is not None, "a disk-tier shard needs the transport's reader"
        self.ahead.requested(shard)
        try:
            buf = self.ahead.acquire(shard)
        except Exception as e:  # the reader's error: the file, its block
            raise OffloadError(
                f"reading from disk failed: {e!r}", rank=self.ahead.rank, block=shard.name
            ) from e
        data = shard.shard(buf) if isinstance(shard, EncodedOnDisk) else buf
        try:
            self._load(layout, data, slot, free_event, ready_event, index, slot_index)
        finally:
            self.ahead.release(shard, self.copy_stream)  # after the copies that read it

    def _load(
        self,
        layout: BlockLayout,
        shard: Any,
        slot: torch.Tensor,
        free_event: Any,
        ready_event: Any,
        index: int,
        slot_index: int,
    ) -> None:
        assert layout.group_size == self.group_size
        if layout.num_chunks == 0:  # a block without tensors: nothing moves on any rank
            ready_event.record(self.copy_stream)
            return
        pf, dec = self.platform, self.decoder
        encoded = shard if isinstance(shard, EncodedShard) else None
        assert (encoded is not None) == (dec is not None), "a decoder loads encoded shards only"
        if encoded is not None and dec is not None and self.group_size == 1:
            b = dec.begin(layout, encoded, self.copy_stream, free_event)
            for k, (start, end, _) in enumerate(layout.shard_ranges(0)):
                dec.piece(b, encoded, k, slot[start:end], self.copy_stream)
            dec.end(b)
            with pf.stream(dec.stream):
                ready_event.record(dec.stream)
            self._count(layout, encoded)
            return
        if self.group_size == 1:
            with nvtx_range("dlo::h2d"), pf.stream(self.copy_stream):
                self.copy_stream.wait_event(free_event)
                slot[: layout.padded_nbytes].copy_(shard, non_blocking=True)
                ready_event.record(self.copy_stream)
            self.counters.h2d_nbytes += layout.shard_nbytes
            self.counters.num_loads += 1
            return
        r = self.group_rank
        ce = self.ce_gather if self.ce_gather is not None and self.ce_gather.covers(slot) else None
        check = self.sequence_check
        tags = check is not None and ce is not None and ce.has_tags
        if check is not None and not tags:
            check.issue(index, self.comm_stream, slot=slot_index)
        if tags:
            assert ce is not None and check is not None
            entry = check.take()  # may raise a divergence: before anything is enqueued
            ce.post_tag(self.comm_stream, index, slot_index)  # [Note: lock-step tags]
        b = -1
        if encoded is not None and dec is not None:  # the decoder writes this rank's slices
            b = dec.begin(layout, encoded, self.copy_stream, free_event)
        else:
            with pf.stream(self.copy_stream):
                self.copy_stream.wait_event(free_event)
        for k, (start, end, shard_off) in enumerate(layout.shard_ranges(r)):
            mine = slot[start:end]
            if encoded is not None and dec is not None:
                dec.piece(b, encoded, k, mine, self.copy_stream, self._chunk_events[k])
            else:
                with nvtx_range("dlo::h2d"), pf.stream(self.copy_stream):
                    mine.copy_(
                        shard[shard_off : shard_off + layout.slice_nbytes], non_blocking=True
                    )
                    self._chunk_events[k].record(self.copy_stream)
            c0, c1 = layout.chunk_range(k)
            with nvtx_range("dlo::allgather"), pf.stream(self.comm_stream):
                self.comm_stream.wait_event(self._chunk_events[k])
                if ce is not None:
                    ce.wait_chunk(self.comm_stream, layout.name)
                    if tags and k == 0:
                        assert check is not None
                        check.read(ce.tags, self.comm_stream, index, slot=slot_index, entry=entry)
                    ce.pull_chunk(slot, layout, k)
                else:
                    all_gather_into(slot[c0:c1], mine, self.group)
        if encoded is not None and dec is not None:
            dec.end(b)
        with pf.stream(self.comm_stream):
            if ce is not None:
                ce.finish(self.comm_stream, layout.name)
            ready_event.record(self.comm_stream)
        self._count(layout, encoded)
        self.counters.allgather_nbytes += layout.padded_nbytes

    def _count(self, layout: BlockLayout, encoded: EncodedShard | None) -> None:
        c = self.counters
        if encoded is None:
            c.h2d_nbytes += layout.shard_nbytes
        else:
            c.h2d_nbytes += encoded.layout.nbytes
            c.encoded_h2d_nbytes += encoded.layout.nbytes
            c.decoded_nbytes += layout.shard_nbytes
        c.num_loads += 1
