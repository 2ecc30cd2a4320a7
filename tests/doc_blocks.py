"""The fenced code blocks of the markdown docs, and the markers that say how CI runs them.

A marker is an HTML comment on the line right before a block's opening fence (invisible
where the markdown is rendered):

- ``<!-- quick-start -->``: README.md's quick-start commands, which ``.ci/run`` runs as
  written (``.ci/readme_commands.py`` prints them);
- ``<!-- program: NAME.py -->``: the block is a program saved as ``NAME.py``;
  ``<!-- program: NAME.py ranks=N -->`` runs it under ``torchrun --nproc-per-node=N``.

Every ``python`` block of the user guide and the reference is a program, marked or not (one
process unless marked): ``tests/cpu/test_user_guide.py`` runs each as written, and
``tests/cpu/test_readme.py`` the README's. Standard library only: ``.ci/readme_commands.py``
imports this module before dlo is installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_MARKER = re.compile(r"<!-- (.+?) -->")
_PROGRAM = re.compile(r"program: (\w+\.py)(?: ranks=(\d+))?")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a markdown file."""

    path: Path
    line: int
    """The 1-based line of the opening fence."""
    lang: str
    """The fence's info string (``python``, ``bash``, ``text``, or empty)."""
    marker: str | None
    """The marker comment's text, or None."""
    code: str
    """The lines between the fences, each ending with a newline."""

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


@dataclass(frozen=True)
class Program:
    """How a ``python`` block runs: saved as ``name``, on ``ranks`` processes."""

    name: str
    ranks: int


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order."""
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        start, lang = i, lines[i][3:].strip()
        marker = _MARKER.fullmatch(lines[i - 1].strip()) if i else None
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if i == len(lines):
            raise ValueError(f"{path.name}:{start + 1}: the code block is never closed")
        code = "".join(lines[start + 1 : i])
        found.append(Block(path, start + 1, lang, marker.group(1) if marker else None, code))
        i += 1
    return found


def marked(path: Path, marker: str) -> Block:
    """The one block of ``path`` whose marker is ``marker``."""
    hits = [b for b in blocks(path) if b.marker == marker]
    if len(hits) != 1:
        raise ValueError(f"{path.name} has {len(hits)} blocks marked <!-- {marker} -->, not 1")
    return hits[0]


def program(block: Block) -> Program:
    """How CI runs the ``python`` block ``block`` (see the module docstring)."""
    if block.marker is None:
        return Program(f"{block.path.stem}_{block.line}.py", 1)
    m = _PROGRAM.fullmatch(block.marker)
    if m is None:
        raise ValueError(
            f"{block.where}: unknown marker <!-- {block.marker} --> (known: "
            "<!-- program: NAME.py -->, <!-- program: NAME.py ranks=N -->)"
        )
    return Program(m.group(1), int(m.group(2) or 1))
