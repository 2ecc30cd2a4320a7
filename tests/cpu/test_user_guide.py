"""Every Python block of the user guide and the reference runs as written, as the README's
program does (``tests/cpu/test_readme.py``): saved under the name its marker gives, run on
the CPU as one process, or under torchrun on the ranks its marker names (gloo), each bounded
in time (markers: ``tests/doc_blocks.py``). And ``dlo run --json`` prints what the
reference says it prints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dlo.cli import main
from tests.doc_blocks import Block, blocks, program
from tests.harness import run_program

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "docs" / "user_guide.md", ROOT / "docs" / "reference.md")
PROGRAMS = [b for doc in DOCS for b in blocks(doc) if b.lang == "python"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_python_block_is_a_program_here(doc: Path) -> None:
    """No ```python block escapes the parser, so none escapes the run below."""
    fences = len(re.findall(r"^```python$", doc.read_text(encoding="utf-8"), re.M))
    assert fences == len([b for b in PROGRAMS if b.path == doc]) > 0


@pytest.mark.parametrize("block", PROGRAMS, ids=lambda b: b.where)
def test_doc_program_runs_as_written(block: Block, tmp_path: Path) -> None:
    prog = program(block)
    if prog.ranks > 1:  # the reader sees no marker: the program says how to launch it
        launch = f"torchrun --nproc-per-node={prog.ranks} {prog.name}"
        assert launch in block.code.splitlines()[0], (
            f"{block.where}: its first line lacks {launch!r}"
        )
    path = tmp_path / prog.name
    path.write_text(block.code)
    done = run_program(path, ranks=prog.ranks, timeout_s=240)
    assert done.returncode == 0, (
        f"{block.where} ({prog.name} on {prog.ranks} rank(s)) failed:\n"
        + done.stdout[-4000:]
        + done.stderr[-8000:]
    )


def test_run_json_prints_what_the_reference_says(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--steps", "1", "--json", "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)
    shape = "array" if isinstance(printed, list) else "object"
    text = " ".join((ROOT / "docs" / "reference.md").read_text(encoding="utf-8").split())
    m = re.search(r"- `--json` prints (.+?):", text)
    assert m is not None, "reference.md lost its `--json` note"
    assert f"one JSON {shape}" in m.group(1), (shape, m.group(1))
    if isinstance(printed, list):  # one object per rank, in rank order
        assert [r["rank"] for r in printed] == [0], printed
