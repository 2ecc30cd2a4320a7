"""Host threads that must stop while the interpreter is still whole: the staging filler and
the disk tier's reader (see [Note: staging filler at exit] in :mod:`dlo.runtime.staged`)."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)

EXIT_JOIN_S = 30.0
"""How long interpreter exit waits for each thread."""


class Stoppable(Protocol):
    thread_name: str

    def stop_thread(self, timeout_s: float | None = None) -> bool:
        """Let the thread finish what it is doing and return; whether it has stopped."""
        ...


_LIVE: weakref.WeakSet[Stoppable] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def _stop_all() -> None:
    for owner in list(_LIVE):
        if not owner.stop_thread(EXIT_JOIN_S):
            logger.warning(
                "dlo: the %s thread did not stop within %.0f s at exit",
                owner.thread_name,
                EXIT_JOIN_S,
            )


def track(owner: Stoppable) -> None:
    """Stop ``owner``'s thread at interpreter exit, unless :func:`untrack` ed first."""
    global _registered
    with _lock:
        _LIVE.add(owner)
        if not _registered:
            atexit.register(_stop_all)
            _registered = True


def untrack(owner: Stoppable) -> None:
    _LIVE.discard(owner)
