"""The package layout is the architecture: every import points down the layers of
docs/design.md's module map, no module imports itself back through a cycle, and no module
outgrows a screenful of screens."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dlo"
MAX_LINES = 450

# bottom to top; a module may import its own layer's package or any layer below it
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dlo.errors", "dlo.faults", "dlo.journal"),
    ("dlo.platform",),
    ("dlo.config",),
    ("dlo.hooks",),
    ("dlo.plan",),
    ("dlo.models",),
    ("dlo.parallel",),
    ("dlo.io",),
    ("dlo.host",),
    ("dlo.codec",),
    ("dlo.runtime",),
    ("dlo.backends",),
    ("dlo.pipelines",),
    ("dlo",),  # the package face, dlo/__init__.py
    ("dlo.bench", "dlo.commands", "dlo.cli", "dlo.__main__"),
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    """The layer of a module: the longest layer prefix naming it or a package above it."""
    best, depth = -1, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and n.count(".") > depth:
                best, depth = i, n.count(".")
    assert best >= 0, f"{module} is in no layer of LAYERS (add it to the module map)"
    return best


def _imports(module: str) -> set[str]:
    """Every dlo module ``module`` imports, anywhere in the file (lazy imports included)."""
    tree = ast.parse(MODULES[module].read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "dlo")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "dlo":
                continue
            for a in node.names:  # `from dlo.host import region` names a module
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else node.module)
    return {m for m in out if m != module}


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    mine = _layer(module)
    up = sorted(m for m in _imports(module) if _layer(m) > mine)
    assert not up, f"{module} (layer {mine}) imports a layer above it: {up}"


def test_no_import_cycles() -> None:
    graph = {m: {i for i in _imports(m) if i in MODULES} for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = [*stack[stack.index(n) :], n]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_the_size_limit(module: str) -> None:
    n = len(MODULES[module].read_text().splitlines())
    assert n <= MAX_LINES, f"{module} has {n} lines (at most {MAX_LINES}): split it by concern"


def test_the_design_module_map_names_every_module() -> None:
    """docs/design.md's module map lists every module by its path under dlo/, and nothing
    that does not exist."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    named: set[str] = set()
    package = ""
    for line in block.splitlines():
        if line[:1] not in ("", " "):  # a new row: a package (``name/``) or top-level files
            head = line.split()[0]
            package = head if head.endswith("/") else ""
        named.update(package + f for f in re.findall(r"\b([a-z_]+\.py)\b", line))
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    files = {f for f in files if not f.endswith("__init__.py") or f == "__init__.py"}
    assert named <= files, f"the module map names files that do not exist: {sorted(named - files)}"
    missing = sorted(files - named)
    assert not missing, f"docs/design.md's module map does not name: {missing}"
