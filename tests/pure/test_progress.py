"""Progress (issue 40, item 3): bars in a terminal, plain periodic lines elsewhere (logs,
torchrun, CI), ``DLO_PROGRESS`` to choose, rank 0 only, and the choice documented."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from dlo.platform import progress as pr

ROOT = Path(__file__).resolve().parents[2]


class _Stderr(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("value", "rank", "tty", "style"),
    [
        (None, None, True, "bar"),
        (None, None, False, "lines"),  # a log file, torchrun's pipes, CI
        ("auto", "0", False, "lines"),
        ("lines", None, True, "lines"),
        ("bar", None, False, "bar"),
        ("1", None, False, "bar"),  # the old "always"
        ("0", None, True, "off"),
        ("off", None, False, "off"),
        (None, "1", True, "off"),  # other ranks never
        ("lines", "3", False, "off"),
    ],
)
def test_the_style_follows_the_terminal_the_rank_and_dlo_progress(
    monkeypatch: pytest.MonkeyPatch, value: str | None, rank: str | None, tty: bool, style: str
) -> None:
    for name, v in (("DLO_PROGRESS", value), ("RANK", rank)):
        if v is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, v)
    monkeypatch.setattr(sys, "stderr", _Stderr(tty))
    assert pr.progress_style() == style


def test_lines_come_at_most_every_interval_and_once_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err = _Stderr(False)
    monkeypatch.setattr(sys, "stderr", err)
    now = [100.0]
    lines = pr._Lines(
        total=24, desc="dlo: encode", unit="block", interval_s=10, clock=lambda: now[0]
    )
    for _ in range(24):  # a block every 1.5 s: 36 s in all
        now[0] += 1.5
        lines.update(1)
    lines.close()
    lines.close()  # once
    assert err.getvalue().splitlines() == [
        "dlo: encode 7/24 blocks (29%), 10 s",
        "dlo: encode 14/24 blocks (58%), 21 s",
        "dlo: encode 21/24 blocks (87%), 32 s",
        "dlo: encode 24/24 blocks (100%), 36 s, done",
    ]


def test_a_phase_shorter_than_the_interval_prints_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Stderr(False)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delenv("DLO_PROGRESS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert list(pr.progress(range(5), desc="dlo: quick", unit="block")) == [0, 1, 2, 3, 4]
    bar = pr.progress_bar(total=3 << 30, desc="dlo: reading weights", unit="B", unit_scale=True)
    bar.update(3 << 30)
    bar.close()
    assert err.getvalue() == ""


def test_lines_are_plain_text_with_bytes_in_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Stderr(False)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("DLO_PROGRESS", "lines")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(pr, "LINE_INTERVAL_S", 0.0)
    bar = pr.progress_bar(total=4 << 30, desc="dlo: reading weights", unit="B", unit_scale=True)
    bar.update(1 << 30)
    bar.update(3 << 30)
    bar.close()
    for _ in pr.progress(iter(range(2)), desc="dlo: random weights", unit="tensor"):
        pass
    text = err.getvalue()
    assert text.splitlines()[:2] == [
        "dlo: reading weights 1.00/4.00 GiB (25%), 0 s",
        "dlo: reading weights 4.00/4.00 GiB (100%), 0 s, done",
    ]
    assert "dlo: random weights 2 tensors, 0 s" in text  # no total: a count
    assert "\r" not in text and "\x1b" not in text


def test_dlo_progress_is_in_the_user_docs() -> None:
    guide = (ROOT / "docs" / "user_guide.md").read_text(encoding="utf-8")
    assert "DLO_PROGRESS" in guide
    paragraph = guide[guide.index("DLO_PROGRESS") - 600 : guide.index("DLO_PROGRESS") + 600]
    for word in ("lines", "bar", "terminal"):
        assert word in paragraph, word


def test_library_bars_are_off_in_a_log_and_come_back_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers 5.25's save_pretrained draws a "Writing model shards" tqdm bar: a log
    (lines style) must get none from a call dlo makes, and the user's setting comes back."""
    hf_logging = pytest.importorskip("transformers.utils.logging")
    monkeypatch.setenv("DLO_PROGRESS", "lines")
    monkeypatch.delenv("RANK", raising=False)
    hf_logging.enable_progress_bar()
    with pr.library_bars():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the user's own choice is kept as it was
    with pr.library_bars():
        assert not hf_logging.is_progress_bar_enabled()
    assert not hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    monkeypatch.setenv("DLO_PROGRESS", "bar")
    with pr.library_bars():
        assert hf_logging.is_progress_bar_enabled()
