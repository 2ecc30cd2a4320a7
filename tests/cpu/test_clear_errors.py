"""Bad input is one clear line (issue 39 item 8): a damaged pipeline folder (JSON nested too
deep, a name that is no class, a tensor relabelled to another dtype, a component folder this
process cannot read), flag values past their range, a save into a file or a folder it cannot
write, and a run whose output is not finite. Each ends in one ``dlo: error:`` line naming
the file or flag and the value, exit 2 (1 for the non-finite output), no traceback, nothing
written and nothing held."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dlo.cli import main
from dlo.host.region import LEDGER
from dlo.io.checkpoint import read_header
from dlo.io.writer import save_checkpoint
from dlo.models import build_pipeline
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder
from tests.other_user import IS_ROOT, as_other_user

DEEP = "[" * 100_000 + "]" * 100_000
"""JSON nested far deeper than Python's recursion limit (``json`` raised RecursionError)."""

RUN = ["--steps", "1", "--device", "cpu", "--height", "32", "--width", "32"]


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Flux folder, sharded (its transformer has an index)."""
    path = tmp_path_factory.mktemp("clear") / "flux"
    save_folder(FOLDERS["tiny-flux"], path, max_shard_size=40_000)
    return path


def _copy(flux: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "f"
    shutil.copytree(flux, dst)
    return dst


def _one_error(err: str) -> str:
    """The one ``dlo: error:`` line of ``err``, which holds no traceback."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("dlo: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], rc: int = 2) -> str:
    """``dlo argv`` in this process: exit ``rc``, its one error line, nothing held."""
    capsys.readouterr()
    assert main(argv) == rc
    line = _one_error(capsys.readouterr().err)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    return line


def _run_folder(folder: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``dlo run --pipeline folder`` refused, with nothing written at ``out``."""
    line = _refused(["run", "--pipeline", str(folder), *RUN, "--output", f"{out}/"], capsys)
    assert not out.exists()
    return line


def _rewrite_header(path: Path, edit: Any) -> None:
    """``path``'s safetensors header through ``edit(header) -> text``, the data kept."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    raw = edit(json.loads(data[8 : 8 + n])).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def _shard(folder: Path) -> Path:
    return sorted((folder / "transformer").glob("*-00001-of-*.safetensors"))[0]


# ----------------------------------------------------------------------------- the folder
@pytest.mark.parametrize("where", ["model_index", "index", "header"])
def test_json_nested_too_deep_names_the_file(
    flux: Path, tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy(flux, tmp_path)
    if where == "model_index":
        path = folder / "model_index.json"
        path.write_text(path.read_text().rstrip()[:-1] + f', "deep": {DEEP}}}')
    elif where == "index":
        path = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
        path.write_text(f'{{"weight_map": {DEEP}}}')
    else:
        path = _shard(folder)
        _rewrite_header(path, lambda h: json.dumps(h)[:-1] + f', "deep": {DEEP}}}')
    line = _run_folder(folder, tmp_path / "out", capsys)
    assert str(path) in line and "nested too deep to parse" in line, line


@pytest.mark.parametrize(
    ("entry", "value", "named"),
    [
        ("vae", ["diffusers", "utils"], "vae: diffusers.utils is not a class (a module)"),
        ("vae", ["diffusers", "__spec__"], "vae = ['diffusers', '__spec__']: '__spec__' is not"),
        ("vae", ["diffusers", "ConfigMixin"], "vae = 'ConfigMixin': not a component class"),
        ("_class_name", "utils", "_class_name: diffusers.utils is not a class"),
        ("_class_name", "__spec__", "_class_name must name the pipeline class, got '__spec__'"),
        (
            "_class_name",
            "AutoPipelineForText2Image",
            "_class_name = 'AutoPipelineForText2Image' is not a pipeline class",
        ),
    ],
)
def test_a_name_that_is_no_class_names_the_entry_and_the_value(
    flux: Path,
    tmp_path: Path,
    entry: str,
    value: Any,
    named: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = _copy(flux, tmp_path)
    index = folder / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), entry: value}))
    line = _run_folder(folder, tmp_path / "out", capsys)
    assert str(index) in line and named in line, line


