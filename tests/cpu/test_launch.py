"""The launch scripts, exercised with 2 CPU processes (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _launch(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ)
    full.update(
        {
            "DLO_NPROC": "2",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHON": sys.executable,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{full.get('PYTHONPATH', '')}",
            **env,
        }
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(k, None)
    return subprocess.run(
        ["bash", str(ROOT / "launch" / "dlo-launch"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=full,
        cwd=ROOT,
    )


def _reports(stdout: str) -> list[dict[str, object]]:
    # rank 0's lines carry torchrun's "[default0]:" prefix
    text = "\n".join(
        line.split(":", 1)[1] if line.startswith("[default") else line
        for line in stdout.splitlines()
    )
    return json.loads(text[text.index("[\n") :])


def _recording_python(tmp_path: Path) -> tuple[str, Path]:
    """A python that records its arguments, so a test can see the --log-dir torchrun got."""
    record = tmp_path / "argv"
    wrapper = tmp_path / "python"
    wrapper.write_text(
        f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> {record}\nexec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper), record


def _log_dir(record: Path) -> Path:
    (arg,) = [a for a in record.read_text().splitlines() if a.startswith("--log-dir=")]
    return Path(arg.split("=", 1)[1])


def test_launch_two_cpu_ranks_allgather_check(tmp_path: Path) -> None:
    python, record = _recording_python(tmp_path)
    proc = _launch(
        "run", "--transfer", "allgather", "--steps", "2", "--check", "--json", PYTHON=python
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not _log_dir(record).exists()  # the temporary log folder is removed on exit
    reports = _reports(proc.stdout)
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["parity"] is True for r in reports)
    assert "[default1]" not in proc.stdout  # logs filtered to rank 0


def test_launch_hsdp_shard_two_cpu_ranks() -> None:
    proc = _launch(
        "run", "--transfer", "allgather", "--hsdp-shard", "2", "--steps", "2", "--check", "--json"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(r["parity"] is True for r in _reports(proc.stdout))


def test_launch_exits_nonzero_when_a_rank_fails(tmp_path: Path) -> None:
    python, record = _recording_python(tmp_path)
    proc = _launch("run", "--preset", "no-such-preset", PYTHON=python)
    assert proc.returncode != 0
    assert not _log_dir(record).exists()


def test_launch_keeps_logs_in_dlo_log_dir(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    python, record = _recording_python(tmp_path)
    proc = _launch("run", "--steps", "1", DLO_LOG_DIR=str(logs), PYTHON=python)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _log_dir(record) == logs
    assert any(p.is_file() for p in logs.rglob("*"))  # torchrun's per-rank logs are kept


def test_slurm_script_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "launch" / "slurm_hsdp.sbatch")], check=True)
