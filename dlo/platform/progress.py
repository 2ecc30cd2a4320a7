"""Progress on the long phases (building a model, reading a checkpoint, encoding and packing
host shards, writing a checkpoint, the denoising loop, each bench row): the one place that
decides how progress is shown. Rank 0 only, on stderr, in one of two styles:

* ``bar``: tqdm bars, where stderr is a terminal;
* ``lines``: plain periodic lines where it is not (logs, ``torchrun``, CI), no control
  characters: ``dlo: encode 12/24 blocks (50%), 30 s`` at most every
  :data:`LINE_INTERVAL_S` seconds, and a last line at the end of a phase that lasted that
  long (a shorter phase prints nothing).

``DLO_PROGRESS`` overrides the choice: ``bar`` (or ``1``) bars even into a file, ``lines``
lines even in a terminal, ``0`` (or ``off``) nothing; unset or ``auto``, the choice above.
Other ranks never show progress.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

from dlo.platform.env import env_str

T = TypeVar("T")

logger = logging.getLogger(__name__)

Style = Literal["bar", "lines", "off"]

LINE_INTERVAL_S = 15.0
"""Seconds between two plain lines of one phase (the ``lines`` style)."""

_OFF = ("0", "off", "false", "no", "none")
_BAR = ("bar", "1", "on", "true", "yes")
_warned: set[str] = set()


def progress_style() -> Style:
    """How this process shows progress: ``"bar"``, ``"lines"`` or ``"off"`` (see the module
    docstring)."""
    forced = (env_str("DLO_PROGRESS") or "").strip().lower()
    # RANK alone, read leniently: progress never refuses a launcher's environment
    if forced in _OFF or (env_str("RANK") or "0").strip() != "0":
        return "off"
    if forced in _BAR:
        return "bar"
    if forced == "lines":
        return "lines"
    if forced not in ("", "auto") and forced not in _warned:
        _warned.add(forced)
        logger.warning("DLO_PROGRESS=%r: expected bar, lines, 0 or auto; using auto", forced)
    return "bar" if sys.stderr.isatty() else "lines"


def progress_enabled() -> bool:
    """Whether this process shows progress at all (see the module docstring)."""
    return progress_style() != "off"


class _Lines:
    """Plain progress lines on stderr: at most one per ``interval_s`` (``clock`` seconds, read
    at each ``update``), and a last one at :meth:`close` for a phase that lasted
    ``interval_s`` (none that would repeat the line before)."""

    def __init__(
        self,
        *,
        total: int | None,
        desc: str,
        unit: str,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.interval_s = LINE_INTERVAL_S if interval_s is None else interval_s
        self.clock = clock
        self.n = 0
        self.start = self.last = clock()
        self.printed: int | None = None  # n at the last line
        self.closed = False
        self._lock = threading.Lock()  # reads advance it from their pool's threads

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
            now = self.clock()
            finished = self.total is not None and self.n >= self.total  # close says it
            if not (self.closed or finished) and now - self.last >= self.interval_s:
                self._write(now)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            now = self.clock()
            # the last line only where it says something: the first of a phase that lasted
            # the interval, or a count newer than the last line's
            first = self.printed is None and now - self.start >= self.interval_s
            newer = self.printed is not None and self.printed != self.n
            if first or newer:
                self._write(now)

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, now: float) -> None:
        self.last, self.printed = now, self.n
        print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        """``desc n/total units (pct%), elapsed`` (``, done`` once the total is reached)."""
        if self.unit == "B":
            gib = float(1 << 30)
            count = f"{self.n / gib:.2f}" + (f"/{self.total / gib:.2f}" if self.total else "")
            count += " GiB"
        else:
            plural = self.unit if self.unit == "it" else f"{self.unit}s"
            count = f"{self.n}" + (f"/{self.total}" if self.total else "") + f" {plural}"
        if self.total:
            count += f" ({100 * self.n // self.total}%)"
        done = ", done" if self.closed and self.total and self.n >= self.total else ""
        return f"{self.desc} {count}, {now - self.start:.0f} s{done}"


def progress(
    items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it", **kw: Any
) -> Iterator[T]:
    """``items``, with progress shown as :func:`progress_style` says (an item counts once
    the loop asks for the next one)."""
    style = progress_style()
    if style == "off":
        yield from items
        return
    if style == "lines":
        if total is None and isinstance(items, Sized):
            total = len(items)
        with _Lines(total=total, desc=desc, unit=unit) as lines:
            for item in items:
                yield item
                lines.update(1)
        return
    from tqdm import tqdm

    kw.setdefault("leave", False)
    with tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, **kw) as bar:
        yield from bar


class _NoBar:
    """What :func:`progress_bar` returns when no progress is shown."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(
    *, total: int, desc: str, unit: str = "it", enabled: bool = True, **kw: Any
) -> Any:
    """A bar advanced by hand (``update(n)``, ``close()``) for a loop dlo does not drive (a
    callback per step): a tqdm bar or plain lines as :func:`progress_style` says; a no-op one
    unless ``enabled``. ``kw`` goes to tqdm (``unit_scale``, ``leave``)."""
    style = progress_style() if enabled else "off"
    if style == "off":
        return _NoBar()
    if style == "lines":
        return _Lines(total=total, desc=desc, unit=unit)
    from tqdm import tqdm

    kw.setdefault("leave", False)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, **kw)


@contextmanager
def library_bars() -> Iterator[None]:
    """The Hugging Face libraries' own tqdm bars (transformers' "Writing model shards",
    huggingface_hub's) only where this process shows bars: a log gets no control characters
    from a call dlo makes into them. Their previous setting comes back at the exit."""
    if progress_style() == "bar":
        yield
        return
    undo: list[Callable[[], None]] = []
    for module, off, on in (
        ("transformers.utils.logging", "disable_progress_bar", "enable_progress_bar"),
        ("huggingface_hub.utils", "disable_progress_bars", "enable_progress_bars"),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        was_on = (
            mod.is_progress_bar_enabled()
            if hasattr(mod, "is_progress_bar_enabled")
            else not mod.are_progress_bars_disabled()
        )
        if was_on:
            getattr(mod, off)()
            undo.append(getattr(mod, on))
    try:
        yield
    finally:
        for f in undo:
            f()
