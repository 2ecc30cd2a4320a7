"""The transport of encoded blocks: encoded bytes cross the link, the device decodes them.

[Note: decode pipeline]
For an encoded block E (pieces ``k``, see [Note: encoded blocks] in
:mod:`dlo.codec.format`) loaded into slot S through staging buffer ``b`` (two, used in
turn, each the size of the largest encoded block):

    copy_stream:   wait(decoded[b]); for k: staging[b][piece k] <- host piece k;
                   record(copied[b][k])
    decode_stream: wait(S.free); for k: wait(copied[b][k]); decode piece k -> S[raw range k]
                   (a stored piece: a device copy); record(decoded[b]); record(S.ready)

``decoded[b]`` hands the staging buffer back to the copy stream once every piece read from
it was decoded; ``copied[b][k]`` hands piece ``k`` to the decoder, so piece ``k`` decodes
while piece ``k + 1`` crosses the link; ``S.free`` is waited on by the decoder, the slot's
only writer, so the next block's encoded bytes cross the link while the slot is still in
use. Nothing is allocated per load: staging buffers, events and the decoder's configs
(one per piece size) are made at enable. On the CPU platform every operation is ordered on
the host: the same code path.
"""

from __future__ import annotations

from typing import Any

import torch

from dlo import faults
from dlo.codec.blocks import EncodedShard
from dlo.codec.codecs import Codec
from dlo.codec.format import check_bitstream
from dlo.plan.layout import BlockLayout
from dlo.platform.device import Platform
from dlo.platform.timing import nvtx_range
from dlo.runtime.transport import TransferCounters

NUM_DECODE_STAGING = 2


class DecodingTransport:
    """Loads :class:`~dlo.codec.blocks.EncodedShard` s of group size 1 (see [Note: decode
    pipeline]); the load interface of :class:`~dlo.runtime.transport.BlockTransport`.

    Args:
        platform: device, streams, events.
        copy_stream: the ring's copy stream.
        decode_stream: the stream ``codec`` decodes on (this transport's own).
        max_nbytes, max_pieces: the largest encoded block and piece count it loads.
    """

    group_size = 1

    def __init__(
        self,
        platform: Platform,
        codec: Codec,
        *,
        copy_stream: Any,
        decode_stream: Any,
        max_nbytes: int,
        max_pieces: int,
        counters: TransferCounters,
        rank: int = 0,
    ) -> None:
        self.platform = platform
        self.codec = codec
        self.copy_stream = copy_stream
        self.decode_stream = decode_stream
        self.counters = counters
        self.rank = rank
        where = platform.device if platform.has_streams else torch.device("cpu")
        self._staging = [
            torch.empty(max_nbytes, dtype=torch.uint8, device=where)
            for _ in range(NUM_DECODE_STAGING)
        ]
        self._copied = [
            [platform.new_event() for _ in range(max_pieces)] for _ in range(NUM_DECODE_STAGING)
        ]
        self._decoded = [platform.new_event() for _ in range(NUM_DECODE_STAGING)]
        self._turn = 0

    @property
    def staging_nbytes(self) -> int:
        return sum(s.numel() for s in self._staging)

    @property
    def writer_stream(self) -> Any:
        """The decoder writes the slot last."""
        return self.decode_stream

    def wait_enqueued(self, slot_index: int, block: str) -> None:
        """Nothing: a load is enqueued when :meth:`load` returns."""
        return None

    def agree(self, value: int, describe: str) -> None:
        """Nothing: a group of one."""
        return None

    def load(
        self,
        layout: BlockLayout,
        shard: EncodedShard,
        slot: torch.Tensor,
        *,
        free_event: Any,
        ready_event: Any,
        index: int = -1,
        slot_index: int = -1,
    ) -> None:
        """Enqueue the load of encoded block ``shard`` into ``slot`` and record
        ``ready_event`` once it is decoded."""
        enc, pf = shard.layout, self.platform
        check_bitstream(enc, self.codec.bitstream, rank=self.rank)
        assert enc.raw_nbytes == layout.padded_nbytes and layout.group_size == 1
        faults.check("decode")
        b, self._turn = self._turn, (self._turn + 1) % NUM_DECODE_STAGING
        staging, copied = self._staging[b], self._copied[b]
        copy, dec = self.copy_stream, self.decode_stream
        with nvtx_range("dlo::h2d"), pf.stream(copy):
            copy.wait_event(self._decoded[b])
            for k, p in enumerate(enc.pieces):
                end = p.offset + p.nbytes
                staging[p.offset : end].copy_(shard.data[p.offset : end], non_blocking=True)
                copied[k].record(copy)
        with nvtx_range("dlo::decode"), pf.stream(dec):
            dec.wait_event(free_event)
            for k, p in enumerate(enc.pieces):
                dec.wait_event(copied[k])
                src = staging[p.offset : p.offset + p.nbytes]
                out = slot[p.raw_offset : p.raw_offset + p.raw_nbytes]
                if p.stored:
                    out.copy_(src, non_blocking=True)
                else:
                    self.codec.decode(src, out)
            self._decoded[b].record(dec)
            ready_event.record(dec)
        self.counters.h2d_nbytes += enc.nbytes
        self.counters.decoded_nbytes += enc.raw_nbytes
        self.counters.encoded_h2d_nbytes += enc.nbytes
        self.counters.num_loads += 1
