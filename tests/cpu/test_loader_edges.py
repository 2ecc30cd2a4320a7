"""Checkpoint loading edges: a re-enabled model packs its current weights, data not aligned
to its dtype in the file is still read slice by slice, a failed fill leaves no read running,
and index files with odd values are refused or served."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import dlo
from dlo.host.packer import fill_ranges
from dlo.host.region import LEDGER
from dlo.io.checkpoint import Checkpoint, CheckpointError
from dlo.io.sources import mapped_source
from dlo.io.writer import save_checkpoint
from dlo.pipelines.load import load_pipeline
from tests.harness import assert_all_ok, run_ranks

DIM = 64


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class _DiT(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _model(seed: int = 0) -> _DiT:
    torch.manual_seed(seed)
    return _DiT()


def _x() -> torch.Tensor:
    return torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(5))


def _cfg(**kw: Any) -> dlo.OffloadConfig:
    kw.setdefault("transfer", "rank-local")
    return dlo.OffloadConfig(mode="layer", chunk_mb=1, collective_timeout_s=20.0, **kw)


def _unaligned_copy(src: str | Path, dst: Path) -> Path:
    """The same safetensors file with a header of odd length: every tensor's data starts at
    an odd offset (older or third-party writers), so no tensor can alias the mapping."""
    raw = Path(src).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.dumps(json.loads(raw[8 : 8 + n]), separators=(",", ":")).encode()
    if len(header) % 2 == 0:
        header += b" "
    dst.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_checkpoint(_model(), tmp_path_factory.mktemp("ckpt")))


def test_reenable_packs_the_models_weights_not_the_files(ckpt: str) -> None:
    x = _x()
    # weights loaded in place between disable and enable (a LoRA fuse, load_state_dict)
    pipe, backend = load_pipeline(_model, ckpt, _cfg(), None, "cpu")
    assert backend is not None
    backend.disable()
    assert mapped_source(pipe.blocks[0].lin.weight) is None  # private memory again
    pipe.load_state_dict(_model(seed=1).state_dict())
    with torch.no_grad():
        expect = _model(seed=1)(x)
        backend.enable(pipe)
        assert torch.equal(pipe(x), expect)
    backend.disable()
    # a dtype change between disable and enable
    pipe, backend = load_pipeline(_model, ckpt, _cfg(), None, "cpu")
    assert backend is not None
    backend.disable()
    pipe.to(torch.float64)
    with torch.no_grad():
        expect = _model().to(torch.float64)(x.double())
        backend.enable(pipe)
        assert torch.equal(pipe(x.double()), expect)
    backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_a_tensor_written_in_place_is_not_served_from_the_file(ckpt: str) -> None:
    from dlo.io.sources import register_mapping, unregister_mapping

    t = Checkpoint(ckpt).tensor("blocks.0.lin.weight")
    register_mapping(t, Checkpoint(ckpt), "blocks.0.lin.weight")
    try:
        assert mapped_source(t) is not None
        with torch.no_grad():
            t.add_(1.0)  # a private page now; the file still has the old bytes
        assert mapped_source(t) is None
    finally:
        unregister_mapping(t)


def test_reenable_with_mapped_backing_after_disable_is_a_clear_error(ckpt: str) -> None:
    pipe, backend = load_pipeline(_model, ckpt, _cfg(host_backing="mapped"), None, "cpu")
    assert backend is not None
    backend.disable()
    with pytest.raises(ValueError, match=r"host_backing='mapped'.*no tensor of the streamed"):
        backend.enable(pipe)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def _read_per_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    ck = Checkpoint(path)
    cfg = _cfg(transfer="allgather")
    pipe, backend = load_pipeline(_model, ck, cfg, dlo.ParallelConfig(data_parallel_size=world))
    with torch.no_grad():
        same = torch.equal(pipe(_x()), _model()(_x()))
    assert backend is not None
    backend.disable()
    return {"read": ck.read_nbytes, "same": same}


def test_unaligned_checkpoint_is_read_slice_by_slice(ckpt: str, tmp_path: Path) -> None:
    # every rank reads its slices of the streamed blocks and the non-block weights: the same
    # bytes as from an aligned file, never a whole private copy of every block
    unaligned = _unaligned_copy(ckpt, tmp_path / "unaligned.safetensors")
    assert not Checkpoint(unaligned).is_aligned("blocks.0.lin.weight")
    aligned = assert_all_ok(run_ranks(_read_per_rank, 2, ckpt, timeout_s=120))
    odd = assert_all_ok(run_ranks(_read_per_rank, 2, str(unaligned), timeout_s=120))
    assert all(r["same"] for r in aligned + odd)
    assert [r["read"] for r in odd] == [r["read"] for r in aligned]


def test_prepare_reads_real_weights_from_an_unaligned_checkpoint(ckpt: str, tmp_path: Path) -> None:
    """``prepare`` may read and change the blocks' weights (quantizing them, say): a block
    tensor the file cannot alias is read for it, never left uninitialized."""
    unaligned = _unaligned_copy(ckpt, tmp_path / "unaligned.safetensors")
    seen: list[torch.Tensor] = []

    def prepare(pipe: Any) -> None:
        seen.append(pipe.blocks[1].lin.weight.detach().clone())
        with torch.no_grad():
            pipe.blocks[1].lin.weight.mul_(2)

    pipe, backend = load_pipeline(_model, unaligned, _cfg(), None, "cpu", prepare=prepare)
    assert backend is not None
    ref = _model()
    assert torch.equal(seen[0], ref.blocks[1].lin.weight)
    with torch.no_grad():
        ref.blocks[1].lin.weight.mul_(2)
        assert torch.equal(pipe(_x()), ref(_x()))
    backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_unaligned_checkpoint_serves_the_mapped_backing(ckpt: str, tmp_path: Path) -> None:
    unaligned = _unaligned_copy(ckpt, tmp_path / "unaligned.safetensors")
    pipe, backend = load_pipeline(_model, unaligned, _cfg(host_backing="mapped"), None, "cpu")
    assert backend is not None
    with torch.no_grad():
        assert torch.equal(pipe(_x()), _model()(_x()))
    backend.disable()
    with torch.no_grad():
        assert torch.equal(pipe(_x()), _model()(_x()))


class _SlowFile:
    """A checkpoint source whose first read fails at once and whose others take a while."""

    def __init__(self) -> None:
        self.running = 0
        self.lock = threading.Lock()

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if offset == 0:
            raise OSError("EIO")
        with self.lock:
            self.running += 1
        time.sleep(0.05)
        out[:] = b"\x01" * len(out)
        with self.lock:
            self.running -= 1


def test_a_failed_fill_returns_only_when_none_of_its_reads_is_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from dlo.host import packer as staging

    monkeypatch.setattr(staging, "READ_PIECE_NBYTES", 16)
    src = _SlowFile()
    dst = torch.zeros(256, dtype=torch.uint8)
    with ThreadPoolExecutor(max_workers=4) as pool:
        with pytest.raises(OSError, match="EIO"):
            fill_ranges(dst, [(0, 0, 256, 0)], [(src, "w")], pool=pool)  # type: ignore[list-item]
        # the staging buffer may be reused now: nothing of that fill writes into it later
        assert src.running == 0
        before = dst.clone()
        time.sleep(0.2)
        assert torch.equal(dst, before)


def _index(folder: Path, weight_map: dict[str, Any]) -> Path:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    return index


def test_index_with_a_missing_file_name_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2), "b": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    index = _index(tmp_path, {"a": "m.safetensors", "b": None})
    with pytest.raises(CheckpointError, match=r"file name for every tensor.*'b' \(None\)"):
        Checkpoint(index)


def test_index_listing_files_in_a_subfolder_is_served(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "sub").mkdir()
    save_file({"a": torch.zeros(2)}, str(tmp_path / "m.safetensors"))
    save_file({"c": torch.full((3,), 2.0)}, str(tmp_path / "sub" / "p.safetensors"))
    ck = Checkpoint(_index(tmp_path, {"a": "m.safetensors", "c": "sub/p.safetensors"}))
    assert sorted(ck.entries) == ["a", "c"]
    assert torch.equal(ck.tensor("c"), torch.full((3,), 2.0))


class _TaggedParameter(nn.Parameter):
    pass


def test_a_meta_skeletons_parameter_class_and_attributes_are_kept(ckpt: str) -> None:
    def skeleton() -> _DiT:
        m = _model()
        m.head.weight = _TaggedParameter(m.head.weight.data)
        m.embed.weight.no_weight_decay = True  # type: ignore[attr-defined]
        return m

    pipe, backend = load_pipeline(skeleton, ckpt, None, None, "cpu")
    assert backend is None
    assert type(pipe.head.weight) is _TaggedParameter
    assert getattr(pipe.embed.weight, "no_weight_decay", False) is True
    assert torch.equal(pipe.head.weight, _model().head.weight)


@pytest.mark.parametrize("stage_nbytes", [7, 64, 1 << 20])
def test_a_staged_read_gives_the_stored_bytes_cast_and_strided(
    tmp_path: Path, stage_nbytes: int
) -> None:
    """The staged device read (its CPU twin: same code, a host stage): pieces smaller than,
    not dividing, and larger than the tensor; the skeleton's dtype and strides applied."""
    from dlo.io.reads import read_copy

    g = torch.Generator().manual_seed(0)
    stored = {
        "w": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file(stored, str(path))
    ck = Checkpoint(str(path))
    stage = torch.empty(stage_nbytes, dtype=torch.uint8)
    try:
        for name, ref in stored.items():
            same = read_copy(ck, (name, torch.empty_like(ref), "cpu"), stage)
            assert same.dtype == ref.dtype and torch.equal(same, ref)
            cast = read_copy(ck, (name, torch.empty(ref.shape, dtype=torch.float32), "cpu"), stage)
            assert cast.dtype == torch.float32 and torch.equal(cast, ref.float())
        strided = torch.empty(17, 33, dtype=torch.float32).t()  # column-major in the model
        got = read_copy(ck, ("w", strided, "cpu"), stage)
        assert got.stride() == strided.stride() and torch.equal(got, stored["w"].float())
    finally:
        ck.close()
