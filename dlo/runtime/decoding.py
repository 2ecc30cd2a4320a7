"""Encoded shards through the transport: encoded bytes cross the link, the device decodes.

[Note: decode pipeline]
A :class:`~dlo.runtime.transport.BlockTransport` with a :class:`Decoder` loads
:class:`~dlo.codec.blocks.EncodedShard` s. An encoded shard has one piece per slice of the
layout (one per chunk with G = 1; see [Note: encoded blocks] in :mod:`dlo.codec.format`), so
the chunk pipeline is unchanged except for how slice ``k`` reaches the slot. For a load into
slot S through staging buffer ``b`` (two, used in turn, each the size of the largest encoded
shard):

    copy_stream:   wait(decoded[b]); for k: staging[b][piece k] <- host piece k;
                   record(copied[b][k])
    decode_stream: wait(S.free); for k: wait(copied[b][k]); decode piece k -> S[slice k]
                   (a stored piece: a device copy); record(chunk_event[k]) (G > 1);
                   record(decoded[b]); with G = 1 record(S.ready)

then, with G > 1, the comm stream gathers chunk ``k`` after ``chunk_event[k]`` exactly as
in [Note: chunk pipeline]. ``decoded[b]`` hands the staging buffer back to the copy stream
once every piece read from it was decoded; ``copied[b][k]`` hands piece ``k`` to the decoder,
so piece ``k`` decodes while piece ``k + 1`` crosses the link; ``S.free`` is waited on by the
decoder, the first writer of the slot, so the next block's encoded bytes cross the link
while the slot is still in use. Nothing is allocated per load from torch's allocator:
staging buffers, events and the codec's configs (one per piece size, :meth:`Codec.prepare`)
exist from enable on (nvCOMP's own scratch, if it takes any, is its allocator's). On the CPU platform every
operation is ordered on the host: the same code path.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from dlo import faults
from dlo.codec.blocks import EncodedShard, decode_piece
from dlo.codec.codecs import Codec, get_codec
from dlo.codec.format import EncodedLayout, check_bitstream
from dlo.plan.layout import BlockLayout
from dlo.plan.policy_model import DECODE_STAGING_BUFFERS
from dlo.platform.device import Platform
from dlo.platform.timing import StreamTimer, nvtx_range


class Decoder:
    """The copy-then-decode stage of a transport of encoded shards (see [Note: decode
    pipeline]).

    Args:
        platform: device, streams, events.
        codec: decodes on ``decode_stream``.
        max_nbytes, max_pieces: the largest encoded shard and piece count it loads.
        piece_sizes: the raw sizes of the pieces it decodes (stored ones are copied).
    """

    def __init__(
        self,
        platform: Platform,
        codec: Codec,
        *,
        decode_stream: Any,
        max_nbytes: int,
        max_pieces: int,
        piece_sizes: Collection[int] = (),
        rank: int = 0,
    ) -> None:
        for n in sorted(piece_sizes):  # the codec's decode configs, before any load
            codec.prepare(n)
        self.platform = platform
        self.codec = codec
        self.stream = decode_stream
        self.rank = rank
        where = platform.device if platform.has_streams else torch.device("cpu")
        self._staging = [
            torch.empty(max_nbytes, dtype=torch.uint8, device=where)
            for _ in range(DECODE_STAGING_BUFFERS)
        ]
        self._copied = [
            [platform.new_event() for _ in range(max_pieces)] for _ in range(DECODE_STAGING_BUFFERS)
        ]
        self._decoded = [platform.new_event() for _ in range(DECODE_STAGING_BUFFERS)]
        # device time of each decode, per (staging buffer, piece): a pair is read back when
        # it is used again, two loads later, by when it has long completed
        self._timers = [
            [StreamTimer(platform) for _ in range(max_pieces)]
            for _ in range(DECODE_STAGING_BUFFERS)
        ]
        # per staging buffer: from the last encoded byte's arrival to the block's last
        # decode (copy stream to decode stream): how much later the block is ready than
        # its bytes are there, the part of a load's latency the decode adds
        self._tails = [StreamTimer(platform) for _ in range(DECODE_STAGING_BUFFERS)]
        self._turn = 0
        self.num_loads = 0

    @classmethod
    def for_shards(
        cls,
        platform: Platform,
        codec: str,
        shards: Sequence[tuple[EncodedLayout, int]],
        *,
        rank: int = 0,
    ) -> Decoder:
        """The decoder of ``shards`` (each one's piece table and its layout's chunk count),
        on a decode stream of its own, sized for the largest of them."""
        stream = platform.new_stream()
        return cls(
            platform,
            get_codec(platform, codec, stream),
            decode_stream=stream,
            max_nbytes=max(enc.nbytes for enc, _ in shards),
            max_pieces=max(n for _, n in shards),
            piece_sizes={p.raw_nbytes for enc, _ in shards for p in enc.pieces if not p.stored},
            rank=rank,
        )

    def fit(self, layout: EncodedLayout) -> None:
        """Make room for a block encoded again between forwards (a LoRA fuse: see [Note:
        fusing while streaming] in :mod:`dlo.backends.lora_fuse`): its piece sizes prepared,
        the staging buffers grown if it is larger than any before. The device is idle."""
        for p in layout.pieces:
            if not p.stored:
                self.codec.prepare(p.raw_nbytes)
        if layout.nbytes > self._staging[0].numel():
            where = self._staging[0].device
            self._staging = [
                torch.empty(layout.nbytes, dtype=torch.uint8, device=where)
                for _ in range(DECODE_STAGING_BUFFERS)
            ]

    def decode_ms(self) -> float:
        """Device time spent decoding, over every load so far (0 on the CPU platform)."""
        for row in self._timers:
            for t in row:
                t.harvest(block_host=True)
        return sum(t.total_ms for row in self._timers for t in row)

    def decode_tail_ms(self) -> tuple[float, int]:
        """Device time from the last encoded byte of a load on the device to its last
        decode, summed over the loads timed, and their count (0 on the CPU platform)."""
        for t in self._tails:
            t.harvest(block_host=True)
        return sum(t.total_ms for t in self._tails), sum(t.count for t in self._tails)

    @property
    def staging_nbytes(self) -> int:
        return sum(s.numel() for s in self._staging)

    def begin(
        self, layout: BlockLayout, shard: EncodedShard, copy_stream: Any, free_event: Any
    ) -> int:
        """Start a load of ``shard``: the staging buffer it goes through, once the decoder
        (the slot's first writer) waits on ``free_event``."""
        enc = shard.layout
        check_bitstream(enc, self.codec.bitstream, rank=self.rank)
        assert len(enc.pieces) == layout.num_chunks and enc.raw_nbytes == layout.shard_nbytes
        faults.check("decode")
        b, self._turn = self._turn, (self._turn + 1) % DECODE_STAGING_BUFFERS
        pf = self.platform
        with pf.stream(copy_stream):
            copy_stream.wait_event(self._decoded[b])
        with pf.stream(self.stream):
            self.stream.wait_event(free_event)
        return b

    def piece(
        self,
        b: int,
        shard: EncodedShard,
        k: int,
        out: torch.Tensor,
        copy_stream: Any,
        done_event: Any = None,
    ) -> None:
        """Piece ``k`` of ``shard`` across the link into staging ``b``, then decoded into
        ``out`` (slice ``k`` of the slot); ``done_event`` recorded once it is there."""
        p, pf = shard.layout.pieces[k], self.platform
        staging, copied = self._staging[b], self._copied[b][k]
        end = p.offset + p.nbytes
        assert p.raw_nbytes == out.numel()
        with nvtx_range("dlo::h2d"), pf.stream(copy_stream):
            staging[p.offset : end].copy_(shard.data[p.offset : end], non_blocking=True)
            copied.record(copy_stream)
            if k == len(shard.layout.pieces) - 1:
                self._tails[b].begin(copy_stream)
        with nvtx_range("dlo::decode"), pf.stream(self.stream):
            self.stream.wait_event(copied)
            timer = self._timers[b][k]
            timer.begin(self.stream)
            decode_piece(self.codec, p, staging[p.offset : end], out)
            timer.end(self.stream)
            if done_event is not None:
                done_event.record(self.stream)

    def end(self, b: int) -> None:
        """Every piece of the load read from staging ``b`` is decoded (or enqueued)."""
        with self.platform.stream(self.stream):
            self._decoded[b].record(self.stream)
            self._tails[b].end(self.stream)
        self.num_loads += 1
