"""Gathering a block's tensors from file ranges into staging buffers (host_backing="mapped").

The staging path must put into each chunk exactly the bytes the region path packs: tensors
at their layout offsets (alignment gaps and padding zero), whatever the buffer held before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dlo.host.mapped import MappedBlock
from dlo.host.packer import fill_ranges
from dlo.host.shards import chunk_copies, gap_ranges, pack_shard, range_copies, shard_copies
from dlo.io.checkpoint import Checkpoint
from dlo.plan.layout import ALIGN, describe_entries, plan_block_layout


def _tensors() -> list[tuple[str, str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", "param", torch.randn(37, generator=g)),  # 148 B: a gap of 108 B follows
        ("b", "param", torch.randn(5, 3, generator=g).t()),  # transposed: private only
        ("c", "param", torch.randn(1000, generator=g).to(torch.bfloat16)),
        ("d", "buffer", torch.arange(7, dtype=torch.int8)),
        ("e", "param", torch.randn(3, 333, generator=g)),
    ]


def _checkpoint(tmp_path: Path, tensors: list[tuple[str, str, torch.Tensor]]) -> Checkpoint:
    save_file({n: t.contiguous() for n, _, t in tensors}, str(tmp_path / "m.safetensors"))
    return Checkpoint(tmp_path / "m.safetensors")


def test_gap_ranges_are_the_complement_of_the_copies() -> None:
    copies = [(0, 0, 10, 5), (1, 0, 4, 20), (2, 3, 6, 24)]
    assert gap_ranges(copies, 40) == [(0, 5), (15, 20), (30, 40)]
    assert gap_ranges([], 8) == [(0, 8)]
    assert gap_ranges([(0, 0, 8, 0)], 8) == []


@pytest.mark.parametrize("chunk_nbytes", [ALIGN, 3 * ALIGN, 1000, 4096, 1 << 20])
def test_chunks_from_file_ranges_equal_the_packed_block(chunk_nbytes: int, tmp_path: Path) -> None:
    tensors = _tensors()
    ckpt = _checkpoint(tmp_path, tensors)
    layout = plan_block_layout(
        "blk",
        describe_entries(tensors),
        group_size=1,
        chunk_nbytes=chunk_nbytes,
    )
    assert layout.tensors[1].offset - layout.tensors[0].end > 0  # an alignment gap
    want = torch.zeros(layout.padded_nbytes, dtype=torch.uint8)
    pack_shard(want, layout, 0, [t for _, _, t in tensors])

    # contiguous tensors from the file, the transposed one from its private tensor
    sources = [t if not t.is_contiguous() else (ckpt, n) for n, _, t in tensors]
    block = MappedBlock("blk", layout, sources)
    assert block.private_nbytes == layout.tensors[1].span_nbytes
    assert block.mapped_nbytes == sum(s.span_nbytes for s in layout.tensors) - block.private_nbytes
    got = torch.empty(0, dtype=torch.uint8)
    buf = torch.full((layout.chunk_nbytes,), 0xAB, dtype=torch.uint8)  # a dirty, reused buffer
    for k in range(layout.num_chunks):
        block.fill_chunk(k, buf)
        got = torch.cat([got, buf])
    assert torch.equal(got, want)
    if layout.num_chunks > 1:  # a block larger than one staging buffer
        assert layout.padded_nbytes > layout.chunk_nbytes
    # each chunk's pieces are exactly the shard copies that fall in it
    pieces = [c for k in range(layout.num_chunks) for c in chunk_copies(layout, k)]
    assert sum(n for _, _, n, _ in pieces) == sum(n for _, _, n, _ in shard_copies(layout, 0))
    # served tensors and rebuilt tensors are the originals
    for i, (_, _, t) in enumerate(tensors):
        assert torch.equal(block.tensor(i), t) and torch.equal(block.rebuild(i), t)
    ckpt.close()


def test_fill_ranges_splits_large_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dlo.host.packer as staging

    monkeypatch.setattr(staging, "READ_PIECE_NBYTES", 100)
    t = torch.arange(1000, dtype=torch.float32)
    save_file({"t": t}, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint(tmp_path / "m.safetensors")
    layout = plan_block_layout(
        "b", describe_entries([("t", "param", t)]), group_size=1, chunk_nbytes=1 << 20
    )
    dst = torch.zeros(layout.padded_nbytes, dtype=torch.uint8)
    fill_ranges(dst, range_copies(layout, [(0, layout.padded_nbytes, 0)]), [(ckpt, "t")])
    assert torch.equal(dst[:4000].view(torch.float32), t)
    assert ckpt.read_nbytes == 4000
    ckpt.close()


def test_retained_checkpoint_closes_on_last_release(tmp_path: Path) -> None:
    t = torch.arange(10, dtype=torch.float32)
    save_file({"t": t}, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint(tmp_path / "m.safetensors")
    buf = torch.empty(40, dtype=torch.uint8)
    ckpt.retain()
    ckpt.read_into("t", 0, memoryview(buf.numpy()))
    ckpt.close()  # deferred: a reader still uses the file
    assert ckpt._fds
    ckpt.release()
    assert not ckpt._fds