def test_a_tensor_relabelled_integer_names_the_file_and_the_tensor(
    flux: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An F32 weight's header entry saying I32 (the same size, so every byte checks out)."""
    folder = _copy(flux, tmp_path)
    shard = _shard(folder)
    name = next(n for n, e in read_header(shard).items() if e.dtype == torch.float32)

    def relabel(header: dict[str, Any]) -> str:
        header[name]["dtype"] = "I32"
        return json.dumps(header)

    _rewrite_header(shard, relabel)
    line = _run_folder(folder, tmp_path / "out", capsys)
    assert f"{shard}: tensor 'transformer.{name}' is stored as torch.int32" in line, line


def _dlo_as_a_user(cwd: Path, flux: Path, *argv: str) -> tuple[int, str]:
    """``dlo argv`` in ``cwd`` as a user the mode bits bind: another uid where the tests run
    as root (root reads and writes whatever the bits say), else this one. Exit status and
    stderr. The other uid cannot read the interpreter's files (root's): dlo and the classes
    of the ``flux`` folder are imported first, as root."""
    if IS_ROOT:
        index = json.loads((flux / "model_index.json").read_text())
        classes = [v for v in index.values() if isinstance(v, list) and v[0]]
        classes.append(["diffusers", index["_class_name"]])
        before = (
            "import importlib\n"
            "from dlo.cli import build_parser, main\n"
            "build_parser()\n"
            "import dlo.commands.run_pipeline, dlo.pipelines.load, dlo.pipelines.synth\n"
            "import dlo.parallel.groups, dlo.platform.device, dlo.runtime.measure\n"
            f"for lib, name in {classes!r}:\n"
            "    getattr(importlib.import_module(lib), name)\n"
        )
        code = "sys.exit(main(sys.argv[1:]))"
        proc = as_other_user(cwd, code, *argv, before=before, check=False)
        return proc.returncode, proc.stderr.decode()
    done = subprocess.run(
        [sys.executable, "-m", "dlo", *argv], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stderr


def _open_to_all(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def test_a_component_folder_it_cannot_read_names_the_folder(flux: Path, tmp_path: Path) -> None:
    """A component folder of mode 000 (before: a raw PermissionError traceback)."""
    folder = _copy(flux, tmp_path)
    _open_to_all(folder)
    (folder / "vae").chmod(0)
    try:
        rc, err = _dlo_as_a_user(folder, flux, "run", "--pipeline", ".", *RUN, "--output", "out/")
    finally:
        (folder / "vae").chmod(0o755)
    line = _one_error(err)
    assert rc == 2 and "lists vae (AutoencoderKL) but this process (uid" in line, line
    assert "cannot read vae (mode 000" in line, line
    assert not (folder / "out").exists()


# ----------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--guidance", "1e308"], "--guidance=1e+308 must be in [0, 100]"),
        (["--guidance", "nan"], "--guidance=nan must be in [0, 100]"),
        (["--guidance", "-1"], "--guidance=-1.0 must be in [0, 100]"),
        (["--frames", "1000000"], "--frames=1000000 must be in [1, 4096]"),
        (["--height", "100000"], "--height=100000 must be in [1, 16384]"),
        (["--width", "100000"], "--width=100000 must be in [1, 16384]"),
    ],
)
def test_pipeline_call_flags_past_their_range_are_refused_before_any_work(
    flux: Path,
    tmp_path: Path,
    flags: list[str],
    named: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dlo.pipelines.folder

    def read(*a: Any, **k: Any) -> Any:
        raise AssertionError("a bad flag must be refused before the folder is read")

    monkeypatch.setattr(dlo.pipelines.folder, "read_index", read)
    out = tmp_path / "out"
    argv = ["run", "--pipeline", str(flux), "--steps", "1", *flags, "--output", f"{out}/"]
    assert named in _refused(argv, capsys)
    assert not out.exists()


def test_hsdp_shard_beyond_the_world_names_the_flag_and_the_world_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _refused(["run", "--hsdp-shard", "1000000", "--device", "cpu"], capsys)
    assert "--hsdp-shard=1000000 = 1000000 ranks, but the job has 1 (WORLD_SIZE)" in line, line


# ----------------------------------------------------------------------------- saves
@pytest.fixture
def no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a pipeline fails the test: a refusal comes before the build."""
    import dlo.models
    import dlo.pipelines.synth

    def build(*a: Any, **k: Any) -> Any:
        raise AssertionError("refused only after building the pipeline")

    monkeypatch.setattr(dlo.models, "build_pipeline", build)
    monkeypatch.setattr(dlo.pipelines.synth, "build_pipeline", build)


@pytest.mark.parametrize(
    "argv",
    [
        ["save-pipeline", "--like", "tiny-flux", "{file}"],
        ["save-pipeline", "--like", "tiny-flux", "{file}/sub"],
        ["save-checkpoint", "--out", "{file}"],
    ],
)
@pytest.mark.usefixtures("no_build")
def test_a_save_into_a_file_is_refused_before_the_build(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "file"
    file.write_bytes(b"kept")
    line = _refused([a.format(file=file) for a in argv], capsys)
    assert f"{file}' exists and is not a directory" in line or f"{file} exists and" in line, line
    assert "DIR=" in line if argv[0] == "save-pipeline" else "--out=" in line
    assert file.read_bytes() == b"kept" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_save_pipeline_into_a_folder_it_cannot_write_is_refused_before_the_build(
    flux: Path, tmp_path: Path
) -> None:
    """(before: a raw PermissionError traceback after 5 s of building)"""
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555 if not IS_ROOT else 0o755)
    try:
        rc, err = _dlo_as_a_user(folder, flux, "save-pipeline", "--like", "tiny-flux", "new")
    finally:
        folder.chmod(0o755)
    line = _one_error(err)
    assert rc == 2 and "save-pipeline: DIR='new': this process (uid" in line, line
    assert "cannot write in . (mode 555" in line or "cannot write in . (mode 755" in line, line
    assert list(folder.iterdir()) == []


# ----------------------------------------------------------------------------- outputs
def test_a_non_finite_output_is_one_line_naming_the_rank_and_the_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pipe = build_pipeline("tiny", dtype=torch.float32)
    with torch.no_grad():
        next(pipe.vae.parameters()).fill_(float("nan"))
    ckpt = save_checkpoint(pipe, tmp_path / "c")
    argv = ["run", "--checkpoint", str(ckpt), "--dtype", "float32", "--steps", "1", "--json"]
    line = _refused([*argv, "--device", "cpu"], capsys, rc=1)
    assert line.startswith("dlo: error: the output has non-finite values (NaN or inf): rank 0: ")
    assert int(line.rsplit(": ", 1)[1]) > 0


def test_a_pipelines_non_finite_output_is_one_line_too(
    flux: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy(flux, tmp_path)
    shards = (folder / "vae").glob("*.safetensors")
    (entry,) = [e for f in shards for n, e in read_header(f).items() if n == "decoder.conv_in.bias"]
    with entry.file.open("r+b") as f:  # every value of one decoder weight NaN
        f.seek(entry.start)
        f.write(b"\xff" * entry.nbytes)
    argv = ["run", "--pipeline", str(folder), *RUN, "--max-sequence-length", "16"]
    line = _refused(argv, capsys, rc=1)
    assert line.startswith("dlo: error: the output has non-finite values (NaN or inf): rank 0: ")
