"""The encoded-block container and the CPU reference codec (issue 22; [Note: encoded
blocks], [Note: block codecs]). Pure: no backend, no device."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo.codec.codecs import ReferenceCodec
from dlo.codec.format import (
    PIECE_ALIGN,
    check_bitstream,
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
