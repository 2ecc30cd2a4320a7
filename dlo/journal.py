"""The transactional install journal every backend (and the checkpoint loader) records its
mutations in.

[Note: one journal for enable and disable]
``enable`` performs every mutation (host storage, pinning, device placement, hooks, slot
allocation) through a :class:`Journal`: each step is recorded together with the function
that undoes it. If any step raises, the journal runs the undos in reverse order and the
exception propagates unchanged, so a single-rank model is exactly as before and the enable
can be retried. When enable succeeds the journal is kept, and ``disable`` is simply the same
rollback: there is one code path that takes dlo out of a model, exercised by every failure
test, instead of a second "teardown" path that could drift from the install.

An undo must not raise in normal operation; if one does, the remaining undos still run and
the first error is re-raised at the end (after everything possible was restored).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)


T = TypeVar("T")


class Journal:
    """An ordered record of mutations, each with its undo."""

    def __init__(self) -> None:
        self._undos: list[tuple[str, Callable[[], object]]] = []

    def __len__(self) -> int:
        return len(self._undos)

    def record(self, what: str, undo: Callable[[], object]) -> None:
        """Record that ``what`` was done; ``undo`` reverses it."""
        self._undos.append((what, undo))

    def step(self, what: str, do: Callable[[], T], undo: Callable[[T], object]) -> T:
        """Run ``do`` and record ``undo(result)``; nothing is recorded if ``do`` raises."""
        result = do()
        self._undos.append((what, lambda: undo(result)))
        return result

    def rollback(self) -> None:
        """Undo every recorded step in reverse order; idempotent.

        Raises:
            The first exception an undo raised, after all undos ran.
        """
        first: BaseException | None = None
        while self._undos:
            what, undo = self._undos.pop()
            try:
                undo()
            except BaseException as e:  # keep undoing; report the first failure
                logger.error("dlo: undo of %r failed: %r", what, e)
                if first is None:
                    first = e
        if first is not None:
            raise first
