"""The docs against the code: the generated tables of ``docs/reference.md``, the glossary's
setting values, and the names, paths and links the docs mention (their programs run in
``tests/cpu/test_user_guide.py``).

A config field, CLI flag or ``stats()`` key added without regenerating the reference
(``python -m tests.reference_tables``), a vocabulary value without a glossary row, or a doc
naming a module that moved fails here, so the docs cannot drift from the code unnoticed.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import dlo
from tests import reference_tables as rt

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GLOSSARY = DOCS / "glossary.md"
# the docs this test owns fully; design.md and benchmarks.md are checked for links only
OWN_DOCS = (DOCS / "user_guide.md", rt.REFERENCE, GLOSSARY)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- generated
@pytest.fixture(scope="module")
def reference_sections() -> dict[str, str]:
    return rt.read_sections(_read(rt.REFERENCE))


def test_reference_has_every_generated_section(reference_sections: dict[str, str]) -> None:
    known = set(rt.section_builders())
    assert set(reference_sections) == known, (
        f"docs/reference.md lacks generated sections {sorted(known - set(reference_sections))} "
        f"and has unknown ones {sorted(set(reference_sections) - known)}: add the marker "
        f"lines where each table belongs, then run {rt.REGENERATE}"
    )


@pytest.mark.parametrize("name", sorted(rt.section_builders()))
def test_generated_section_is_current(name: str, reference_sections: dict[str, str]) -> None:
    expected = rt.body(rt.section_builders()[name]())
    current = reference_sections.get(name)
    if current != expected:
        diff = "\n".join(
            difflib.unified_diff(
                (current or "").splitlines(), expected.splitlines(), "docs", "code", lineterm=""
            )
        )
        pytest.fail(
            f"docs/reference.md section {name!r} differs from the code: run {rt.REGENERATE}\n"
            + diff[:4000]
        )


@pytest.mark.parametrize("mode", sorted(rt.STATS_MEANINGS))
def test_every_stats_key_has_a_meaning(mode: str) -> None:
    keys = rt.stats_keys(mode)
    meanings = rt.STATS_MEANINGS[mode]
    missing = [k for k in keys if k not in meanings]
    stale = [k for k in meanings if k not in keys]
    assert not missing and not stale, (
        f"stats() of mode={mode!r}: keys without a meaning in tests/reference_tables.py "
        f"STATS_MEANINGS {missing}; meanings of keys stats() no longer has {stale}; fix the "
        f"dict, then run {rt.REGENERATE}"
    )


def test_every_offloading_mode_has_a_stats_table() -> None:
    modes = set(_vocabularies()["MODES"]) - {"none"}
    assert set(rt.STATS_MEANINGS) == modes == set(rt.STATS_CONFIGS)


def test_flag_notes_cover_exactly_the_flags_without_help() -> None:
    without_help = {
        (command, rt._flag(a))
        for command in rt.subcommands()
        for a in rt.flag_actions(command)
        if not a.help
    }
    add = sorted(without_help - set(rt.FLAG_NOTES))
    remove = sorted(set(rt.FLAG_NOTES) - without_help)
    assert not add and not remove, (
        f"tests/reference_tables.py FLAG_NOTES: add notes for {add}, remove {remove} (the "
        f"parser has help for them now, or they are gone), then run {rt.REGENERATE}"
    )


def _marked_table(marker: str) -> list[list[str]]:
    """The cells of the rows of the hand-written table right after ``<!-- marker -->``."""
    text = _read(rt.REFERENCE)
    tag = f"<!-- {marker} -->\n"
    assert tag in text, f"docs/reference.md lost its {tag.strip()} marker"
    table = text.split(tag, 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in row.strip("|").split("|")] for row in table.splitlines()[2:]]


def test_bench_methods_table_names_every_method() -> None:
    named = [row[0].strip("`") for row in _marked_table("bench-methods")]
    (methods,) = [a for a in rt.flag_actions("bench") if "--methods" in a.option_strings]
    assert sorted(named) == sorted(str(methods.default).split(",")), (
        "docs/reference.md's bench methods table must have one row per method of "
        "`dlo bench --methods`"
    )


def test_legacy_flags_table_matches_from_flags() -> None:
    rows = {
        r[0].strip("`"): ast.literal_eval(r[1].strip("`")) for r in _marked_table("legacy-flags")
    }
    # every flag from_flags knows: its refusal of an unknown flag lists them
    with pytest.raises(ValueError, match=r"known: (\[.*\])") as info:
        dlo.OffloadConfig.from_flags(not_a_flag=True)
    listed = re.search(r"known: (\[.*\])", str(info.value))
    assert listed is not None
    known = ast.literal_eval(listed.group(1))
    assert sorted(rows) == sorted(known), "docs/reference.md's legacy flags table is not every flag"
    for flag, default in rows.items():
        # a flag at its default selects nothing
        assert dlo.OffloadConfig.from_flags(**{flag: default}) == dlo.OffloadConfig.from_flags(), (
            flag
        )


# ----------------------------------------------------------------------------- glossary
# the closed vocabularies of the config fields; the module that holds them may move, so they
# are read from the module of OffloadConfig (which imports them) and, while it exists, from
# dlo.config.fields
REQUIRED_VOCABULARIES = (
    "MODES",
    "TRANSFERS",
    "GATHER_ENGINES",
    "GATHER_SYNCS",
    "HOST_BACKINGS",
    "PIN_FAILURE_POLICIES",
    "WEIGHT_AXES",
)
# values that are not config values but name a transfer in stats()
EXTRA_TERMS = ("swap",)


def _vocabularies() -> dict[str, tuple[str, ...]]:
    sources: list[ModuleType] = [
        sys.modules[cls.__module__]
        for cls in (dlo.OffloadConfig, dlo.LayerOptions, dlo.ParallelConfig)
    ]
    try:
        sources.append(importlib.import_module("dlo.config.fields"))
    except ImportError:
        pass  # moved: the module of OffloadConfig still imports the tuples it checks against
    found: dict[str, tuple[str, ...]] = {}
    for module in sources:
        for name, value in vars(module).items():
            if (
                re.fullmatch(r"[A-Z][A-Z0-9_]*", name)
                and isinstance(value, tuple)
                and value
                and all(isinstance(v, str) for v in value)
            ):
                found[name] = value
    return found


def _glossary_terms() -> set[str]:
    """The first cell of every glossary table row, each code span in it and each quoted
    value inside a code span (``num_slots="auto"`` gives ``auto``)."""
    terms: set[str] = set()
    for line in _read(GLOSSARY).splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cell = line.split("|")[1].strip()
        terms.add(cell)
        for span in re.findall(r"`([^`]+)`", cell):
            terms.add(span)
            terms.update(re.findall(r'"([^"]+)"', span))
    return terms


def test_config_vocabularies_are_found() -> None:
    missing = [n for n in REQUIRED_VOCABULARIES if n not in _vocabularies()]
    assert not missing, (
        f"vocabularies {missing} are not in {dlo.OffloadConfig.__module__} nor in "
        "dlo.config.fields: if they moved, point _vocabularies() in "
        "tests/pure/test_docs_reference.py at their new module"
    )


@pytest.mark.parametrize("name", sorted(_vocabularies()))
def test_every_vocabulary_value_is_a_glossary_term(name: str) -> None:
    terms = _glossary_terms()
    missing = [v for v in _vocabularies()[name] if v not in terms]
    assert not missing, f"docs/glossary.md has no row for {name} values {missing}"


def test_glossary_has_the_extra_terms() -> None:
    assert set(EXTRA_TERMS) <= _glossary_terms()


# ----------------------------------------------------------------------------- names, links
_DOTTED = re.compile(r"(?<![\w./-])dlo(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w./-])((?:dlo|tests|launch|docs)/[\w./-]*\w)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _resolve(name: str) -> Any:
    """The object a dotted name in the docs refers to: the longest importable module
    prefix, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # only this name (or a prefix of it) is not a module; a module that exists but
            # fails to import its own dependencies is an error to see
            if e.name is None or not (module_name + ".").startswith(e.name + "."):
                raise
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


