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

[Note: interrupts during enable]
A KeyboardInterrupt can arrive between any two statements. A side effect and the record of
its undo are therefore one step: either the undo is recorded first and does nothing when
the effect did not happen, or both run inside :func:`atomic`, which defers SIGINT (in the
main thread, where Python delivers it, while Python's own handler is installed; a handler
of the application's is left to run) to the end of the outermost block. A tracer that
injects interrupts at every line (``launch/interrupt_probe.py``) asks :func:`masked`.

[Note: interrupts during disable]
``disable`` is the journal's rollback, and an interrupt during it is delivered between two
undos, never inside one: each undo is atomic and leaves the journal only once it has run.
The interrupted backend therefore stays enabled (``is_enabled()`` is True) with exactly the
remaining undos recorded, and calling ``disable()`` again finishes it, after which the model
is bitwise as before enable; an undo's failure is raised by the rollback that finishes. A
forward in between is refused while dlo's hooks are still installed (they are the first
undo) and otherwise fails on the empty placeholders: never wrong output. A
``disable(restore=True)`` interrupted while it gathers poisons the backend like any failed
restore (the ranks' gathers may be out of step): the rest of that disable still runs. Masking the whole rollback instead
would make Ctrl-C wait for every undo of a large model; the cleanup of a failed enable, which
no later call would resume, does run masked (:meth:`Journal.unwind`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

_MASK = threading.local()


def masked() -> bool:
    """True inside :func:`atomic` on this thread."""
    return getattr(_MASK, "depth", 0) > 0


@contextlib.contextmanager
def atomic() -> Iterator[None]:
    """Run the block to its end before a SIGINT takes effect (see [Note: interrupts during
    enable]): keep it to a side effect and the record of its undo."""
    depth = getattr(_MASK, "depth", 0)
    pending: list[int] = []
    previous: Any = None
    if depth == 0 and threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError):  # not the interpreter's main thread
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                previous = signal.signal(signal.SIGINT, lambda sig, _: pending.append(sig))
    _MASK.depth = depth + 1
    try:
        yield
    finally:
        _MASK.depth = depth
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
            if pending:
                raise KeyboardInterrupt


T = TypeVar("T")


class Journal:
    """An ordered record of mutations, each with its undo."""

    def __init__(self) -> None:
        self._undos: list[tuple[str, Callable[[], object]]] = []
        self._error: BaseException | None = None
        """The first undo failure of a rollback not finished yet."""

    def __len__(self) -> int:
        return len(self._undos)

    def record(self, what: str, undo: Callable[[], object]) -> None:
        """Record that ``what`` was done; ``undo`` reverses it."""
        self._undos.append((what, undo))

    def defer(self, what: str, undo: Callable[[], object]) -> None:
        """Record ``undo`` to run after every undo recorded so far (a fix-up that needs the
        earlier steps undone first, e.g. tensors put back where the restored ones went)."""
        self._undos.insert(0, (what, undo))

    def step(self, what: str, do: Callable[[], T], undo: Callable[[T], object]) -> T:
        """Run ``do`` and record ``undo(result)``; nothing is recorded if ``do`` raises."""
        result = do()
        self._undos.append((what, lambda: undo(result)))
        return result

    def rollback(self) -> None:
        """Undo every recorded step in reverse order; idempotent and resumable.

        Each undo runs in :func:`atomic` and is forgotten only once it returned, so an
        interrupt between two undos propagates with the rest still recorded, and rolling back
        again finishes (see [Note: interrupts during disable]).

        Raises:
            The first exception an undo raised, after all undos ran.
        """
        while self._undos:
            with atomic():
                what, undo = self._undos[-1]
                try:
                    undo()
                except BaseException as e:  # keep undoing; report the first failure
                    logger.error("dlo: undo of %r failed: %r", what, e)
                    if self._error is None:  # kept across an interrupted rollback
                        self._error = e
                self._undos.pop()
        first, self._error = self._error, None
        if first is not None:
            raise first

    def unwind(self) -> None:
        """:meth:`rollback` to its end even under repeated interrupts (delivered after it):
        the cleanup of a failed enable, which has nothing to resume it."""
        with atomic():
            self.rollback()
