"""Progress bars on the long phases (building a model, packing host shards, the denoising loop,
each bench method): rank 0 only, on stderr, and only where stderr is a terminal, unless
``DLO_PROGRESS`` says otherwise (``1`` always, ``0`` never)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from dlo.platform.env import env_str

T = TypeVar("T")


def progress_enabled() -> bool:
    """Whether this process shows progress bars (see the module docstring)."""
    forced = env_str("DLO_PROGRESS")
    if forced is not None:
        return forced.strip() not in ("", "0", "false", "no")
    # RANK alone, read leniently: a progress bar never refuses a launcher's environment
    return (env_str("RANK") or "0").strip() == "0" and sys.stderr.isatty()


def progress(
    items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it", **kw: Any
) -> Iterator[T]:
    """``items``, with a progress bar when :func:`progress_enabled`."""
    if not progress_enabled():
        yield from items
        return
    from tqdm import tqdm

    kw.setdefault("leave", False)
    with tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, **kw) as bar:
        yield from bar


class _NoBar:
    """What :func:`progress_bar` returns when no bar is shown."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(
    *, total: int, desc: str, unit: str = "it", enabled: bool = True, **kw: Any
) -> Any:
    """A bar advanced by hand (``update(n)``, ``close()``) for a loop dlo does not drive (a
    callback per step); a no-op one unless ``enabled`` and :func:`progress_enabled`."""
    if not (enabled and progress_enabled()):
        return _NoBar()
    from tqdm import tqdm

    kw.setdefault("leave", False)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, **kw)
