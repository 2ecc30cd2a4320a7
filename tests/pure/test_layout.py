"""Pure tests of block layouts, chunk/shard math and the manifest digest."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dlo.host.shards import pack_shard, shard_view, span_bytes, unpack_tensor
from dlo.plan.layout import (
    ALIGN,
    build_manifest,
    describe_module,
    extent_numel,
    is_overlapping,
    module_tensor_entries,
    plan_block_layout,
)


def _block() -> nn.Module:
    m = nn.Module()
    m.lin = nn.Linear(33, 17).to(torch.bfloat16)
    m.norm = nn.LayerNorm(17)  # fp32 inside a bf16 block
    m.register_buffer("rope", torch.arange(10, dtype=torch.float64), persistent=False)
    m.register_buffer("scale8", torch.tensor([3, 250], dtype=torch.uint8))
    m.t = nn.Parameter(torch.randn(7, 5).t())  # transposed: stride (1, 5)
    return m


def test_offsets_aligned_and_disjoint() -> None:
    lay = plan_block_layout("b", describe_module(_block()), group_size=1, chunk_nbytes=1 << 20)
    prev_end = 0
    for t in lay.tensors:
        assert t.offset % ALIGN == 0
        assert t.offset >= prev_end
        prev_end = t.end
    assert lay.nbytes == prev_end
    names = [t.name for t in lay.tensors]
    assert names == ["t", "lin.weight", "lin.bias", "norm.weight", "norm.bias", "rope", "scale8"]
    t = next(s for s in lay.tensors if s.name == "t")
    assert t.stride == (1, 5) and t.shape == (5, 7) and t.extent_numel == 35


def test_overlap_and_extent() -> None:
    assert extent_numel((5, 7), (1, 5)) == 35
    assert extent_numel((0, 7), (7, 1)) == 0
    assert extent_numel((4, 4), (8, 1)) == 28  # rows with gaps
    assert not is_overlapping((4, 4), (8, 1))
    assert is_overlapping((4, 4), (0, 1))
    assert is_overlapping((4, 4), (2, 1))
    assert not is_overlapping((1, 4), (0, 1))
    x = torch.zeros(3, 1).expand(3, 4)
    try:
        plan_block_layout(
            "b", [("x", "param", x.shape, x.stride(), x.dtype)], group_size=1, chunk_nbytes=1024
        )
    except ValueError as e:
        assert "overlapping" in str(e) and "b.x" in str(e)
    else:
        raise AssertionError("expected ValueError")


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=0, max_size=8),
    group=st.integers(1, 8),
    chunk=st.integers(1, 9000),
)
def test_chunks_cover_block_for_any_group(sizes: list[int], group: int, chunk: int) -> None:
    specs = [(f"t{i}", "param", (n,), (1,), torch.float16) for i, n in enumerate(sizes)]
    lay = plan_block_layout("b", specs, group_size=group, chunk_nbytes=chunk)
    if lay.nbytes == 0:
        assert lay.num_chunks == 0 and lay.shard_nbytes == 0
        return
    assert lay.padded_nbytes >= lay.nbytes
    assert lay.chunk_nbytes % (group * ALIGN) == 0
    # every byte of the padded block is owned by exactly one (rank, chunk) slice
    owned = sorted(r for rank in range(group) for r in lay.shard_ranges(rank))
    pos = 0
    for start, end, _ in owned:
        assert start == pos
        pos = end
    assert pos == lay.padded_nbytes
    # padding is bounded: less than one unit per chunk
    assert lay.padded_nbytes - lay.nbytes <= lay.num_chunks * group * ALIGN


def test_int64_offsets_past_2_31_elements() -> None:
    big = 3 * (1 << 31)  # elements: 6 GiB of int8 per tensor, computed, never allocated
    specs = [("a", "param", (big,), (1,), torch.int8), ("b", "param", (big,), (1,), torch.float32)]
    lay = plan_block_layout("b", specs, group_size=3, chunk_nbytes=64 << 20)
    a, b = lay.tensors
    assert a.offset == 0 and a.end == big
    assert b.offset == big  # big is a multiple of 256
    assert b.end == big + 4 * big
    assert lay.nbytes == 5 * big > 2**33
    assert lay.shard_nbytes * 3 == lay.padded_nbytes
    man = build_manifest([lay])
    assert man.total_nbytes == 5 * big


def test_digest_stable_and_sensitive() -> None:
    m = _block()
    lay = plan_block_layout("x", describe_module(m), group_size=2, chunk_nbytes=4096)
    d1 = build_manifest([lay]).digest
    d2 = build_manifest(
        [plan_block_layout("x", describe_module(_block()), group_size=2, chunk_nbytes=4096)]
    ).digest
    assert d1 == d2
    for variant in (
        plan_block_layout("y", describe_module(m), group_size=2, chunk_nbytes=4096),
        plan_block_layout("x", describe_module(m), group_size=3, chunk_nbytes=4096),
        plan_block_layout("x", describe_module(m), group_size=2, chunk_nbytes=2048),
    ):
        assert build_manifest([variant]).digest != d1
    m2 = _block()
    m2.lin.weight.data = m2.lin.weight.data.float()
    assert (
        build_manifest(
            [plan_block_layout("x", describe_module(m2), group_size=2, chunk_nbytes=4096)]
        ).digest
        != d1
    )
    two = [lay, plan_block_layout("z", describe_module(m), group_size=2, chunk_nbytes=4096)]
    assert build_manifest(two).digest != build_manifest(two[::-1]).digest


def test_meta_module_describes() -> None:
    with torch.device("meta"):
        m = _block()
    lay = plan_block_layout("b", describe_module(m), group_size=4, chunk_nbytes=1024)
    ref = plan_block_layout("b", describe_module(_block()), group_size=4, chunk_nbytes=1024)
    assert lay == ref


def _roundtrip(group: int, chunk: int) -> None:
    m = _block()
    entries = module_tensor_entries(m)
    tensors = [t for _, _, t in entries]
    lay = plan_block_layout("b", describe_module(m), group_size=group, chunk_nbytes=chunk)
    shards = []
    for rank in range(group):
        dst = torch.zeros(lay.shard_nbytes, dtype=torch.uint8)
        pack_shard(dst, lay, rank, tensors)
        shards.append(dst)
    # gather the way the transport does: chunk k = concat over ranks of slice k
    full = torch.zeros(lay.padded_nbytes, dtype=torch.uint8)
    for rank, dst in enumerate(shards):
        for start, end, off in lay.shard_ranges(rank):
            full[start:end] = dst[off : off + (end - start)]
    for spec, t in zip(lay.tensors, tensors):
        v = shard_view(full, spec)
        assert v.shape == t.shape and v.stride() == t.stride() and v.dtype == t.dtype
        assert torch.equal(v, t.detach())
        u = unpack_tensor(full, spec, torch.device("cpu"))
        assert u.stride() == t.stride() and torch.equal(u, t.detach())
        assert torch.equal(span_bytes(u), span_bytes(t))


def test_pack_and_rebuild_every_group_size() -> None:
    for group in (1, 2, 3, 4, 7):
        for chunk in (256, 1000, 1 << 20):
            _roundtrip(group, chunk)
