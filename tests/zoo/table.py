"""The model table of ``docs/compatibility.md``, from the zoo: ``python -m tests.zoo.table``
rewrites it; ``tests/cpu/test_zoo.py`` fails while it differs from what this produces.

The table's first line records the diffusers and transformers versions it was made with.
Where pip resolves others (a fresh install picks the newest within the test extras' bounds),
the rows of the classes both versions have must still be what the zoo gives; classes that only
one of them has are listed by :func:`compare`, not failed on (see :func:`compare`).

Each row is a class of the installed diffusers (every transformer class) or one of the text
encoders, as dlo finds it with no declaration: the stacks it streams and how it found them.
"Out of the box" is backed by ``tests/cpu/test_zoo.py``: every built class runs bitwise
under the ring and the model swap with exactly the configuration the row names.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

import diffusers
import torch
import transformers

import dlo
from tests.zoo import DIT_MODULES, ENCODER_MODULE, Case, cases, not_built

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
BEGIN = "<!-- generated: models -->\n"
END = "<!-- end generated -->"


def _row(case: Case, encoder: bool) -> str:
    torch.manual_seed(0)
    model = case.build()
    target: object = model
    if encoder:
        target = type("Pipe", (), {"_dit_modules": [], "_encoder_modules": ["text_encoder"]})()
        target.text_encoder = model  # type: ignore[attr-defined]
    cfg = dlo.OffloadConfig(mode="layer", components=("encoder",) if encoder else None)
    plan = dlo.resolve_offload_plan(target, cfg)
    prefix = "text_encoder." if encoder else ""
    stacks = ", ".join(
        f"`{s.container_path.removeprefix(prefix)}` x{len(s.block_paths)}" for s in plan.stacks
    )
    found = sorted({s.found_by for s in plan.stacks})
    if not plan.stacks:
        status = "needs a declaration"
    elif case.needs:
        needs = ", ".join(f"`{k}={v!r}`" for k, v in case.needs.items())
        status = f"needs {needs}: {case.note}"
    elif found == ["structure"]:
        status = "out of the box (a structural guess: warns once, naming the declaration)"
    else:
        status = "out of the box"
    by = ", ".join(f"`{f}`" if f.startswith("_") else f for f in found)
    return f"| `{case.name}` | {stacks or '-'} | {by or '-'} | {status} |"


def versions_line(diffusers_version: str, transformers_version: str) -> str:
    """The table's first line: the versions it was generated with."""
    return (
        f"diffusers {diffusers_version}, transformers {transformers_version}; tiny "
        "configs (`tests/zoo`), random weights. Regenerate: `python -m tests.zoo.table`."
    )


_VERSIONS = re.compile(r"^diffusers (\S+), transformers (\S+); ")


def recorded_versions(body: str) -> tuple[str, str]:
    """The (diffusers, transformers) versions a generated section names on its first line."""
    match = _VERSIONS.match(body)
    if match is None:
        raise ValueError(f"the table's first line names no versions: {body.splitlines()[:1]}")
    return match.group(1), match.group(2)


def _rows(body: str) -> dict[str, str]:
    """Each model row of a section by its class cell (both tables: DiTs, then encoders)."""
    return {
        line.split("|")[1].strip(): line for line in body.splitlines() if line.startswith("| `")
    }


def compare(doc: str, now: str) -> tuple[list[str], list[str]]:
    """(mismatches, notes) between the documented section ``doc`` and the generated ``now``.

    With the same versions, the sections must be equal line for line. With other versions,
    the row of every class both sections have must be equal (the prose and the order too),
    and the classes only one side has become notes: a newer diffusers adding a class is not
    a failure of dlo, a row that changed is.
    """
    if recorded_versions(doc) == recorded_versions(now):
        if doc == now:
            return [], []
        diff = difflib.unified_diff(doc.splitlines(), now.splitlines(), "doc", "now", lineterm="")
        return ["\n".join(diff)], []
    old, new = _rows(doc), _rows(now)
    shared = [k for k in old if k in new]
    mismatches = [f"doc:  {old[k]}\nnow:  {new[k]}" for k in shared if old[k] != new[k]]
    prose = [ln for ln in doc.splitlines()[1:] if not ln.startswith("| `")]
    if prose != [ln for ln in now.splitlines()[1:] if not ln.startswith("| `")]:
        mismatches.append("the prose or headers around the rows differ")
    notes = [f"only in the doc: {k}" for k in old if k not in new]
    notes += [f"only in the installed versions: {k}" for k in new if k not in old]
    return mismatches, notes


def table() -> str:
    """The generated section's body."""
    lines = [
        versions_line(diffusers.__version__, transformers.__version__),
        "",
        "| class | streamed stacks (tiny config) | found by | status |",
        "|---|---|---|---|",
    ]
    for module in DIT_MODULES:
        lines += [_row(c, encoder=False) for c in cases(module)]
        lines += [
            f"| `{n}` | - | - | not built on CPU: {why} |" for n, why in not_built(module).items()
        ]
    lines += [
        "",
        "Text encoders, as a pipeline's encoder: streamed when `components` names "
        '`"encoder"`; under `components=None` they are kept whole on the device, said once:',
        "",
        "| class | streamed stacks (tiny config) | found by | status |",
        "|---|---|---|---|",
    ]
    lines += [_row(c, encoder=True) for c in cases(ENCODER_MODULE)]
    return "\n".join(lines) + "\n"


def rewrite(text: str, body: str) -> str:
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + body + END + rest.split(END, 1)[1]


def current() -> str:
    """The generated section as ``docs/compatibility.md`` has it now."""
    return DOC.read_text(encoding="utf-8").split(BEGIN, 1)[1].split(END, 1)[0]


def main() -> int:
    DOC.write_text(rewrite(DOC.read_text(encoding="utf-8"), table()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
