"""Files dlo writes (issue 39 items 2, 5 and 6; [Note: writing files] in dlo.io.files):
through a private temporary file, never a planted link; two writers at once each write a
whole file; a read-only directory, ``ulimit -f``, a full disk or a Ctrl-C is one clear error
that leaves nothing partial and keeps the run's report; a directory checkpoint with its
encoded file beside it still serves every run."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo.io.writer as writer
from dlo.cli import main
from dlo.codec.offline import ENCODED_FILE
from dlo.host.region import LEDGER
from dlo.io.checkpoint import Checkpoint, CheckpointError
from dlo.io.files import CheckpointWriteError
from dlo.io.writer import save_checkpoint, write_file
from dlo.models import build_pipeline
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.load import load_pipeline
from dlo.pipelines.synth import save_folder
from tests.cpu.test_codec_offline import DTYPE, _cfg, _factory, _load, _ref
from tests.harness import assert_all_ok, run_ranks
from tests.other_user import IS_ROOT, ROOT_ONLY, as_other_user, team_directory

ROOT = Path(__file__).resolve().parents[2]
PRECIOUS = b"the victim's own file\n" * 64
SHARD_NBYTES = 300_000
"""Three shards of the tiny pipeline (837 kB)."""


def _listing(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def _same_tensors(path: Path, module: torch.nn.Module) -> bool:
    ck = Checkpoint(path)
    sd = module.state_dict()
    return sorted(ck.entries) == sorted(sd) and all(
        torch.equal(ck.tensor(k), v) for k, v in sd.items()
    )


def _fail_mid_write(
    monkeypatch: pytest.MonkeyPatch,
    exc: BaseException,
    at: int = 2,
    when: Callable[[], bool] = lambda: True,
) -> None:
    """Make the writer raise ``exc`` while writing tensor data: at the ``at``-th tensor it
    serializes a second time (the first pass over a file's tensors hashes them, the second
    writes them), counting only while ``when()`` holds."""
    real, seen, repeats = writer.bytes_of, set(), [0]

    def failing(t: torch.Tensor) -> Any:
        if when():
            key = (t.data_ptr(), t.numel())
            if key in seen:
                repeats[0] += 1
                if repeats[0] == at:
                    raise exc
            seen.add(key)
        return real(t)

    monkeypatch.setattr(writer, "bytes_of", failing)


# ----------------------------------------------------------------------------- item 2
def _plant(team: Path, names: list[str], victim: Path, planter: str) -> None:
    if planter == "other-uid":
        as_other_user(
            team, "for n in sys.argv[2:]:\n    os.symlink(sys.argv[1], n)", str(victim), *names
        )
    else:
        for n in names:
            (team / n).symlink_to(victim)


@pytest.mark.parametrize("planter", ["same-user", pytest.param("other-uid", marks=ROOT_ONLY)])
def test_links_planted_at_the_writers_names_are_never_followed(
    tmp_path: Path, planter: str
) -> None:
    """Another user who can write the model folder plants links at the names the writer
    used (``<file>.tmp``, and the index, written in place before): the victim's file is
    untouched, the links stay where they were, and the checkpoint and its encoded file are
    whole (before: the victim's file was overwritten through the link)."""
    victim = tmp_path / "victim"
    victim.write_bytes(PRECIOUS)
    pipe = build_pipeline("tiny", dtype=DTYPE)
    probe = save_checkpoint(pipe, tmp_path / "probe", max_shard_nbytes=SHARD_NBYTES)
    shards = sorted(set(json.loads(probe.read_text())["weight_map"].values()))
    assert len(shards) == 3

    one = team_directory(tmp_path / "one")
    links = ["model.safetensors.tmp", f"{ENCODED_FILE}.tmp"]
    _plant(one, links, victim, planter)
    path = save_checkpoint(pipe, one)
    _, backend, out = _load(path)
    (encoded,) = backend.save_encoded()
    backend.disable()

    sharded = team_directory(tmp_path / "sharded")
    index_name = "model.safetensors.index.json"
    _plant(sharded, [f"{s}.tmp" for s in shards] + [index_name], victim, planter)
    index = save_checkpoint(pipe, sharded, max_shard_nbytes=SHARD_NBYTES)

    assert victim.read_bytes() == PRECIOUS
    assert all(os.readlink(one / n) == str(victim) for n in links)
    assert _listing(one) == sorted([*links, "model.safetensors", ENCODED_FILE])
    assert _listing(sharded) == sorted([index_name, *shards, *(f"{s}.tmp" for s in shards)])
    assert not index.is_symlink() and not encoded.is_symlink()  # the link replaced, not followed
    assert _same_tensors(path, pipe) and _same_tensors(index, pipe)
    _, again, out2 = _load(path)
    assert again.stats()["encoded_read_blocks"] > 0 and torch.equal(out, out2)
    again.disable()
    assert torch.equal(out, _ref())


# ----------------------------------------------------------------------------- item 5
def test_a_directory_checkpoint_with_its_encoded_file_serves_every_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The documented encode-once flow on a directory: the scan for weight files skips
    dlo's encoded file (before, it was taken for a shard and every run failed with "cannot
    serve DemoPipeline: not in the model")."""
    out = tmp_path / "c"
    assert main(["save-checkpoint", "--out", str(out), "--codec", "ans"]) == 0
    assert _listing(out) == [ENCODED_FILE, "model.safetensors"]
    assert Checkpoint(out).files == [out / "model.safetensors"]
    capsys.readouterr()
    for codec in ("none", "ans"):
        argv = ["run", "--checkpoint", str(out), "--steps", "1", "--check", "--codec", codec]
        assert main(argv) == 0, capsys.readouterr().err  # --check: bitwise with resident
    m = re.search(r"(\d+) block\(s\) read encoded", capsys.readouterr().out)
    assert m is not None and int(m.group(1)) > 0
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(out / ENCODED_FILE, only)
    with pytest.raises(CheckpointError, match=r"holds no \.safetensors weights file"):
        Checkpoint(only)


# ----------------------------------------------------------------------------- item 6
def test_two_writers_of_one_file_each_write_a_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second writer starts and finishes while the first is half way: both succeed and
    the file is the last one renamed, whole (before: they shared ``<file>.tmp``; the first
    got a raw FileNotFoundError and the file held both writers' bytes)."""
    path = tmp_path / "m.safetensors"
    first = [("w", torch.full((4096,), 1.0)), ("v", torch.full((4096,), 3.0))]
    second = [("w", torch.full((4096,), 2.0)), ("v", torch.full((4096,), 4.0))]
    real, paused, second_done = writer.bytes_of, threading.Event(), threading.Event()

    def pausing(t: torch.Tensor) -> Any:
        if threading.current_thread().name == "first" and not paused.is_set():
            paused.set()  # the first writer's temporary file holds its header
            assert second_done.wait(30)
        return real(t)

    monkeypatch.setattr(writer, "bytes_of", pausing)
    errors: list[BaseException] = []

    def run(tensors: list[tuple[str, torch.Tensor]]) -> None:
        try:
            write_file(path, tensors, checksums=False)
        except BaseException as e:
            errors.append(e)
        finally:
            if threading.current_thread().name == "second":
                second_done.set()

    a = threading.Thread(target=run, args=(first,), name="first")
    a.start()
    assert paused.wait(30)
    b = threading.Thread(target=run, args=(second,), name="second")
    b.start()
    b.join(30)
    a.join(30)
    assert errors == []
    ck = Checkpoint(path)
    assert all(torch.equal(ck.tensor(n), t) for n, t in first)  # the first renamed last
    assert _listing(tmp_path) == ["m.safetensors"]


def _save_at_once(rank: int, world: int, path: str) -> int:
    import torch.distributed as dist

    _, backend = load_pipeline(_factory(), path, _cfg(), None, "cpu")
    assert backend is not None
    dist.barrier()
    backend.save_encoded()  # type: ignore[attr-defined]  # every rank writes: many writers
    n = len([b for b in backend._blocks if b.encoded is not None])  # type: ignore[attr-defined]
    backend.disable()
    return n


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_saving_the_encoded_file_at_once_leaves_one_whole_file(
    tmp_path: Path, world: int
) -> None:
    ckpt = save_checkpoint(build_pipeline("tiny", dtype=DTYPE), tmp_path / "ckpt")
    counts = assert_all_ok(run_ranks(_save_at_once, world, str(ckpt), timeout_s=120))
    assert _listing(ckpt.parent) == [ENCODED_FILE, "model.safetensors"]
    _, backend, out = _load(ckpt)
    assert backend.stats()["encoded_read_blocks"] == counts[0] > 0
    assert torch.equal(out, _ref())
    backend.disable()


def test_a_full_disk_while_saving_encoded_keeps_the_runs_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dlo run --save-encoded`` on a full disk: the run goes on, prints its report, then
    one ``dlo: error:`` line naming the file and the reason, exit 2; no partial file, and
    the next save and run work (before: a raw traceback, no report, the ``.tmp`` left)."""
    ckpt = save_checkpoint(build_pipeline("tiny", dtype=DTYPE), tmp_path / "ckpt")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    _fail_mid_write(monkeypatch, full)
    argv = ["run", "--checkpoint", str(ckpt), "--codec", "ans", "--steps", "1"]
    assert main([*argv, "--save-encoded"]) == 2
    out, err = capsys.readouterr()
    assert "dlo run: preset=tiny" in out and "codec=ans" in out  # the report
    errors = [line for line in err.splitlines() if line.startswith("dlo: error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert f"cannot write {ckpt.parent / ENCODED_FILE}: No space left on device" in errors[0]
    assert _listing(ckpt.parent) == ["model.safetensors"]
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    monkeypatch.undo()
    assert main([*argv, "--save-encoded"]) == 0
    capsys.readouterr()
    assert main(argv) == 0
    m = re.search(r"(\d+) block\(s\) read encoded", capsys.readouterr().out)
    assert m is not None and int(m.group(1)) > 0


def test_a_full_disk_while_a_pipeline_run_saves_encoded_keeps_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same for ``dlo run --pipeline DIR --save-encoded`` (a diffusers folder: one
    encoded file per component folder)."""
    folder = tmp_path / "flux"
    save_folder(FOLDERS["tiny-flux"], folder, max_shard_size=40_000)
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    _fail_mid_write(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    argv = ["run", "--pipeline", str(folder), "--codec", "ans", "--steps", "1", "--device", "cpu"]
    capsys.readouterr()
    assert main([*argv, "--save-encoded"]) == 2
    out, err = capsys.readouterr()
    assert f"dlo run: pipeline={folder}" in out  # the report
    errors = [line for line in err.splitlines() if line.startswith("dlo: error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert re.search(rf"cannot write {folder}/\w+/{ENCODED_FILE}: No space left", errors[0])
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
    monkeypatch.undo()
    assert main([*argv, "--save-encoded"]) == 0
    assert (folder / "transformer" / ENCODED_FILE).is_file()


def test_ctrl_c_while_saving_leaves_no_file_and_the_next_save_is_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyboardInterrupt inside the write of ``save-checkpoint``, of its encoded file,
    and of a sharded save over an older checkpoint: nothing new and nothing temporary is
    left, the older checkpoint is as it was (not new shards beside old ones), and the next
    save writes only its files (before: ``<file>.tmp`` left, up to the model's size)."""
    out = tmp_path / "c"
    _fail_mid_write(monkeypatch, KeyboardInterrupt())
    assert main(["save-checkpoint", "--out", str(out)]) == 130  # one line, no traceback
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dlo: interrupted"
    assert _listing(out) == []
    monkeypatch.undo()
    written = (out / "model.safetensors").exists  # then the encoded file is written
    _fail_mid_write(monkeypatch, KeyboardInterrupt(), when=written)
    assert main(["save-checkpoint", "--out", str(out), "--codec", "ans"]) == 130
    assert _listing(out) == ["model.safetensors"]
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    monkeypatch.undo()
    assert main(["save-checkpoint", "--out", str(out), "--codec", "ans"]) == 0
    assert _listing(out) == [ENCODED_FILE, "model.safetensors"]

    old = build_pipeline("tiny", dtype=DTYPE)
    index = save_checkpoint(old, tmp_path / "s", max_shard_nbytes=SHARD_NBYTES)
    before = {f: f.read_bytes() for f in index.parent.iterdir()}
    first_shard = len(Checkpoint(index.parent / sorted(before)[0].name).entries)
    _fail_mid_write(monkeypatch, KeyboardInterrupt(), at=first_shard + 2)  # in the 2nd shard
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(build_pipeline("tiny", dtype=DTYPE, seed=5), tmp_path / "s",
                        max_shard_nbytes=SHARD_NBYTES)  # fmt: skip
    assert {f: f.read_bytes() for f in index.parent.iterdir()} == before
    assert _same_tensors(index, old)


# ------------------------------------------------------- ulimit -f, read-only directories
def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _limited(nbytes: int) -> Callable[[], None]:
    def limit() -> None:  # the child's files stop at nbytes (Python ignores SIGXFSZ: EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return limit


def _dlo(*args: str, limit: int, ranks: int = 1) -> subprocess.CompletedProcess[str]:
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return subprocess.run(
        [*launch, "-m", "dlo", *args],
        env=_env(),
        cwd=ROOT,
        preexec_fn=_limited(limit),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("dlo: error:")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("ranks", [1, 2])
def test_ulimit_f_is_one_clear_error_and_leaves_nothing(tmp_path: Path, ranks: int) -> None:
    """``ulimit -f`` below the file's size (EFBIG at a write): ``save-checkpoint`` and
    ``run --save-encoded`` (one rank, and two under torchrun, rank 0 writing) end with one
    ``dlo: error:`` line naming the file, the run's report printed first; nothing partial
    is left, and the same commands without the limit then work."""
    limit = 256 << 10  # below the checkpoint (837 kB) and its encoded file (530 kB)
    if ranks == 1:
        out = tmp_path / "c"
        proc = _dlo("save-checkpoint", "--out", str(out), limit=limit)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = _one_error(proc.stderr)
        assert f"cannot write {out / 'model.safetensors'}: File too large" in line
        assert "Traceback" not in proc.stderr and _listing(out) == []
    ckpt = save_checkpoint(build_pipeline("tiny", dtype=DTYPE), tmp_path / "ckpt")
    argv = ["run", "--checkpoint", str(ckpt), "--codec", "ans", "--steps", "1", "--json"]
    proc = _dlo(*argv, "--save-encoded", limit=limit, ranks=ranks)
    assert proc.returncode != 0, proc.stdout[-2000:]
    reports = json.loads(proc.stdout[proc.stdout.index("[") :])
    assert [r["rank"] for r in reports] == list(range(ranks))  # the report, every rank's
    line = _one_error(proc.stderr)
    assert f"cannot write {ckpt.parent / ENCODED_FILE}: File too large" in line
    if ranks == 1:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert _listing(ckpt.parent) == ["model.safetensors"]
    assert _dlo(*argv, "--save-encoded", limit=64 << 20, ranks=ranks).returncode == 0
    assert _listing(ckpt.parent) == [ENCODED_FILE, "model.safetensors"]


_READ_ONLY = """
import ctypes
from dlo.cli import main
warm, argv = sys.argv[1], sys.argv[2:]
main(["save-checkpoint", "--out", warm, "--codec", "ans"])  # every module loaded
ckpt = os.path.join(warm, "model.safetensors")
main(["run", "--checkpoint", ckpt, "--codec", "ans", "--steps", "1", "--save-encoded"])
if os.geteuid() == 0:  # the folder is root's: read-only to another user
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/pagemap readable
sys.stdout.flush()
print("---", flush=True)
sys.exit(main(argv))
"""


@pytest.mark.parametrize("command", ["save-checkpoint", "run-save-encoded"])
def test_a_read_only_folder_is_one_clear_error_and_keeps_the_report(
    tmp_path: Path, command: str
) -> None:
    """Writing into a folder the user cannot write (as root: run as another uid, since root
    writes anywhere): one ``dlo: error:`` line naming the file, after the run's report
    (``save-checkpoint``: naming the folder, before the build); nothing written (before: a
    raw PermissionError traceback and no report)."""
    folder = tmp_path / "ro"
    ckpt = save_checkpoint(build_pipeline("tiny", dtype=DTYPE), folder)
    folder.chmod(0o555 if not IS_ROOT else 0o755)
    argv = (
        ["save-checkpoint", "--out", "."]
        if command == "save-checkpoint"
        else ["run", "--checkpoint", ckpt.name, "--codec", "ans", "--steps", "1", "--save-encoded"]
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import os, sys\n" + _READ_ONLY, str(tmp_path / "w"), *argv],
            env=_env(),
            cwd=folder,  # paths relative to it: the test's directories are not open to others
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        folder.chmod(0o755)
    assert proc.returncode == 2, proc.stderr[-3000:]
    after = proc.stdout.split("---\n", 1)[1]
    line = _one_error(proc.stderr)
    if command == "save-checkpoint":  # refused before the build (issue 39 item 8)
        assert "--out='.': this process (uid " in line and "cannot write in ." in line, line
    else:
        assert f"cannot write {ENCODED_FILE}: Permission denied" in line, line
    assert "Traceback" not in proc.stderr
    if command == "run-save-encoded":
        assert "dlo run: preset=tiny" in after  # the report
    assert _listing(folder) == ["model.safetensors"]


def test_saved_files_are_synced_before_they_are_renamed_and_a_failed_sync_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file of a sharded save (its shards and index: the disk tier reads the shards
    with O_DIRECT, which waits for their dirty pages) is synced to the disk and dropped from
    the page cache while its name does not exist yet. A sync that fails with EIO fails the
    save naming the file, and leaves the folder as it was (an older checkpoint whole)."""
    pipe = build_pipeline("tiny", dtype=DTYPE)
    out = tmp_path / "s"
    calls: list[tuple[str, int]] = []
    real_sync, real_advise = os.fdatasync, os.posix_fadvise

    def sync(fd: int) -> None:
        calls.append(("sync", os.fstat(fd).st_ino))
        real_sync(fd)

    def advise(fd: int, offset: int, nbytes: int, advice: int) -> None:
        if (offset, nbytes, advice) == (0, 0, os.POSIX_FADV_DONTNEED):
            calls.append(("drop", os.fstat(fd).st_ino))
        real_advise(fd, offset, nbytes, advice)

    def renamed(src: Any, dst: Any, **kw: Any) -> None:
        calls.append(("rename", os.stat(src).st_ino))
        real_replace(src, dst, **kw)

    real_replace = os.replace
    monkeypatch.setattr(os, "fdatasync", sync)
    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "replace", renamed)
    index = save_checkpoint(pipe, out, max_shard_nbytes=SHARD_NBYTES)
    names = _listing(out)
    assert len(names) == 4 and _same_tensors(index, pipe)
    for name in names:
        ino = (out / name).stat().st_ino
        assert [c for c, i in calls if i == ino] == ["sync", "drop", "rename"], (name, calls)
    saved = {n: (out / n).read_bytes() for n in names}

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", failing)
    first = re.escape(str(out / names[0]))
    with pytest.raises(CheckpointWriteError, match=f"cannot write {first}: Input/output error"):
        save_checkpoint(build_pipeline("tiny", dtype=DTYPE), out, max_shard_nbytes=SHARD_NBYTES)
    assert {n: (out / n).read_bytes() for n in _listing(out)} == saved
