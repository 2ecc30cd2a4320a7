"""The user guide and the reference against themselves and the code (issue 40 item 6): the
section lists against the headings, references to other sections, the torch CI installs,
what disabling an AllGather model takes, how transformers encoders stream, and the help of
``--chunk-mb``. Their programs run in ``tests/cpu/test_user_guide.py``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

import dlo
from dlo.plan import discovery
from tests import reference_tables as rt
from tests.toys import ToyDiT

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "user_guide.md"
REFERENCE = ROOT / "docs" / "reference.md"
OWN = (GUIDE, REFERENCE)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """``text`` with its fenced code blocks blanked (line numbers kept)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def _headings(text: str) -> list[tuple[int, str, str]]:
    """``(offset, number or "", title)`` of every ``##``-``####`` heading."""
    out = []
    for m in re.finditer(r"^#{2,4} (?:(\d+)\. )?(.+)$", _prose(text), re.M):
        out.append((m.start(), m.group(1) or "", m.group(2).strip()))
    return out


def _sections(path: Path) -> list[tuple[str, str]]:
    """``(number, title)`` of the numbered ``##`` sections."""
    return re.findall(r"^## (\d+)\. (.+)$", _prose(_read(path)), re.M)


def _statements(path: Path) -> list[str]:
    """The prose of ``path`` cut into statements: paragraphs, list items and table rows."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", _prose(_read(path))):
        current: list[str] = []
        for line in para.splitlines():
            if re.match(r"\s*(?:- |\||\d+\. )", line) and current:
                out.append(" ".join(current))
                current = []
            current.append(line.strip())
        if current:
            out.append(" ".join(current))
    return out


# ----------------------------------------------------------------------------- structure
def test_the_guides_section_list_is_its_headings() -> None:
    text = _prose(_read(GUIDE))
    m = re.search(r"^Sections: (.+?)\n\n", text, re.S | re.M)
    assert m is not None, "user_guide.md lost its 'Sections: ...' list"
    listed = [
        tuple(item.strip().rstrip(".").split(". ", 1))
        for item in " ".join(m.group(1).split()).split("; ")
    ]
    assert listed == _sections(GUIDE)


def test_the_references_contents_are_its_headings() -> None:
    text = _prose(_read(REFERENCE))
    m = re.search(r"^Contents:\n\n((?:\d+\. .+\n)+)", text, re.M)
    assert m is not None, "reference.md lost its 'Contents:' list"
    listed = re.findall(r"^(\d+)\. (.+)$", m.group(1), re.M)
    sections = _sections(REFERENCE)
    assert [n for n, _ in listed] == [n for n, _ in sections]
    for (n, item), (_, title) in zip(listed, sections):
        assert item == title or item.startswith(title + ":"), (n, item, title)


def test_the_readme_names_every_task_of_the_guide() -> None:
    m = re.search(r"\(docs/user_guide\.md\): the tasks in order: (.+)", _read(ROOT / "README.md"))
    assert m is not None, "README.md's documentation list lost the guide's tasks"
    assert len(m.group(1).split(", ")) == len(_sections(GUIDE)), m.group(1)


@pytest.mark.parametrize("doc", OWN, ids=lambda p: p.name)
def test_below_and_above_point_the_right_way(doc: Path) -> None:
    """A ``"Title" below`` names a later heading of the same page, ``"Title" above`` an
    earlier one."""
    text = _prose(_read(doc))
    headings = _headings(text)
    wrong = []
    for m in re.finditer(r'"([^"]+)" (below|above)', text):
        title, where = m.group(1), m.group(2)
        at = [off for off, _, t in headings if t == title]
        later = [off for off in at if off > m.start()]
        if not at or (where == "below") != bool(later):
            wrong.append(
                f'"{title}" {where} (headings named so at {at}, the mention at {m.start()})'
            )
    assert not wrong, f"{doc.name}: {wrong}"


@pytest.mark.parametrize("doc", OWN, ids=lambda p: p.name)
def test_section_references_name_real_sections(doc: Path) -> None:
    """``section N`` is a numbered section of the same page (``reference.md, section N`` of
    the reference), and ``section N, "Title"`` carries that section's title."""
    own = dict(_sections(doc))
    reference = dict(_sections(REFERENCE))
    wrong = []
    for m in re.finditer(r'(reference\.md, )?section (\d+)(?:, "([^"]+)")?', _prose(_read(doc))):
        sections = reference if m.group(1) else own
        title = sections.get(m.group(2))
        if title is None or (m.group(3) is not None and m.group(3) != title):
            wrong.append(m.group(0))
    assert not wrong, f"{doc.name}: {wrong}"


