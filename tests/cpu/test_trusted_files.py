"""Files dlo reads only where it can trust them (issue 39 items 3, 4 and 7): an encoded
checkpoint another user could have written is ignored ([Note: own files] in dlo.io.files); a
checkpoint replaced in place with its size and modification time kept is not served from
the stale encoded file; an index naming files outside its folder is refused."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.cli import main
from dlo.codec.offline import ENCODED_FILE, METADATA_KEY
from dlo.host.region import LEDGER
from dlo.io.checkpoint import Checkpoint, CheckpointError
from dlo.io.writer import save_checkpoint
from dlo.models import build_pipeline
from dlo.pipelines.folder import read_index
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder
from tests.cpu.test_codec_offline import DTYPE, _load, _node_shared, _ref, _saved
from tests.harness import assert_all_ok, run_ranks
from tests.other_user import OTHER_UID, ROOT_ONLY, as_other_user, team_directory


# ----------------------------------------------------------------------------- item 3
def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _forge(genuine: Path, theirs: Path) -> bytes:
    """``theirs`` (another model's encoded blocks) under ``genuine``'s fingerprints, which
    anyone who can read the checkpoint can compute (sizes, times, inodes, header checksums):
    a valid encoded file for the victim's checkpoint with the forger's weights."""
    header, _ = _split(genuine)
    forged, data = _split(theirs)
    want = json.loads(header["__metadata__"][METADATA_KEY])["blocks"]
    record = json.loads(forged["__metadata__"][METADATA_KEY])
    for name, block in record["blocks"].items():
        block["sources"] = want[name]["sources"]
    forged["__metadata__"][METADATA_KEY] = json.dumps(record, separators=(",", ":"))
    raw = json.dumps(forged, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.fixture
def forged(tmp_path: Path) -> tuple[Path, bytes, int]:
    """The victim's checkpoint in a team folder, a forged encoded file for it, and the
    number of blocks the genuine one held."""
    team = team_directory(tmp_path / "team")
    ckpt = save_checkpoint(build_pipeline("tiny", dtype=DTYPE), team)
    genuine, n = _saved(ckpt)
    other = save_checkpoint(build_pipeline("tiny", dtype=DTYPE, seed=5), tmp_path / "other")
    theirs, _ = _saved(other)
    data = _forge(genuine, theirs)
    genuine.unlink()
    return ckpt, data, n


_WRITE_STDIN = """
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
with os.fdopen(fd, "wb") as f:
    f.write(sys.stdin.buffer.read())
"""


def _plant(folder: Path, data: bytes, how: str) -> Path:
    path = folder / ENCODED_FILE
    if how == "other-uid":  # another local user writes it into the team folder
        as_other_user(folder, _WRITE_STDIN, ENCODED_FILE, stdin=data)
        assert path.stat().st_uid == OTHER_UID
    else:
        path.write_bytes(data)
        path.chmod({"own-file": 0o644, "group-writable": 0o664, "world-writable": 0o666}[how])
    return path


def test_a_forged_encoded_file_of_the_users_own_is_served(
    forged: tuple[Path, bytes, int],
) -> None:
    """The trust boundary the refusals below rest on: the forged file is valid, and one the
    user owns (and no one else can write) is read, every block, and changes the output."""
    ckpt, data, n = forged
    _plant(ckpt.parent, data, "own-file")
    _, backend, out = _load(ckpt)
    assert backend.stats()["encoded_read_blocks"] == n
    assert not torch.equal(out, _ref())
    backend.disable()


_FOREIGN = {
    "group-writable": "mode 664 lets other users write it",
    "world-writable": "mode 666 lets other users write it",
    "other-uid": f"owner uid {OTHER_UID} against this process's 0",
}


@pytest.mark.parametrize(
    "how", ["group-writable", "world-writable", pytest.param("other-uid", marks=ROOT_ONLY)]
)
def test_an_encoded_file_another_user_could_write_is_ignored(
    forged: tuple[Path, bytes, int], how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Planted beside the checkpoint by another user, or open to others' writes: not read
    (before: every block read from it, the output another model's), the blocks encoded at
    enable, bitwise, and one warning naming the file, its owner or mode and the reason."""
    ckpt, data, _ = forged
    path = _plant(ckpt.parent, data, how)
    with caplog.at_level(logging.WARNING, logger="dlo.codec.offline"):
        _, backend, out = _load(ckpt)
    assert backend.stats()["encoded_read_blocks"] == 0
    assert torch.equal(out, _ref())
    backend.disable()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and _FOREIGN[how] in warnings[0], warnings[0]
    assert "encoded at enable" in warnings[0]
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    assert path.read_bytes() == data  # left alone


@pytest.mark.parametrize("world", [2, 3])
def test_node_shared_sharers_ignore_an_encoded_file_others_can_write(
    forged: tuple[Path, bytes, int], tmp_path: Path, world: int
) -> None:
    """Each sharer reads its 1/L of the blocks from the encoded file where it is trusted;
    a group-writable one is read by none of them, and the output is bitwise."""
    ckpt, data, _ = forged
    _plant(ckpt.parent, data, "group-writable")
    env = {"DLO_SHM_DIR": str(tmp_path)}
    res = assert_all_ok(run_ranks(_node_shared, world, str(ckpt), timeout_s=180, env=env))
    ref = _ref()
    assert all(r["read"] == 0 and torch.equal(r["out"], ref) and r["ledger"] == 0 for r in res)


# ----------------------------------------------------------------------------- item 4
def test_a_checkpoint_replaced_in_place_with_its_times_kept_is_not_served_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Other weights copied over the checkpoint with ``cp --preserve=timestamps`` from a
    file of the same size and time: same inode, size and modification time, and no dlo
    checksums to differ (a diffusers folder's files have none). The change time differs, so
    the encoded file is stale (before: its blocks were served, the old model's)."""
    ckpt = save_checkpoint(build_pipeline("tiny", dtype=DTYPE), tmp_path / "c", checksums=False)
    new = save_checkpoint(
        build_pipeline("tiny", dtype=DTYPE, seed=5), tmp_path / "new", checksums=False
    )
    _, n = _saved(ckpt)
    st = ckpt.stat()
    assert new.stat().st_size == st.st_size
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    subprocess.run(["cp", "--preserve=timestamps", str(new), str(ckpt)], check=True)
    after = ckpt.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )
    assert ckpt.read_bytes() == new.read_bytes()
    with caplog.at_level(logging.WARNING, logger="dlo.codec.offline"):
        _, backend, out = _load(ckpt, seed=5)
    assert backend.stats()["encoded_read_blocks"] == 0 < n
    assert torch.equal(out, _ref(seed=5))
    assert "the block's tensors in the checkpoint changed since it was written" in caplog.text
    backend.disable()


# ----------------------------------------------------------------------------- item 7
def _index(folder: Path, weight_map: dict[str, str]) -> Path:
    index = folder / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    return index


@pytest.mark.parametrize("how", ["absolute", "parent"])
def test_an_index_naming_files_outside_its_folder_is_refused(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As diffusers refuses it (before: the file outside was loaded)."""
    from safetensors.torch import save_file

    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"b": torch.ones(2)}, str(outside / "p.safetensors"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": torch.zeros(2)}, str(folder / "m.safetensors"))
    name = str(outside / "p.safetensors") if how == "absolute" else "../outside/p.safetensors"
    index = _index(folder, {"a": "m.safetensors", "b": name})
    with pytest.raises(CheckpointError, match="names files outside") as err:
        Checkpoint(index)
    assert str(index) in str(err.value) and repr(name) in str(err.value)


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("flux") / "tiny-flux"
    save_folder(FOLDERS["tiny-flux"], folder, max_shard_size=40_000)
    return folder


@pytest.mark.parametrize("how", ["absolute", "parent", "component"])
def test_a_pipeline_folder_naming_files_outside_it_is_refused(
    flux: Path, tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A component's shard named by an absolute path or with ``../`` (moved outside the
    folder), or a component named ``../x`` in ``model_index.json``: one ``CheckpointError``
    naming the file, before any memory is taken; ``dlo run --pipeline`` prints it as one
    line, exit 2 (before: the files outside were loaded)."""
    folder = tmp_path / "flux"
    shutil.copytree(flux, folder)
    outside = tmp_path / "outside"
    outside.mkdir()
    if how == "component":
        index = folder / "model_index.json"
        raw = json.loads(index.read_text())
        raw["../vae"] = raw.pop("vae")
        shutil.move(folder / "vae", outside / "vae")
        index.write_text(json.dumps(raw))
        with pytest.raises(CheckpointError, match="not a plain folder name"):
            read_index(folder)
        named = "'../vae'"
    else:
        index = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
        raw = json.loads(index.read_text())
        shard = sorted(set(raw["weight_map"].values()))[-1]
        shutil.move(folder / "transformer" / shard, outside / shard)
        name = str(outside / shard) if how == "absolute" else f"../../outside/{shard}"
        raw["weight_map"] = {k: name if v == shard else v for k, v in raw["weight_map"].items()}
        index.write_text(json.dumps(raw))
        named = "names files outside"
    with pytest.raises(CheckpointError) as err:
        dlo.load_pipeline(folder, dlo.OffloadConfig(mode="layer"), device="cpu")
    assert str(index) in str(err.value) and named in str(err.value), str(err.value)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    capsys.readouterr()
    assert main(["run", "--pipeline", str(folder), "--steps", "1", "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("dlo: error:") and named in lines[-1], lines[-3:]