@pytest.mark.parametrize("doc", OWN_DOCS, ids=lambda p: p.name)
def test_dotted_names_in_docs_resolve(doc: Path) -> None:
    bad = []
    for name in sorted(set(_DOTTED.findall(_read(doc)))):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            bad.append(f"{name} ({type(e).__name__}: {e})")
    assert not bad, f"{doc.name} names what the code no longer has: {bad}"


@pytest.mark.parametrize("doc", OWN_DOCS, ids=lambda p: p.name)
def test_paths_in_docs_exist(doc: Path) -> None:
    missing = sorted({p for p in _PATH.findall(_read(doc)) if not (ROOT / p).exists()})
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", OWN_DOCS, ids=lambda p: p.name)
def test_own_docs_are_ascii_and_stay_in_the_repository(doc: Path) -> None:
    text = _read(doc)
    assert text.isascii(), f"{doc.name} has non-ASCII characters"
    assert "../" not in text, f"{doc.name} points outside docs/ with '../'"


@pytest.mark.parametrize(
    "doc", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name
)
def test_links_resolve_inside_the_repository(doc: Path) -> None:
    bad = []
    for target in _LINK.findall(_read(doc)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the same page
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(target)
    assert not bad, f"{doc.name} links outside the repository or to missing files: {bad}"


def test_readme_lists_the_guide_and_the_reference() -> None:
    text = _read(ROOT / "README.md")
    assert "(docs/user_guide.md)" in text and "(docs/reference.md)" in text