# ----------------------------------------------------------------------------- install
def test_the_guides_torch_install_is_the_one_ci_and_the_readme_pin() -> None:
    ci = re.findall(r"pip install -q torch==(\S+)", _read(ROOT / ".ci" / "run"))
    readme = re.findall(r"pip install torch==([0-9][\w.]*[0-9])", _read(ROOT / "README.md"))
    assert len(set(ci)) == 1 and set(readme) == set(ci), (ci, readme)
    guide = re.findall(r"pip install torch(?:==([0-9][\w.]*[0-9]))?\b", _read(GUIDE))
    assert guide and set(guide) == set(ci), f"the guide installs torch {guide}, CI {ci[0]}"


# ----------------------------------------------------------------------------- claims
@pytest.mark.parametrize("doc", OWN, ids=lambda p: p.name)
def test_every_reload_of_an_allgather_model_names_the_restore(doc: Path) -> None:
    """Where a statement says an AllGather model must be reloaded, it also names
    ``disable(restore=True)``, which rebuilds one ([Note: what disable restores])."""
    bare = [
        s
        for s in _statements(doc)
        if "reload" in s.lower() and "allgather" in s.lower() and "restore=True" not in s
    ]
    assert not bare, f"{doc.name}: reloading named without disable(restore=True): {bare}"


@pytest.mark.parametrize("doc", OWN, ids=lambda p: p.name)
def test_statements_on_no_split_encoders_name_the_components_that_stream_them(
    doc: Path,
) -> None:
    """An encoder found from its ``_no_split_modules`` streams only when ``components``
    names ``"encoder"``, or when the policy decides residency and the DiT needs its memory
    (the behaviour is the next test): a statement on such encoders names one or the other."""
    bare = [
        s
        for s in _statements(doc)
        if "encoder" in s
        and "_no_split_modules" in s
        and not re.search(r'components.*"encoder"', s)
        and "encoders kept or streamed" not in s
    ]
    assert not bare, f"{doc.name}: {bare}"


class _Pipeline(dlo.SupportsComponentDiscovery):
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]

    def __init__(self, text_encoder: nn.Module) -> None:
        self.transformer = ToyDiT(num_blocks=2)
        self.text_encoder = text_encoder


def test_a_transformers_encoder_stays_whole_unless_components_or_the_policy_streams_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=8,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    with torch.device("meta"):
        pipe = _Pipeline(CLIPTextModel(config))
    monkeypatch.setattr(discovery, "_logged_messages", set())  # the warning is said once
    with caplog.at_level(logging.WARNING):
        plan = dlo.resolve_offload_plan(pipe, dlo.OffloadConfig(mode="layer"))
    assert [s.component for s in plan.stacks] == ["dit"]
    assert "kept whole on the device" in caplog.text
    # the policy decides residency: the encoder is offered to it, marked optional
    plan = dlo.resolve_offload_plan(pipe, dlo.OffloadConfig(resident_layers="auto"))
    assert [(s.component, s.optional) for s in plan.stacks] == [("dit", False), ("encoder", True)]
    assert "components=('dit', 'encoder')" in caplog.text
    cfg = dlo.OffloadConfig(mode="layer", components=("dit", "encoder"))
    plan = dlo.resolve_offload_plan(pipe, cfg)
    (encoder,) = [s for s in plan.stacks if s.component == "encoder"]
    assert (encoder.container_path, encoder.found_by) == (
        "text_encoder.encoder.layers",
        "_no_split_modules",
    )


def test_chunk_mb_help_is_the_fields_meaning() -> None:
    """``--chunk-mb`` sets ``OffloadConfig.chunk_mb``, the chunk of every transfer: its help
    opens with the field's meaning."""
    head = rt.field_docs(dlo.OffloadConfig)["chunk_mb"].split(":", 1)[0]
    (action,) = [a for a in rt.flag_actions("run") if "--chunk-mb" in a.option_strings]
    assert (action.help or "").lower().startswith(head.lower()), (head, action.help)
