"""The encoded-block container and the CPU reference codec (issue 22; [Note: encoded
blocks], [Note: block codecs]). Pure: no backend, no device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo.codec.codecs import ReferenceCodec
from dlo.codec.format import (
    PIECE_ALIGN,
    check_bitstream,
    check_layout,
    encode_pieces,
    write_pieces,
)
from dlo.errors import OffloadError


def _round_trip(raw: torch.Tensor, piece: int) -> tuple[torch.Tensor, object]:
    codec = ReferenceCodec()
    enc, datas = encode_pieces("b", raw, piece, codec.bitstream, codec.encode)
    buf = torch.empty(enc.nbytes, dtype=torch.uint8)
    write_pieces(buf, enc, [d.clone() for d in datas])
    out = torch.full((raw.numel(),), 7, dtype=torch.uint8)
    for p in enc.pieces:
        src, dst = buf[p.offset : p.offset + p.nbytes], out[p.raw_offset :][: p.raw_nbytes]
        dst.copy_(src) if p.stored else codec.decode(src, dst)
    return out, enc


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=1 << 16),
    piece=st.sampled_from([256, 1000, 4096, 1 << 20]),
    kind=st.sampled_from(["bf16", "zeros", "noise", "fp32"]),
)
def test_any_bytes_round_trip_bitwise(n: int, piece: int, kind: str) -> None:
    g = torch.Generator().manual_seed(n)
    if kind == "bf16":
        raw = (torch.randn((n + 1) // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    elif kind == "fp32":
        raw = torch.randn((n + 3) // 4, generator=g).view(torch.uint8)
    elif kind == "zeros":
        raw = torch.zeros(n, dtype=torch.uint8)
    else:
        raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    raw = raw[:n].clone()
    out, enc = _round_trip(raw, piece)
    assert torch.equal(out, raw)
    assert all(p.offset % PIECE_ALIGN == 0 for p in enc.pieces)  # type: ignore[attr-defined]
    assert sum(p.raw_nbytes for p in enc.pieces) == n  # type: ignore[attr-defined]


def test_incompressible_pieces_are_stored_and_bf16_weights_shrink() -> None:
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (1 << 16,), generator=g, dtype=torch.uint8)
    weights = (torch.randn(1 << 15, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    raw = torch.cat([weights, noise])
    out, enc = _round_trip(raw, 1 << 16)
    assert torch.equal(out, raw)
    stored = [p.stored for p in enc.pieces]  # type: ignore[attr-defined]
    assert stored == [False, True]
    assert enc.pieces[0].nbytes < 0.8 * (1 << 16)  # type: ignore[attr-defined]


def test_the_bitstream_is_checked_and_an_empty_shard_has_no_pieces() -> None:
    raw = torch.arange(4096, dtype=torch.int16).view(torch.uint8)
    codec = ReferenceCodec()
    a, _ = encode_pieces("b", raw, 2048, codec.bitstream, codec.encode)
    c, _ = encode_pieces("b", raw, 2048, "other", codec.encode)
    check_bitstream(a, codec.bitstream)
    with pytest.raises(OffloadError, match="encoded as 'other'"):
        check_bitstream(c, codec.bitstream)
    empty, datas = encode_pieces("e", raw[:0], 0, codec.bitstream, codec.encode)
    assert (empty.pieces, empty.nbytes, datas) == ((), 0, [])


def test_a_corrupt_piece_is_an_error_not_wrong_bytes() -> None:
    codec = ReferenceCodec()
    raw = (torch.randn(4096) * 0.02).to(torch.bfloat16).view(torch.uint8)
    data = codec.encode(raw).clone()
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(OffloadError, match="decoding a block piece"):
        codec.decode(data, torch.empty_like(raw))


def test_a_piece_table_from_elsewhere_is_checked_before_it_sizes_anything() -> None:
    g = torch.Generator().manual_seed(3)
    weights = (torch.randn(5000, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    noise = torch.randint(0, 256, (3000,), generator=g, dtype=torch.uint8)
    raw = torch.cat([weights, noise])
    codec = ReferenceCodec()
    enc, _ = encode_pieces("blk", raw, 4096, codec.bitstream, codec.encode)
    assert len(enc.pieces) == 4 and any(p.stored for p in enc.pieces)
    check_layout(enc, raw.numel(), 4096)  # what encode_pieces writes passes

    def piece(k: int, **kw: object) -> object:
        ps = list(enc.pieces)
        ps[k] = dataclasses.replace(ps[k], **kw)  # type: ignore[arg-type]
        return dataclasses.replace(enc, pieces=tuple(ps))

    stored = next(k for k, p in enumerate(enc.pieces) if p.stored)
    coded = next(k for k, p in enumerate(enc.pieces) if not p.stored)
    bad = {
        "another shard size": (enc, raw.numel() + 1, "pieces cover"),
        "another piece size": (enc, raw.numel(), "pieces cover"),
        "a gap": (piece(1, offset=enc.pieces[1].offset + PIECE_ALIGN), None, "piece 1 lies at"),
        "an overlap": (piece(1, offset=0), None, "piece 1 lies at"),
        "an empty piece": (piece(coded, nbytes=0), None, f"piece {coded} lies at"),
        "a coded piece as long as raw": (
            piece(coded, nbytes=enc.pieces[coded].raw_nbytes),
            None,
            f"piece {coded} holds",
        ),
        "a stored piece shorter": (
            piece(stored, nbytes=enc.pieces[stored].raw_nbytes - 1),
            None,
            f"piece {stored} holds",
        ),
        "a raw range moved": (piece(0, raw_offset=1), None, "pieces cover"),
    }
    for what, (layout, n, match) in bad.items():
        size = raw.numel() if n is None else n
        per = 2048 if what == "another piece size" else 4096
        with pytest.raises(OffloadError, match=f"block 'blk': a malformed piece table: .*{match}"):
            check_layout(layout, size, per)  # type: ignore[arg-type]
