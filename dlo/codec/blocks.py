"""Encoding a block's shard at enable, and decoding it whole (disable, ``state_dict``).

Encoding a block takes one raw shard on the host (packed from the model's tensors into the
pass's bounce buffer) and, on CUDA, one on the device; its encoded pieces come back through
the same buffer into one pageable buffer of the block's (outside the ledger), kept until the
caller lays every block's pieces into the host region, which exists only once every size is
known (see [Note: encoded blocks] in :mod:`dlo.codec.format`); the caller releases a whole
block's originals once its pieces are held (see [Note: released as encoded] in
:mod:`dlo.backends.layer_codec`). Whole-block copies between host and device go through a
pinned :class:`~dlo.host.bounce.Bounce` (see [Note: bounce buffer]).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dlo import faults
from dlo.codec.codecs import Codec
from dlo.codec.format import EncodedLayout, Piece, encode_pieces
from dlo.host.bounce import Bounce
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

    def raw(self, device: torch.device | str = "cpu", *, keep: bool = False) -> torch.Tensor:
        """The block's raw shard bytes, decoded into new memory on ``device``; ``keep``: the
        decoder keeps its bounce buffer for the next block (a restore pass, which closes it:
        :meth:`BlockDecoder.close`)."""
        return self.decoder.decode(self, torch.device(device), keep=keep)


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
        self.bounce = Bounce(platform)
        """A decode to the host comes back through it (see [Note: bounce buffer])."""
        self._lock = threading.Lock()
        """Decodes take turns in the bounce buffer (``state_dict()`` runs on any thread)."""

    def decode(self, shard: EncodedShard, device: torch.device, keep: bool = False) -> torch.Tensor:
        pf, enc = self.platform, shard.layout
        faults.check("decode")
        where = pf.device if pf.has_streams else torch.device("cpu")
        # ``out`` from the caller's stream, which reads it (its memory is never handed to
        # another decode while a copy out of it is queued); the codec's stream after the
        # caller's work so far
        out = torch.empty(enc.raw_nbytes, dtype=torch.uint8, device=where)
        self.stream.wait_stream(pf.current_stream())
        with self._lock:
            return self._decode(shard, out, device, keep)

    def _decode(
        self, shard: EncodedShard, out: torch.Tensor, device: torch.device, keep: bool
    ) -> torch.Tensor:
        pf, enc, where = self.platform, shard.layout, out.device
        try:
            with pf.stream(self.stream):
                src = shard.data
                if pf.has_streams and not src.is_pinned():  # pieces not laid yet, say
                    src = self.bounce.view(enc.nbytes)
                    src.copy_(shard.data)
                src = src.to(where, non_blocking=True) if pf.has_streams else src
                for p in enc.pieces:
                    piece = src[p.offset : p.offset + p.nbytes]
                    decode_piece(self.codec, p, piece, out[p.raw_offset :][: p.raw_nbytes])
            self.stream.synchronize()
            if out.device == device or device.type != "cpu":
                return out.to(device)
            back = self.bounce.view(out.numel())
            back.copy_(out)  # through pinned memory, then into the caller's new memory
            return torch.empty_like(back).copy_(back)
        finally:
            self.stream.synchronize()  # a failed decode leaves no copy out of the bounce
            if not keep:
                self.bounce.close()

    def close(self) -> None:
        """Release the bounce buffer a ``keep`` decode left (idempotent)."""
        with self._lock:
            self.bounce.close()


def pack_raw(
    layout: BlockLayout, tensors: Sequence[torch.Tensor], bounce: Bounce, group_rank: int = 0
) -> torch.Tensor:
    """``group_rank``'s raw shard of ``tensors``, packed into ``bounce`` (a view of it)."""
    raw = bounce.view(layout.shard_nbytes)
    pack_block(raw, layout, group_rank, tensors)
    return raw


def encode_packed(
    platform: Platform,
    codec: Codec,
    name: str,
    layout: BlockLayout,
    raw: torch.Tensor,
    bounce: Bounce,
) -> tuple[EncodedLayout, list[torch.Tensor]]:
    """Encode block ``name``'s raw shard ``raw`` (packed into ``bounce`` by :func:`pack_raw`)
    in pieces of one slice each (one per chunk); returns the piece table and each piece's
    bytes on the host (views of one new buffer of the block's)."""
    faults.check("encode")
    if not platform.has_streams:  # encoded where it lies; a stored piece is a view of raw
        enc, datas = encode_pieces(name, raw, layout.slice_nbytes, codec.bitstream, codec.encode)
        return enc, [d.clone() if p.stored else d for p, d in zip(enc.pieces, datas)]
    src = raw.to(platform.device, non_blocking=True)  # the codec's stream waits for it
    enc, datas = encode_pieces(name, src, layout.slice_nbytes, codec.bitstream, codec.encode)
    # the codec's encodes are done (each synchronized), so ``raw`` is free: the pieces come
    # back through it, then into the block's own memory
    total = sum(d.numel() for d in datas)
    back = bounce.view(total)
    at = 0
    for d in datas:
        back[at : at + d.numel()].copy_(d, non_blocking=True)
        at += d.numel()
    platform.current_stream().synchronize()
    host = torch.empty_like(back).copy_(back)  # pageable: the region is pinned later
    pieces, at = [], 0
    for d in datas:
        pieces.append(host[at : at + d.numel()])
        at += d.numel()
    return enc, pieces
