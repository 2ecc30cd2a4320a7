"""Encoded checkpoints (issue 22 item 3; [Note: encoded checkpoint] in dlo.codec.offline):
blocks encoded once, written beside their checkpoint, read verified straight into the host
region by later enables; a stale or foreign file is ignored with a warning, a corrupted one
fails the enable, which rolls back. CPU platform (the reference codec)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
import dlo.backends.layer_codec as layer_codec
import dlo.backends.layer_codec_disk as layer_codec_disk
import dlo.io.checksums
from dlo.cli import main
from dlo.codec.offline import ENCODED_FILE, METADATA_KEY
from dlo.commands.run_flags import save_encoded_if_asked
from dlo.host.region import LEDGER
from dlo.io.writer import save_checkpoint
from dlo.models import build_pipeline, make_inputs
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.load import load_pipeline
from dlo.pipelines.synth import save_folder
from tests.harness import assert_all_ok, run_ranks

DTYPE = torch.bfloat16


def _factory(seed: int = 0) -> Any:
    return functools.partial(build_pipeline, "tiny", dtype=DTYPE, seed=seed, device="meta")


def _ref(seed: int = 0) -> torch.Tensor:
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)
    return build_pipeline("tiny", dtype=DTYPE, seed=seed).generate(ids, lat, 2)


def _cfg(**kw: Any) -> dlo.OffloadConfig:
    kw.setdefault("chunk_mb", 1)
    return dlo.OffloadConfig(mode="layer", components=("dit", "encoder"), codec="ans", **kw)


class _Counted:
    """Counts the blocks encoded at enable."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        real = layer_codec.encode_packed

        def encode_packed(*args: Any, **kw: Any) -> Any:
            self.names.append(args[2])
            return real(*args, **kw)

        monkeypatch.setattr(layer_codec, "encode_packed", encode_packed)
        monkeypatch.setattr(layer_codec_disk, "encode_packed", encode_packed)  # into the file


def _load(path: Path, seed: int = 0, **kw: Any) -> tuple[Any, Any, torch.Tensor]:
    pipe, backend = load_pipeline(_factory(seed), path, _cfg(**kw), None, "cpu")
    assert backend is not None
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)
    return pipe, backend, pipe.generate(ids, lat, 2)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return save_checkpoint(build_pipeline("tiny", dtype=DTYPE), tmp_path / "ckpt")


def _saved(ckpt: Path) -> tuple[Path, int]:
    """Load once (encoding at enable), save the encoded blocks; the file and block count."""
    _, backend, _ = _load(ckpt)
    (path,) = backend.save_encoded()
    n = len([b for b in backend._blocks if b.encoded is not None])
    backend.disable()
    return path, n


