"""Content checksums (issue 26 item 5): written by ``save_checkpoint``, checked with
``verify_checksum`` while the host shards (and the copied weights) are read; a flipped data
byte is refused naming the file and the tensor, and nothing is left behind."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import dlo
from dlo.cli import main
from dlo.host.region import LEDGER
from dlo.io import checksums
from dlo.io.checkpoint import Checkpoint, CheckpointError, read_header
from dlo.io.writer import save_checkpoint
from dlo.models import build_pipeline, make_inputs
from dlo.pipelines.load import load_pipeline
from tests.cpu.test_loader import DTYPE, PRESET, _cfg, _skeleton
from tests.harness import assert_all_ok, run_ranks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("sums")
    return str(
        save_checkpoint(build_pipeline(PRESET, dtype=DTYPE), root, max_shard_nbytes=12 << 20).parent
    )


def _holding(**tensors: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in tensors.items():
        m.register_buffer(k, v)
    return m


def _flipped(src: str, dst: Path, tensor: str, at: int) -> Path:
    """A copy of checkpoint folder ``src`` with one bit of ``tensor``'s byte ``at`` flipped."""
    dst.mkdir()
    for f in Path(src).iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    e = Checkpoint(str(dst)).entries[tensor]
    raw = bytearray(e.file.read_bytes())
    raw[e.start + at] ^= 0x10
    e.file.write_bytes(bytes(raw))
    return dst


def test_every_tensor_is_written_with_its_checksums_and_read_back_verified(ckpt: str) -> None:
    ck = Checkpoint(ckpt, verify_checksum=True)
    sd = build_pipeline(PRESET, dtype=DTYPE).state_dict()
    for name, e in ck.entries.items():
        assert e.checksums is not None
        piece, sums = e.checksums
        assert piece == checksums.PIECE_NBYTES and len(sums) == -(-e.nbytes // piece)
        out = torch.empty(e.shape, dtype=e.dtype)
        if e.nbytes:
            ck.read_into(name, 0, memoryview(out.reshape(-1).view(torch.uint8).numpy()))
        assert torch.equal(out, sd[name]), name
    ck.close()


def test_reads_of_any_range_give_the_bytes_and_catch_a_flip_inside_them(tmp_path: Path) -> None:
    """Ranges that start and end inside pieces (an AllGather rank's slices): the bytes are
    right, and a flip anywhere in a touched piece is caught, even outside the range."""
    torch.manual_seed(0)
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    old = checksums.PIECE_NBYTES
    checksums.PIECE_NBYTES = 1000  # the writer reads the module's value
    try:
        path = save_checkpoint(_holding(w=data), tmp_path / "a")
    finally:
        checksums.PIECE_NBYTES = old
    rng = random.Random(0)
    ck = Checkpoint(path, verify_checksum=True)
    for _ in range(50):
        lo = rng.randrange(0, 10_000)
        hi = rng.randrange(lo, 10_001)
        buf = bytearray(hi - lo)
        ck.read_into("w", lo, memoryview(buf))
        assert bytes(buf) == data.numpy().tobytes()[lo:hi]
    e = ck.entries["w"]
    raw = bytearray(e.file.read_bytes())
    raw[e.start + 2999] ^= 1  # the last byte of piece 2
    e.file.write_bytes(bytes(raw))
    fresh = Checkpoint(path, verify_checksum=True)
    with pytest.raises(CheckpointError, match=r"tensor 'w': bytes 2000\.\.3000 do not match"):
        fresh.read_into("w", 2100, memoryview(bytearray(10)))  # touches piece 2 only in part
    fresh.read_into("w", 3000, memoryview(bytearray(500)))  # other pieces are fine
    Checkpoint(path).read_into("w", 2100, memoryview(bytearray(10)))  # unchecked: no error


@pytest.mark.parametrize(
    "tensor",
    [
        "transformer.blocks.1.mlp.fc1.weight",  # packed into the host shards
        "transformer.proj_out.weight",  # read behind the enable (dlo.io.reads.PendingReads)
    ],
)
@pytest.mark.parametrize("world", [1, 2])
def test_a_flipped_data_byte_is_refused_and_nothing_is_left(
    world: int, tensor: str, ckpt: str, tmp_path: Path
) -> None:
    # a byte near the end of the tensor
    e = Checkpoint(ckpt).entries[tensor]
    bad = _flipped(ckpt, tmp_path / "bad", e.name, e.nbytes - 3)
    res = assert_all_ok(run_ranks(_load_refused, world, str(bad), timeout_s=120))
    # the ranks whose reads touch the corrupted piece name it; any other rank hears of it
    # in the startup agreement
    named = f"CheckpointError: {tensor}"
    assert named in res, res
    assert all(r == named or "do not match the checksum" in r for r in res), res
    # without the check the same file loads, and its wrong weight is used
    ok = assert_all_ok(run_ranks(_load_unchecked, 1, str(bad), ckpt, timeout_s=120))
    assert ok == [False]


def _load_refused(rank: int, world: int, path: str) -> str:
    par = dlo.ParallelConfig(data_parallel_size=world)
    with torch.device("meta"):
        skeleton = _skeleton()
    before = [(n, id(t)) for n, t in skeleton.state_dict(keep_vars=True).items()]
    try:
        load_pipeline(skeleton, path, _cfg(world), par, "cpu", verify_checksum=True)
    except (CheckpointError, dlo.OffloadError, ValueError) as err:
        after = [(n, id(t)) for n, t in skeleton.state_dict(keep_vars=True).items()]
        assert after == before and all(t.is_meta for t in skeleton.state_dict().values())
        assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
        cause: BaseException = err
        while cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, CheckpointError):
            assert "do not match the checksum written with them" in str(cause), str(cause)
            name = str(cause).split("tensor '")[1].split("'")[0]
            return f"CheckpointError: {name}"
        return f"{type(err).__name__}: {err}"
    return "loaded"


