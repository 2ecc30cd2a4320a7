"""The README's program runs as written: one process, and two ranks under torchrun (CPU,
gloo), each checking its output bit for bit against the resident run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doc_blocks import marked
from tests.harness import run_program

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ranks", [1, 2])
def test_readme_program_runs_as_written(ranks: int, tmp_path: Path) -> None:
    block = marked(ROOT / "README.md", "program: my_pipeline.py")
    assert block.lang == "python", "the README program must be a ```python block"
    program = tmp_path / "my_pipeline.py"
    program.write_text(block.code)
    done = run_program(program, ranks=ranks)
    assert done.returncode == 0, done.stdout + done.stderr
    # the ranks print at the same time: count the reports, not the lines
    reports = re.findall(
        r"rank (\d+): bitwise equal to the resident run; ([a-z-]+) over (\d+)", done.stdout
    )
    assert sorted(int(r) for r, _, _ in reports) == list(range(ranks)), done.stdout + done.stderr
    want = ("rank-local", "1") if ranks == 1 else ("allgather", str(ranks))
    assert all((t, n) == want for _, t, n in reports), reports
