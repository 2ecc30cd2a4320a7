"""Encoding a block's shard at enable, and decoding it whole (disable, ``state_dict``).

Encoding a block takes one raw shard on the host (packed from the model's tensors) and, on
CUDA, one on the device; its encoded pieces are kept (pageable, outside the ledger) until
the caller lays every block's pieces into the host region, which exists only once every size
is known (see [Note: encoded blocks] in :mod:`dlo.codec.format`); the caller releases a
whole block's originals once its pieces are held (see [Note: released as encoded] in
:mod:`dlo.backends.layer_codec`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dlo import faults
from dlo.codec.codecs import Codec
from dlo.codec.format import EncodedLayout, Piece, encode_pieces
from dlo.host.packer import pack_block
from dlo.plan.layout import BlockLayout
from dlo.platform.device import Platform


@dataclass(eq=False)
class EncodedShard:
    """A block's host copy, encoded: its piece table and its bytes in the host region."""

    layout: EncodedLayout
    data: torch.Tensor
    """The encoded buffer (uint8, a view of the host region)."""
    decoder: BlockDecoder

    def raw(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The block's raw shard bytes, decoded into new memory on ``device``."""
        return self.decoder.decode(self, torch.device(device))


def decode_piece(codec: Codec, p: Piece, src: torch.Tensor, out: torch.Tensor) -> None:
    """Piece ``p``'s bytes ``src`` into ``out`` (its raw range), on the current stream: a
    stored piece is copied, the others decoded."""
    if p.stored:
        out.copy_(src, non_blocking=True)
    else:
        codec.decode(src, out)


class BlockDecoder:
    """Decodes whole blocks outside the ring, synchronously, on ``stream``: the stream
    ``codec`` was made for (its decodes run there whatever torch's current stream is)."""

    def __init__(self, platform: Platform, codec: Codec, stream: Any) -> None:
        self.platform, self.codec, self.stream = platform, codec, stream

    def decode(self, shard: EncodedShard, device: torch.device) -> torch.Tensor:
        pf, enc = self.platform, shard.layout
        faults.check("decode")
        where = pf.device if pf.has_streams else torch.device("cpu")
        # ``out`` from the caller's stream, which reads it (its memory is never handed to
        # another decode while a copy out of it is queued); the codec's stream after the
        # caller's work so far
        out = torch.empty(enc.raw_nbytes, dtype=torch.uint8, device=where)
        self.stream.wait_stream(pf.current_stream())
        with pf.stream(self.stream):
            src = shard.data.to(where, non_blocking=True) if pf.has_streams else shard.data
            for p in enc.pieces:
                piece = src[p.offset : p.offset + p.nbytes]
                decode_piece(self.codec, p, piece, out[p.raw_offset :][: p.raw_nbytes])
        self.stream.synchronize()
        return out.to(device)


def encode_block(
    platform: Platform,
    codec: Codec,
    name: str,
    layout: BlockLayout,
    tensors: Sequence[torch.Tensor],
    scratch: torch.Tensor,
    group_rank: int = 0,
) -> tuple[EncodedLayout, list[torch.Tensor]]:
    """Pack ``group_rank``'s shard of ``tensors`` into ``scratch`` (a host uint8 buffer of at
    least the shard's size) and encode it in pieces of one slice each (one per chunk); returns
    the piece table and each piece's bytes on the host."""
    faults.check("encode")
    raw = scratch[: layout.shard_nbytes]
    pack_block(raw, layout, group_rank, tensors)
    src = raw.to(platform.device) if platform.has_streams else raw
    enc, datas = encode_pieces(name, src, layout.slice_nbytes, codec.bitstream, codec.encode)
    # on the host, a stored piece is a view of the scratch the next block overwrites
    return enc, [
        d.cpu() if d.device.type != "cpu" else d.clone() if p.stored else d
        for p, d in zip(enc.pieces, datas)
    ]