@pytest.mark.parametrize("piece", [None, 4096], ids=["4MiB-pieces", "4KiB-pieces"])
def test_an_encoded_checkpoint_is_read_instead_of_encoding(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, piece: int | None
) -> None:
    if piece is not None:  # small checksum pieces: each block read in many ranges, in parallel
        monkeypatch.setattr(dlo.io.checksums, "PIECE_NBYTES", piece)
    ref = _ref()
    counted = _Counted(monkeypatch)
    path, n = _saved(ckpt)
    assert path == ckpt.parent / ENCODED_FILE and n == len(counted.names) > 0
    counted.names.clear()
    pipe, backend, out = _load(ckpt)
    st = backend.stats()
    assert torch.equal(out, ref) and counted.names == []  # nothing encoded at enable
    assert st["encoded_read_blocks"] == n and st["codec_bitstream"] == "dlo-zlib-planes-v1"
    assert st["host_nbytes"] == st["host_encoded_nbytes"] < st["host_encoded_raw_nbytes"]
    sd = {k: v.clone() for k, v in pipe.state_dict().items()}
    backend.disable()
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)
    assert torch.equal(pipe.generate(ids, lat, 2), ref)  # restored by decoding the read copy
    assert all(torch.equal(v, pipe.state_dict()[k]) for k, v in sd.items())
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_a_stale_encoded_checkpoint_is_ignored_with_the_reason(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path, n = _saved(ckpt)
    counted = _Counted(monkeypatch)
    # the checkpoint rewritten with other weights: the old encoded blocks must not serve it
    save_checkpoint(build_pipeline("tiny", dtype=DTYPE, seed=5), ckpt.parent)
    with caplog.at_level(logging.WARNING, logger="dlo.codec.offline"):
        _, backend, out = _load(ckpt, seed=5)
    assert torch.equal(out, _ref(seed=5)) and len(counted.names) == n
    assert "the block's tensors in the checkpoint changed" in caplog.text
    backend.disable()
    assert path.exists()


def _rewrite_record(path: Path, edit: Any) -> None:
    """Edit the encoded file's ``dlo.encoded`` record in place (same header length)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    record = json.loads(header["__metadata__"][METADATA_KEY])
    edit(record)
    header["__metadata__"][METADATA_KEY] = json.dumps(record, separators=(",", ":"))
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(raw[:8] + new.ljust(n) + raw[8 + n :])


def test_another_bitstream_or_a_malformed_table_is_ignored(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, _ = _saved(ckpt)

    def bitstream(r: dict[str, Any]) -> None:
        r["bitstream"] = "nvcomp-ans-f2"

    def layout(r: dict[str, Any]) -> None:  # as if written for another chunk_mb or dtype
        for b in r["blocks"].values():
            b["layout"] = "0" * len(b["layout"])

    def table(r: dict[str, Any]) -> None:
        for b in r["blocks"].values():
            b["pieces"][0][2] = 1  # the first piece off its alignment (same header length)

    for edit, why in [
        (bitstream, "it holds bitstream 'nvcomp-ans-f2'"),
        (layout, "the block's layout is another"),
        (table, "malformed"),
    ]:
        _saved(ckpt)
        _rewrite_record(path, edit)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dlo.codec.offline"):
            _, backend, out = _load(ckpt)
        assert torch.equal(out, _ref()) and backend.stats()["encoded_read_blocks"] == 0
        assert why in caplog.text, caplog.text
        backend.disable()


def test_a_corrupted_encoded_byte_fails_the_enable_and_leaves_nothing(ckpt: Path) -> None:
    path, _ = _saved(ckpt)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x40  # in the last block's encoded bytes
    path.write_bytes(bytes(raw))
    with pytest.raises(dlo.CheckpointError, match="checksum"):
        _load(ckpt)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_save_encoded_needs_encoded_blocks_from_a_checkpoint(ckpt: Path) -> None:
    pipe = build_pipeline("tiny", dtype=DTYPE)
    backend = dlo.enable_offload(pipe, _cfg(), device="cpu")
    assert backend is not None
    with pytest.raises(ValueError, match="no encoded block of group size 1"):
        backend.save_encoded()  # type: ignore[attr-defined]
    backend.disable()
    with pytest.raises(ValueError, match="needs an enabled backend"):
        backend.save_encoded()  # type: ignore[attr-defined]


def test_save_encoded_dry_run_checks_without_writing(ckpt: Path) -> None:
    _, backend, _ = _load(ckpt)
    (target,) = backend.save_encoded(dry_run=True)
    assert target == ckpt.parent / ENCODED_FILE and not target.exists()
    backend.disable()
    # --save-encoded on a rank other than 0: the same refusal as rank 0's, and disabled
    pipe = build_pipeline("tiny", dtype=DTYPE)
    backend = dlo.enable_offload(pipe, _cfg(), device="cpu")
    args = argparse.Namespace(save_encoded=True)
    with pytest.raises(ValueError, match="no encoded block of group size 1"):
        save_encoded_if_asked(args, backend, rank0=False)
    assert not backend.is_enabled() and (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_copied_blocks_are_read_encoded_next_time(ckpt: Path) -> None:
    """Tensors read into private memory (``copy=True``) are not the file's bytes, but the
    file still names them: the encoded file describes them, and the next load reads them."""
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)

    def run() -> tuple[torch.Tensor, int, Any]:
        pipe, backend = load_pipeline(_factory(), ckpt, _cfg(), None, "cpu", copy=True)
        assert backend is not None
        return pipe.generate(ids, lat, 2), backend.stats()["encoded_read_blocks"], backend

    first, read, backend = run()
    assert read == 0
    (written,) = backend.save_encoded()  # type: ignore[attr-defined]
    assert written == ckpt.parent / ENCODED_FILE
    backend.disable()
    again, read, backend = run()
    backend.disable()
    assert read > 0 and torch.equal(first, again) and torch.equal(first, _ref())
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_copies_written_after_the_load_are_encoded_not_read(ckpt: Path) -> None:
    """A copy is named by the checkpoint only for the enable of its own load: weights
    written through ``.data`` afterwards (no version bump: a LoRA fused in place), or in
    ``prepare``, are encoded at enable, never served stale from the file. A copy with the
    stored dtype holds the file's bytes: its file serves a mapped load too."""
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)
    _, backend = load_pipeline(_factory(), ckpt, _cfg(), None, "cpu", copy=True)
    assert backend is not None
    backend.save_encoded()  # type: ignore[attr-defined]
    backend.disable()
    _, mapped, _ = _load(ckpt)  # not copied: the same bytes, the same sources
    assert mapped.stats()["encoded_read_blocks"] > 0
    mapped.disable()

    def scale(pipe: Any) -> None:
        pipe.transformer.blocks[1].mlp.fc1.weight.data.mul_(0.5)  # _version unchanged

    for how in ("after", "prepare"):
        ref = build_pipeline("tiny", dtype=DTYPE)
        scale(ref)
        want = ref.generate(ids, lat, 2)
        if how == "after":
            pipe, none = load_pipeline(_factory(), ckpt, None, None, "cpu", copy=True)
            assert none is None
            scale(pipe)
            backend = dlo.enable_offload(pipe, _cfg(), device="cpu")
        else:
            pipe, backend = load_pipeline(
                _factory(), ckpt, _cfg(), None, "cpu", copy=True, prepare=scale
            )
        assert backend is not None
        assert backend.stats()["encoded_read_blocks"] == 0, how
        assert torch.equal(pipe.generate(ids, lat, 2), want), how
        backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_blocks_cast_on_load_are_read_encoded_next_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A float32 folder loaded as bfloat16: the blocks are casts, named by their file and
    the dtype; the encoded file serves the next bfloat16 load, bitwise, and not a float32
    one (another layout: encoded at enable, the log says why)."""
    folder = tmp_path / "flux"
    save_folder(FOLDERS["tiny-flux"], folder, max_shard_size=40_000)
    cfg = dlo.OffloadConfig(mode="layer", codec="ans", chunk_mb=1)
    call: dict[str, Any] = {**FOLDERS["tiny-flux"].call, "output_type": "pt"}
    call.update(prompt="a red fox", num_inference_steps=2)

    def run(dtype: torch.dtype) -> tuple[torch.Tensor, int, Any]:
        pipe, backend = load_pipeline(folder, cfg, device="cpu", dtype=dtype)
        assert backend is not None
        pipe.set_progress_bar_config(disable=True)
        out = pipe(**call, generator=torch.Generator().manual_seed(3)).images
        return out, backend.stats()["encoded_read_blocks"], backend

    first, read, backend = run(torch.bfloat16)
    assert read == 0
    (written,) = backend.save_encoded()  # type: ignore[attr-defined]
    assert written == folder / "transformer" / ENCODED_FILE
    backend.disable()
    again, read, backend = run(torch.bfloat16)
    backend.disable()
    assert read > 0 and torch.equal(first, again)
    with caplog.at_level(logging.WARNING):
        _, read, backend = run(torch.float32)
    backend.disable()
    assert read == 0 and "layout is another" in caplog.text
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def _node_shared(rank: int, world: int, path: str, save: bool = False) -> dict[str, Any]:
    pipe, backend = load_pipeline(
        _factory(),
        path,
        _cfg(transfer="node-shared", collective_timeout_s=20.0),
        dlo.ParallelConfig(data_parallel_size=world),
        "cpu",
    )
    assert backend is not None
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)
    out = pipe.generate(ids, lat, 2)
    st = backend.stats()
    written = backend.save_encoded(dry_run=rank != 0) if save else []
    encoded = len([b for b in backend._blocks if b.encoded is not None])
    backend.disable()
    return {
        "out": out,
        "read": st["encoded_read_blocks"],
        "ledger": LEDGER.host_nbytes,
        "written": [str(p) for p in written],
        "encoded": encoded,
    }


def test_node_shared_sharers_read_their_blocks_from_the_encoded_checkpoint(
    ckpt: Path, tmp_path: Path
) -> None:
    _, n = _saved(ckpt)
    ref = _ref()
    res = assert_all_ok(
        run_ranks(_node_shared, 2, str(ckpt), timeout_s=120, env={"DLO_SHM_DIR": str(tmp_path)})
    )
    assert all(torch.equal(r["out"], ref) and r["ledger"] == 0 for r in res)
    assert sorted(r["read"] for r in res) == [n // 2, n - n // 2]  # each its 1/L


def test_a_node_shared_backend_saves_every_block_for_the_next_enable(
    ckpt: Path, tmp_path: Path
) -> None:
    """Each sharer encodes 1/L of the blocks; rank 0 writes all of them (it holds every
    encoded block's table and origin); the next enable reads them all, bitwise."""
    env = {"DLO_SHM_DIR": str(tmp_path)}
    first = assert_all_ok(run_ranks(_node_shared, 2, str(ckpt), True, timeout_s=120, env=env))
    path = ckpt.parent / ENCODED_FILE
    assert [r["written"] for r in first] == [[str(path)], [str(path)]] and path.exists()
    assert [r["read"] for r in first] == [0, 0]
    n = first[0]["encoded"]
    assert n > 0 and first[1]["encoded"] == n
    again = assert_all_ok(run_ranks(_node_shared, 2, str(ckpt), timeout_s=120, env=env))
    ref = _ref()
    assert all(torch.equal(r["out"], ref) and r["ledger"] == 0 for r in first + again)
    assert sum(r["read"] for r in again) == n


def test_run_save_encoded_writes_them_for_the_next_run(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--checkpoint", str(ckpt), "--codec", "ans", "--steps", "1"]
    assert main([*argv, "--save-encoded"]) == 0
    first = capsys.readouterr()
    assert f"encoded blocks written to {ckpt.parent / ENCODED_FILE}" in first.err
    assert "0 block(s) read encoded" in first.out
    assert main(argv) == 0
    m = re.search(r"(\d+) block\(s\) read encoded", capsys.readouterr().out)
    assert m is not None and int(m.group(1)) > 0
    assert main(["run", "--steps", "1", "--save-encoded"]) != 0  # no codec: refused
    assert "save_encoded needs an enabled backend with codec='ans'" in capsys.readouterr().err
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)  # disabled behind the error


def test_save_checkpoint_with_codec_and_run_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c"
    assert main(["save-checkpoint", "--out", str(out), "--codec", "ans"]) == 0
    printed = capsys.readouterr().out
    assert (out / ENCODED_FILE).exists() and "encoded" in printed, printed
    rc = main(
        ["run", "--checkpoint", str(out / "model.safetensors"), "--codec", "ans", "--steps", "1"]
    )
    assert rc == 0
    m = re.search(
        r"codec=ans \(ratio 0\.\d+, (\d+) block\(s\) read encoded\)", capsys.readouterr().out
    )
    assert m is not None and int(m.group(1)) >= len(build_pipeline("tiny").transformer.blocks)


def test_a_block_written_in_place_after_load_is_encoded_not_read(ckpt: Path) -> None:
    """A bf16 weight written in place after the load no longer aliases the file: it is
    hashed by its bytes (bf16 has no numpy), the file's entry no longer matches, and that
    block alone is encoded at enable."""
    _, n = _saved(ckpt)

    def touch(pipe: Any) -> None:
        w = pipe.transformer.blocks[0].attn.qkv.weight
        assert w.dtype == DTYPE
        with torch.no_grad():
            w.mul_(1)  # same values, a new version: not the file's bytes as far as dlo knows

    pipe, backend = load_pipeline(_factory(), ckpt, _cfg(), None, "cpu", prepare=touch)
    assert backend is not None
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)
    assert torch.equal(pipe.generate(ids, lat, 2), _ref())
    assert backend.stats()["encoded_read_blocks"] == n - 1
    backend.disable()
