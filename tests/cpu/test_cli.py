"""`dlo run` and `dlo bench` on the CPU: in process, and under torchrun with 2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dlo.bench.methods import METHODS
from dlo.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


@pytest.mark.parametrize(
    "flags",
    [
        ["--mode", "layer", "--resident-layers", "1", "--num-slots", "3"],
        ["--mode", "module"],
        ["--mode", "none"],
        ["--gather-engine", "nccl", "--gather-sync", "kernel"],
    ],
)
def test_run_check_in_process(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--steps", "3", "--check", "--json", "--device", "cpu", *flags])
    out = capsys.readouterr().out
    assert rc == 0, out
    (report,) = json.loads(out)
    assert report["parity"] is True and report["output_finite"]
    assert report["steps"] == 3


@pytest.mark.parametrize("mode", ["layer", "module", "none"])
def test_run_reads_rss_before_teardown_and_the_reference_run(
    mode: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # VmHWM only grows: a read stamped with the number of pipelines built so far tells
    # whether it came before the --check reference pipeline was built
    import dlo.models
    import dlo.platform.env

    built: list[int] = []
    real = dlo.models.build_pipeline

    def counting(*a: Any, **k: Any) -> Any:
        built.append(1)
        return real(*a, **k)

    monkeypatch.setattr(dlo.models, "build_pipeline", counting)
    monkeypatch.setattr(dlo.platform.env, "process_peak_rss_bytes", lambda: len(built))
    rc = main(["run", "--steps", "2", "--check", "--json", "--device", "cpu", "--mode", mode])
    (report,) = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(built) == 2
    assert report["peak_rss_nbytes"] == 1
    if mode != "layer":  # the layer backend reports its own reading, taken inside enable
        assert report["enable_peak_rss_nbytes"] == 1


TINY_BENCH = ["bench", "--preset", "tiny", "--tokens", "64", "--methods", "resident"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--num-slots", "0"], "num_slots must be >= 1, got 0"),
        (["run", "--mode", "bogus"], "invalid choice: 'bogus'"),
        (["run", "--gather-sync", "spin"], "invalid choice: 'spin'"),
        (["run", "--preset", "huge"], "huge"),
        (["run", "--steps", "0"], "--steps=0"),
        (["run", "--resident-layers", "-1"], "resident_layers must be >= 0, got -1"),
        (["run", "--mode", "module", "--transfer", "allgather"], "applies to mode='layer' only"),
        (["run", "--mode", "module", "--num-slots", "3"], "num_slots=3 applies to mode='layer'"),
        # --mode none refuses what it would ignore, as --mode module refuses layer settings
        (
            ["run", "--mode", "none", "--transfer", "allgather"],
            "--transfer allgather applies to --mode layer only (--mode none disables offload)",
        ),
        (["run", "--mode", "none", "--codec", "ans"], "--codec ans applies to --mode layer only"),
        (["run", "--mode", "none", "--no-pin"], "--no-pin applies to --mode layer or module"),
        (["run", "--mode", "none", "--components", "dit"], "--components dit applies to"),
        (["run", "--components", "dit,bogus"], "--components: 'dit,bogus': 'bogus' is not one of"),
        (["run", "--components", "encoder,text_encoder"], "names encoder twice"),
        (["run", "--offload-config", "{}", "--components", "dit"], "replaces --components"),
        (["run", "--hsdp-shard", "2"], "--hsdp-replicate=1 x --hsdp-shard=2 = 2 ranks, but the"),
        (["run", "--hsdp-replicate", "0"], "--hsdp-replicate=0 must be >= 1"),
        (["bench", "--methods", "resident,magic"], "unknown ['magic']"),
        (["bench", "--num-slots", "2,0"], "--num-slots='2,0': expected positive integers"),
        (["bench", "--chunk-mb", "64,x"], "--chunk-mb='64,x'"),
        (["bench", "--tokens", ""], "--tokens=''"),
        (["run", "--device", "bogus"], "--device='bogus' is not a device"),
        (["save-checkpoint", "--out", "/tmp/dlo-never", "--shard-gb", "nan"], "--shard-gb=nan"),
        (["save-checkpoint", "--out", "/tmp/dlo-never", "--shard-gb", "inf"], "--shard-gb=inf"),
        *(
            ([*TINY_BENCH, *flags], needle)
            for flags, needle in [
                (["--reps", "0"], "--reps=0 must be >= 1"),
                (["--warmup", "-1"], "--warmup=-1 must be >= 0"),
                (["--nccl-max-ctas", "0"], "--nccl-max-ctas=0 must be >= 1"),
                (["--json", "/nonexistent-dlo/r.json"], "--json='/nonexistent-dlo/r.json'"),
                (["--markdown", "/nonexistent-dlo/r.md"], "--markdown='/nonexistent-dlo/r.md'"),
                (["--plot", "/nonexistent-dlo/r.png"], "--plot='/nonexistent-dlo/r.png'"),
            ]
        ),
    ],
)
def test_bad_flags_are_one_clear_line(
    argv: list[str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dlo.bench.runner

    def measured(*a: Any, **k: Any) -> Any:
        raise AssertionError("a bad flag must be refused before anything is measured")

    monkeypatch.setattr(dlo.bench.runner, "h2d_limits", measured)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_bench_smoke_json(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    rc = main(
        [
            "bench",
            "--preset",
            "tiny",
            "--methods",
            ",".join(METHODS),  # every method parses; those that cannot run on CPU skip
            "--tokens",
            "32,64",
            "--warmup",
            "1",
            "--reps",
            "2",
            "--json",
            str(path),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(path.read_text())
    methods = {r["method"] for r in report["results"]}
    # FSDP2, diffusers: GPUs / N > 1
    assert methods == {"resident", "dlo-ring", "dlo-auto", "dlo-auto-compute"}
    assert all(r["median_ms"] > 0 for r in report["results"])
    per_block = report["limits"]["resident_ms_per_block"]
    assert set(per_block) == {"32", "64"} and all(v > 0 for v in per_block.values())
    auto = [r for r in report["results"] if r["method"] == "dlo-auto"]
    assert all(r["transfer"] == "rank-local" and r["x_best_manual"] > 0 for r in auto)
    assert report["policy"]["num_slots"] == 2  # one rank: rank-local, two slots
    # told each row's compute per block: one row (one enable) per token count
    told = [r for r in report["results"] if r["method"] == "dlo-auto-compute"]
    assert sorted(r["tokens"] for r in told) == [32, 64]
    assert all(r["transfer"] == "rank-local" and r["x_best_manual"] > 0 for r in told)
    assert "partial" not in report and not Path(f"{path}.tmp").exists()


def test_bench_auto_compute_without_resident_rows_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "bench.json"
    argv = ["bench", "--preset", "tiny", "--methods", "dlo-auto-compute", "--tokens", "32"]
    assert main([*argv, "--warmup", "0", "--reps", "1", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["results"] == []
    assert "dlo-auto-compute: needs the resident rows; method skipped" in caplog.text


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_bench_bytes_per_forward_count_every_forward_run(tmp_path: Path, warmup: int) -> None:
    # the first forward runs even at --warmup 0: the per-forward link bytes divide by it too
    path = tmp_path / "bench.json"
    argv = ["bench", "--preset", "tiny", "--methods", "dlo-ring", "--tokens", "32"]
    assert main([*argv, "--warmup", str(warmup), "--reps", "2", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    (row,) = report["results"]
    streamed = row["host_nbytes"]  # one rank, rank-local: every block crosses once per forward
    gbps = report["limits"]["h2d_pinned_alone_GBps"]
    assert row["h2d_limit_ms"] == pytest.approx(streamed / (gbps * 1e9) * 1e3)


def test_bench_cut_short_keeps_the_rows_it_has(tmp_path: Path) -> None:
    # a device-time limit or a failure in a later method must not cost the finished rows
    from dlo import faults
    from dlo.errors import InjectedFault

    path = tmp_path / "bench.json"
    argv = ["bench", "--preset", "tiny", "--methods", "resident,dlo-ring", "--tokens", "32"]
    with faults.inject("slot_allocation"), pytest.raises(InjectedFault):
        main([*argv, "--warmup", "1", "--reps", "2", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["partial"] is True
    assert [r["method"] for r in report["results"]] == ["resident"]


def _torchrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--standalone",
        "-m",
        "dlo",
        *args,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT
    )


def test_torchrun_run_node_shared_check_two_cpu_ranks() -> None:
    proc = _torchrun("run", "--transfer", "node-shared", "--steps", "2", "--check", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout[proc.stdout.index("[") :])
    assert all(r["parity"] is True and r["transfer"] == "node-shared" for r in reports)
    assert reports[0]["host_nbytes"] == reports[1]["host_nbytes"] > 0


def test_torchrun_run_allgather_check_two_cpu_ranks() -> None:
    proc = _torchrun(
        "run", "--transfer", "allgather", "--steps", "3", "--check", "--json",
        "--explain",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the default (automatic) gather engine on gloo ranks is NCCL's path (explained on rank 0)
    assert proc.stderr.count("dlo gather: gather_engine='auto' -> nccl") == 1
    reports = json.loads(proc.stdout[proc.stdout.index("[") :])
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["parity"] is True and r["transfer"] == "allgather" for r in reports)
    assert reports[0]["host_nbytes"] == reports[1]["host_nbytes"] > 0


def test_torchrun_bench_two_cpu_ranks(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    proc = _torchrun(
        "bench",
        "--preset",
        "tiny",
        "--tokens",
        "32",
        "--warmup",
        "1",
        "--reps",
        "2",
        "--json",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(path.read_text())
    methods = {r["method"] for r in report["results"]}
    assert methods == {
        "resident",
        "dlo-rank-local",
        "dlo-node-shared",
        "dlo-allgather",
        "dlo-auto",
        "dlo-auto-compute",
    }
    row = {r["method"]: r for r in report["results"]}
    # node-shared moves whole blocks over each link (rank-local's limit) from half the host
    assert row["dlo-node-shared"]["h2d_limit_ms"] == row["dlo-rank-local"]["h2d_limit_ms"] > 0
    assert row["dlo-node-shared"]["transfer"] == "node-shared"
    half = row["dlo-rank-local"]["host_nbytes"] / 2
    assert half <= row["dlo-node-shared"]["host_nbytes"] <= half + 64
    assert report["limits"]["allgather_GBps"] > 0  # the shared probes run on gloo too
    auto = [r for r in report["results"] if r["method"] == "dlo-auto"]
    assert [r["transfer"] for r in auto] == [report["policy"]["stacks"]["blocks"]["transfer"]]


@pytest.mark.parametrize("load", ["mapped", "copy"])
def test_save_checkpoint_then_run_from_it(
    load: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    assert (
        main(["save-checkpoint", "--preset", "tiny", "--out", str(out), "--shard-gb", "0.0002"])
        == 0
    )
    assert (out / "model.safetensors.index.json").exists()
    capsys.readouterr()
    argv = ["run", "--steps", "2", "--check", "--json", "--device", "cpu", "--checkpoint"]
    assert main([*argv, str(out), "--checkpoint-load", load]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["parity"] is True and report["load"] == f"checkpoint-{load}"
    assert report["enable_s"] > 0 and report["enable_peak_rss_nbytes"] > 0
    # a float32 run cannot take the bf16 checkpoint: one clear line, exit 2
    assert main([*argv, str(out), "--dtype", "float32"]) == 2
    assert "shape or dtype differs" in capsys.readouterr().err


def test_bench_sweeps_slots_and_chunks_in_one_run(tmp_path: Path) -> None:
    path = tmp_path / "sweep.json"
    argv = ["bench", "--preset", "tiny", "--methods", "resident,dlo-ring,dlo-auto"]
    argv += ["--num-slots", "1,2", "--chunk-mb", "1,2", "--tokens", "32", "--warmup", "1"]
    rc = main([*argv, "--reps", "1", "--json", str(path), "--markdown", str(tmp_path / "s.md")])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["num_slots"] == [1, 2] and report["chunk_mb"] == [1, 2]
    ring = [r for r in report["results"] if r["method"] == "dlo-ring"]
    assert sorted((r["num_slots"], r["chunk_mb"]) for r in ring) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert len({r["setting"] for r in ring}) == 4
    (auto,) = [r for r in report["results"] if r["method"] == "dlo-auto"]
    best = min(r["median_ms"] for r in ring)
    assert auto["x_best_manual"] == pytest.approx(auto["median_ms"] / best)
    table = (tmp_path / "s.md").read_text()
    assert "dlo-ring [1 slots, 2 MiB]" in table and "chunk 1,2 MiB, 1,2 slots" in table


def test_torchrun_hsdp_run_from_a_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    assert main(["save-checkpoint", "--preset", "tiny", "--out", str(out)]) == 0
    proc = _torchrun(
        "run", "--checkpoint", str(out), "--transfer", "allgather", "--hsdp-shard", "2",
        "--steps", "2", "--check", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout[proc.stdout.index("[") :])
    assert [r["parity"] for r in reports] == [True, True]
    assert all(r["load"] == "checkpoint-mapped" for r in reports)


# ----------------------------------------------------------------------------- a newcomer's first hour
def test_dlo_alone_prints_the_help_and_version_prints_versions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: dlo" in out and "run" in out and "bench" in out and "save-checkpoint" in out
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    import dlo

    assert f"dlo {dlo.__version__} (torch" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["run", "bench", "save-checkpoint"])
def test_every_flag_has_help_and_shows_its_default(command: str) -> None:
    import argparse

    from dlo.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    missing = [a.option_strings[0] for a in flags if not a.help]
    assert not missing, f"dlo {command}: no help for {missing}"
    text = parser.format_help()
    assert "(default: " in text  # ArgumentDefaultsHelpFormatter: defaults are shown
    import re

    twice = re.findall(r"\(default: [^)]*\) \(default: [^)]*\)", " ".join(text.split()))
    assert not twice, f"a default said in words, then by argparse: {twice}"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--steps", "0"], "--steps=0 must be >= 1"),
        (["run", "--seed", "-1"], "--seed=-1 must be >= 0"),
        (["run", "--offload-config", "{not json"], "--offload-config is not valid JSON"),
        (["run", "--offload-config", "[1, 2]"], "is neither a JSON object nor a file"),
        (["run", "--offload-config", '{"mode": "layer"}', "--mode", "module"], "replaces --mode"),
        (["run", "--offload-config", '{"mode": "layerwise"}'], "mode='layerwise'"),
    ],
)
def test_first_hour_errors_name_the_range_or_the_field(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("source", ["inline", "file"])
def test_run_takes_a_vllm_omni_offload_config(
    source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = {"mode": "layer", "components": ["dit", "text_encoder"], "pin_memory": False}
    arg = json.dumps(cfg)
    if source == "file":
        (tmp_path / "offload.json").write_text(arg)
        arg = str(tmp_path / "offload.json")
    rc = main(
        ["run", "--steps", "2", "--check", "--json", "--device", "cpu", "--offload-config", arg]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    (report,) = json.loads(out)
    assert (
        report["parity"] is True and report["mode"] == "layer" and report["host_pinned_nbytes"] == 0
    )


def test_bench_says_what_it_runs_and_why_it_skips(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.WARNING)
    argv = ["bench", "--preset", "tiny", "--tokens", "64", "--warmup", "0", "--reps", "1"]
    assert main([*argv, "--methods", "resident,dlo-ring,dlo-allgather,dlo-swap,fsdp2-offload"]) == 0
    text = caplog.text
    assert "dlo bench: preset tiny" in text and "tokens 64" in text
    assert "NOT meaningful" in text  # the CPU platform
    for method in ("dlo-allgather", "dlo-swap", "fsdp2-offload"):
        assert f"{method}: skipped: " in text, method
    assert text.index("dlo bench: preset tiny") < text.index("resident ")


def test_torchrun_bench_codec_rows_for_every_transfer(tmp_path: Path) -> None:
    """``--codec none,ans``: a row per codec for node-shared and AllGather too (each takes
    the codec since issue 22), the encoded host copy smaller."""
    path = tmp_path / "b.json"
    proc = _torchrun(
        "bench", "--preset", "tiny", "--tokens", "32", "--warmup", "1", "--reps", "2",
        "--methods", "resident,dlo-node-shared,dlo-allgather", "--codec", "none,ans",
        "--json", str(path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        (r["method"], r.get("codec", "none")): r for r in json.loads(path.read_text())["results"]
    }
    for method in ("dlo-node-shared", "dlo-allgather"):
        plain, encoded = rows[(method, "none")], rows[(method, "ans")]
        assert encoded["codec_ratio"] < 1 and encoded["host_nbytes"] < plain["host_nbytes"], method
        assert plain["transfer"] == encoded["transfer"] == method.removeprefix("dlo-")
        # node-shared: this rank is charged 1/L of the node's encoded copy
        assert 0 < encoded["host_nbytes"] <= encoded["host_encoded_nbytes"], method


def _run_flags(*flags: str) -> tuple[Any, dict[str, Any]]:
    from dlo.cli import _defaults, build_parser

    parser = build_parser()
    return parser.parse_args(["run", *flags]), _defaults(parser, "run")


@pytest.mark.parametrize(
    ("flags", "components"),
    [
        ([], None),
        (["--components", "dit,encoder"], ("dit", "encoder")),
        (["--components", "dit, text_encoder"], ("dit", "encoder")),
        (["--mode", "module", "--components", "encoder"], ("encoder",)),
    ],
)
def test_components_flag_sets_the_config_field(
    flags: list[str], components: tuple[str, ...] | None
) -> None:
    from dlo.commands.run_flags import config_of

    assert config_of(*_run_flags(*flags)).components == components


@pytest.mark.parametrize(
    ("flags", "codec"),
    [([], None), (["--codec", "none"], "none"), (["--codec", "auto"], "auto")],
)
def test_codec_flag_is_unset_by_default(flags: list[str], codec: str | None) -> None:
    """No --codec leaves the codec to the device ([Note: automatic by default]: auto on a
    GPU, none on a CPU device); a value given, none included, is kept."""
    from dlo.commands.run_flags import config_of

    args, defaults = _run_flags(*flags)
    assert defaults["codec"] is None
    assert config_of(args, defaults).codec == codec


def test_hsdp_flags_must_multiply_to_the_world_size_and_say_so() -> None:
    from dlo.commands.run_flags import parallel_of

    args, _ = _run_flags("--hsdp-shard", "4")
    with pytest.raises(
        ValueError, match=r"^--hsdp-replicate=1 x --hsdp-shard=4 = 4 ranks, but the job has 2"
    ):
        parallel_of(args, 2)
    par = parallel_of(args, 4)
    assert (par.hsdp_replicate_size, par.hsdp_shard_size, par.data_parallel_size) == (1, 4, 4)
    assert parallel_of(_run_flags()[0], 3).data_parallel_size == 3
