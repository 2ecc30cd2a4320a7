"""The container of one encoded block: its raw bytes cut into pieces, each encoded alone.

[Note: encoded blocks]
A rank's raw shard (as the host region would hold it) is cut into pieces of one slice each
(one chunk with G = 1): each piece is encoded on its own, so a
load can decode piece ``k`` while piece ``k + 1`` still crosses the link, and a decoder
config is built once per distinct piece size. A piece the codec would not shrink is stored
as it is (``stored``) and copied instead of decoded: fp32 noise grows under a 16-bit
entropy coder. Encoded pieces follow each other in one buffer, each starting on
:data:`PIECE_ALIGN` (what nvCOMP's decoder asks of its input), and the buffer is what the
host region holds: the ledger and the pin budget count encoded bytes. The container names
its bitstream; decoding with another codec is refused. With AllGather the shard is this
rank's slices, one piece per slice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dlo.errors import OffloadError
from dlo.plan.layout import round_up

PIECE_ALIGN = 256


@dataclass(frozen=True)
class Piece:
    """One piece: raw bytes ``[raw_offset, raw_offset + raw_nbytes)`` of the block, held in
    encoded bytes ``[offset, offset + nbytes)`` of the block's buffer."""

    raw_offset: int
    raw_nbytes: int
    offset: int
    nbytes: int
    stored: bool
    """Held as raw bytes (the codec did not shrink it)."""


@dataclass(frozen=True)
class EncodedLayout:
    """Where each piece of one encoded block lies (see [Note: encoded blocks])."""

    name: str
    bitstream: str
    raw_nbytes: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded buffer (the host copy)."""
        last = self.pieces[-1] if self.pieces else None
        return last.offset + last.nbytes if last else 0


def encode_pieces(
    name: str,
    raw: torch.Tensor,
    piece_nbytes: int,
    bitstream: str,
    encode: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[EncodedLayout, list[torch.Tensor]]:
    """Encode the uint8 tensor ``raw`` piece by piece with ``encode`` (raw piece in, encoded
    uint8 tensor out, on the same device); returns the layout and each piece's bytes (the
    encoded ones, or ``raw``'s own view for a stored piece)."""
    assert raw.dtype == torch.uint8 and raw.dim() == 1
    if raw.numel() == 0:  # a block without tensors: nothing to encode, nothing moves
        return EncodedLayout(name, bitstream, 0, ()), []
    assert piece_nbytes > 0
    pieces: list[Piece] = []
    datas: list[torch.Tensor] = []
    at = 0
    for lo in range(0, raw.numel(), piece_nbytes):
        chunk = raw[lo : lo + piece_nbytes]
        data = encode(chunk)
        stored = data.numel() >= chunk.numel()
        if stored:
            data = chunk
        at = round_up(at, PIECE_ALIGN)
        pieces.append(Piece(lo, chunk.numel(), at, data.numel(), stored))
        datas.append(data)
        at += data.numel()
    return EncodedLayout(name, bitstream, raw.numel(), tuple(pieces)), datas


def write_pieces(dst: torch.Tensor, layout: EncodedLayout, datas: list[torch.Tensor]) -> None:
    """Lay the pieces' bytes out in ``dst`` (the block's encoded buffer), gaps zero."""
    assert dst.numel() == layout.nbytes
    end = 0
    for p, d in zip(layout.pieces, datas):
        dst[end : p.offset].zero_()
        dst[p.offset : p.offset + p.nbytes].copy_(d)
        end = p.offset + p.nbytes


def check_layout(
    layout: EncodedLayout, raw_nbytes: int, piece_nbytes: int, *, source: str = "", rank: int = 0
) -> None:
    """Refuse a piece table another process wrote (a sharer's exchange, a file) unless it is
    one :func:`encode_pieces` could have written for a shard of ``raw_nbytes`` cut in
    ``piece_nbytes``: pieces in raw order covering it, each on the next aligned byte after
    the one before, an encoded piece shorter than its raw bytes and a stored one as long (so
    the buffer is never longer than the raw shard plus the alignment gaps). A decoder is never handed bytes out of place.

    Raises:
        OffloadError: naming the block, ``source`` (who wrote the table) and what is wrong.
    """
    want = [(lo, min(piece_nbytes, raw_nbytes - lo)) for lo in range(0, raw_nbytes, piece_nbytes)]
    got = [(p.raw_offset, p.raw_nbytes) for p in layout.pieces]
    why = ""
    if layout.raw_nbytes != raw_nbytes or got != want:
        why = f"its pieces cover {got[:4]}... of {layout.raw_nbytes} bytes, not {raw_nbytes}"
    end = 0
    for k, p in enumerate(layout.pieces):
        if why:
            break
        if p.offset != round_up(end, PIECE_ALIGN) or p.nbytes <= 0:
            why = f"piece {k} lies at {p.offset} (+{p.nbytes} bytes) after byte {end}"
        elif p.stored != (p.nbytes >= p.raw_nbytes) or (p.stored and p.nbytes != p.raw_nbytes):
            why = f"piece {k} holds {p.nbytes} bytes of {p.raw_nbytes} (stored={p.stored})"
        end = p.offset + p.nbytes
    if why:
        raise OffloadError(
            f"a malformed piece table{source}: {why}",
            rank=rank,
            block=layout.name,
        )


def check_bitstream(layout: EncodedLayout, bitstream: str, *, rank: int = 0) -> None:
    if layout.bitstream != bitstream:
        raise OffloadError(
            f"block {layout.name!r} is encoded as {layout.bitstream!r}; this process decodes "
            f"{bitstream!r}",
            rank=rank,
            block=layout.name,
        )
