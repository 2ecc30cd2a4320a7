"""Issue 40, items 2 and 3, through the ``dlo`` command: ``--output`` (a directory whatever
its name, a video refused before any work for one PNG, the summary's output cell) and long
work that says so (the ``dlo run:`` line before the run, plain progress lines on a stderr
that is not a terminal: the checkpoint write, the encode, each bench row, the denoising)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dlo.models
import dlo.pipelines.load
from dlo.cli import main
from dlo.commands.run_pipeline import _output_path
from dlo.host.region import LEDGER
from dlo.platform import progress
from tests.cpu.test_pipeline_folders import _call_flags, _folder

WAN = "tiny-wan2.1"  # 5 frames of 16 x 16


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("progress")


@pytest.fixture(autouse=True)
def nothing_held() -> Iterator[None]:
    """Every run gives its host memory back (later tests check the ledger)."""
    before = (LEDGER.host_nbytes, LEDGER.pinned_nbytes)
    yield
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == before


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress as a log sees it (capsys' stderr is no terminal), a line at every step."""
    monkeypatch.delenv("DLO_PROGRESS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.0, raising=False)


def _plain(text: str) -> None:
    assert "\r" not in text and "\x1b" not in text, text[-2000:]


def _wan(root: Path, *flags: str) -> list[str]:
    """A run of the folder without offload: a run --pipeline without --check keeps its
    backend to the end, and its host region would stay in the ledger later tests check."""
    folder = _folder(root, WAN)
    return ["run", "--pipeline", str(folder), "--steps", "2", "--device", "cpu", "--dtype",
            "float32", "--mode", "none", *_call_flags(WAN), *flags]  # fmt: skip


# ----------------------------------------------------------------------------- --output
def test_an_existing_directory_with_a_dot_in_its_name_is_a_directory(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "frames.v1"
    out.mkdir()
    assert main(_wan(root, "--json", "--output", str(out))) == 0, capsys.readouterr().err
    (report,) = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == [f"frame_{i:04d}.png" for i in range(5)]
    assert report["output_location"] == str(out) and report["output_frames"] == 5
    # a second rank's directory: the rank after the whole name, not inside its "suffix"
    assert _output_path(str(out), 1, 2) == tmp_path / "frames.v1.rank1"
    assert _output_path(str(tmp_path / "new.d") + "/", 1, 2) == tmp_path / "new.d.rank1"


@pytest.mark.parametrize("frames", [["--frames", "5"], []])  # given, or the pipeline's default
def test_a_video_to_one_png_is_refused_before_any_work(
    root: Path,
    tmp_path: Path,
    frames: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = [a for a in _wan(root) if a not in ("--frames", "5")] + frames
    capsys.readouterr()  # what writing the folder printed

    def no_work(*a: Any, **k: Any) -> Any:
        raise AssertionError("--output must be refused before the load")

    monkeypatch.setattr(dlo.pipelines.load, "load_pipeline", no_work)
    png = str(tmp_path / "video.png")
    assert main([*argv, "--output", png]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--output={png!r}" in err[0], err
    assert ("5 frames" if frames else "81 frames") in err[0] and ".mp4" in err[0]
    assert not (tmp_path / "video.png").exists()


def test_the_summary_shows_the_output_location_and_frame_count(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "video"
    assert main(_wan(root, "--output", str(out))) == 0
    stdout = capsys.readouterr().out
    (row,) = [line for line in stdout.splitlines() if line.startswith("| 0 |")]
    assert f"| {out} (5 frames) |" in row, row
    assert "frame_0000.png" not in stdout
    assert len(list(out.iterdir())) == 5


# ----------------------------------------------------------------------------- progress
def test_the_run_line_comes_before_the_run(
    root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build, real_load = dlo.models.build_pipeline, dlo.pipelines.load.load_pipeline

    def build(*a: Any, **k: Any) -> Any:
        print("<work starts>")
        return real_build(*a, **k)

    def load(*a: Any, **k: Any) -> Any:
        print("<work starts>")
        return real_load(*a, **k)

    monkeypatch.setattr(dlo.models, "build_pipeline", build)
    monkeypatch.setattr(dlo.pipelines.load, "load_pipeline", load)
    assert main(["run", "--steps", "2", "--device", "cpu", "--codec", "ans"]) == 0
    out = capsys.readouterr().out
    header = out.index("dlo run: preset=tiny mode=layer transfer=rank-local steps=2")
    assert header < out.index("<work starts>") < out.index("| rank |")
    assert "codec=ans" in out[header : out.index("\n", header)]
    assert "dlo run: settled codec=" in out  # the ratio: known after the run

    assert main(_wan(root)) == 0
    out = capsys.readouterr().out
    header = out.index(f"dlo run: pipeline={_folder(root, WAN)} (WanPipeline) mode=none")
    assert header < out.index("<work starts>") < out.index("| rank |")

    # with --json the line goes to stderr: stdout is the JSON alone
    assert main(["run", "--steps", "2", "--device", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.replace("<work starts>\n", ""))[0]["steps"] == 2
    assert "dlo run: preset=tiny" in captured.err


def test_a_checkpoint_write_and_its_encode_print_lines_in_a_log(
    tmp_path: Path, lines: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    assert main(["save-checkpoint", "--out", str(out), "--codec", "ans"]) == 0
    captured = capsys.readouterr()
    err = captured.err
    _plain(err)
    assert "dlo: checkpoint checksums + write " in err
    assert "(100%)" in err.split("dlo: checkpoint checksums + write")[-1].splitlines()[0]
    assert "dlo: encode 1/" in err and "blocks (100%)" in err
    assert "encoding the blocks with codec=ans" in captured.out
    # the run from it, with the codec: the encoded file is read, the host shards and steps show
    argv = ["run", "--steps", "2", "--device", "cpu", "--checkpoint", str(out), "--codec", "ans"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    _plain(err)
    assert "dlo: host shards 1/" in err and "dlo run: denoising 2/2 steps (100%)" in err


def test_a_run_that_encodes_prints_encode_lines_in_a_log(
    lines: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--steps", "1", "--device", "cpu", "--codec", "ans"]) == 0
    err = capsys.readouterr().err
    _plain(err)
    assert "dlo: encode 1/7 blocks (14%)" in err and "dlo: encode 7/7 blocks (100%)" in err


def test_every_bench_row_prints_lines_in_a_log(
    lines: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--preset", "tiny", "--tokens", "32", "--warmup", "1", "--reps", "2"]
    assert main([*argv, "--methods", "resident,dlo-ring"]) == 0
    err = capsys.readouterr().err
    _plain(err)
    for row in ("resident tokens=32", "dlo-ring tokens=32"):
        assert f"dlo bench: {row} 1/3 forwards (33%)" in err, row
        assert f"dlo bench: {row} 3/3 forwards (100%)" in err, row


def test_a_pipeline_run_prints_its_steps_as_lines_not_diffusers_bar(
    root: Path, lines: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_wan(root)) == 0
    err = capsys.readouterr().err
    _plain(err)
    assert "dlo run: denoising 1/2 steps (50%)" in err
    assert "dlo run: denoising 2/2 steps (100%)" in err


def test_in_a_terminal_the_checkpoint_write_and_bench_rows_have_bars(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLO_PROGRESS", "bar")  # what a terminal gets
    monkeypatch.delenv("RANK", raising=False)
    assert main(["save-checkpoint", "--out", str(tmp_path / "ckpt")]) == 0
    assert "dlo: checkpoint checksums + write" in capsys.readouterr().err
    argv = ["bench", "--preset", "tiny", "--tokens", "32", "--warmup", "1", "--reps", "1"]
    assert main([*argv, "--methods", "resident"]) == 0
    assert "dlo bench: resident tokens=32" in capsys.readouterr().err