def _load_unchecked(rank: int, world: int, bad: str, good: str) -> bool:
    ids, latents = make_inputs(PRESET, tokens=None, seed=0, device="cpu", dtype=DTYPE)
    outs = []
    for path in (bad, good):
        pipe, backend = load_pipeline(_skeleton, path, _cfg(1), None, "cpu")
        outs.append(pipe.generate(ids, latents, 1))
        assert backend is not None
        backend.disable()
    return bool(torch.equal(*outs))


def test_a_file_without_checksums_is_refused_only_when_asked(tmp_path: Path) -> None:
    save_file({"w": torch.ones(4)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"m\.safetensors has no dlo checksums"):
        Checkpoint(str(tmp_path), verify_checksum=True)
    Checkpoint(str(tmp_path)).close()
    with pytest.raises(ValueError, match="verify_checksum=True with a Checkpoint opened"):
        load_pipeline(
            _skeleton, Checkpoint(str(tmp_path)), _cfg(1), None, "cpu", verify_checksum=True
        )


def _rewrite_metadata(path: Path, edit: Any) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    value = json.loads(header["__metadata__"][checksums.METADATA_KEY])
    header["__metadata__"][checksums.METADATA_KEY] = json.dumps(edit(value))
    new = json.dumps(header).encode()
    new += b" " * (-(len(new)) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda v: {**v, "algorithm": "md5"}, "algorithm 'md5'"),
        (lambda v: {**v, "piece_nbytes": 2.5}, "piece_nbytes 2.5"),
        (
            lambda v: {**v, "tensors": {"w": v["tensors"]["w"][:-1]}},
            "no valid checksums for tensor 'w'",
        ),
        (lambda v: {**v, "tensors": {**v["tensors"], "x": ["0" * 64]}}, "does not hold: x"),
        (lambda v: "not an object", "malformed"),
    ],
)
def test_malformed_checksums_are_refused_naming_the_file(
    tmp_path: Path, edit: Any, needle: str
) -> None:
    path = save_checkpoint(_holding(w=torch.ones(3, 5)), tmp_path)
    _rewrite_metadata(path, edit)
    with pytest.raises(CheckpointError, match=r"model\.safetensors") as err:
        read_header(path)
    assert needle in str(err.value)


def test_dlo_run_verify_checksum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--preset", "tiny", "--device", "cpu", "--steps", "1", "--json"]
    good = tmp_path / "tiny"
    assert main(["save-checkpoint", "--preset", "tiny", "--out", str(good)]) == 0
    capsys.readouterr()
    assert main([*argv, "--checkpoint", str(good), "--verify-checksum"]) == 0
    name = next(n for n in Checkpoint(str(good)).entries if ".blocks.0." in n)
    bad = _flipped(str(good), tmp_path / "bad", name, 0)
    capsys.readouterr()
    assert main([*argv, "--checkpoint", str(bad), "--verify-checksum"]) == 2
    err = capsys.readouterr().err
    assert f"tensor {name!r}: bytes 0.." in err and "do not match the checksum" in err, err
    assert main([*argv, "--verify-checksum"]) == 2
    assert "--verify-checksum checks what is read from --checkpoint" in capsys.readouterr().err
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
