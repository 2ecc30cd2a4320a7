"""Test-only fault-injection seam.

Runtime code calls :func:`check` at named points (``"pin_allocation"``,
``"slot_allocation"``, ``"manifest_build"``, ``"first_transfer"``, ...). When nothing is
armed the call is one truthiness test of an empty dict, so the seam costs nothing in
production. Tests arm a point with :func:`inject` (a context manager), optionally after a
number of passes, to prove that every step of a transactional install rolls back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dlo.errors import InjectedFault

# point name -> number of passes still allowed before raising
_ARMED: dict[str, int] = {}
# point name -> number of times check() reached it (only counted while anything is armed
# or counting is requested), used by tests to enumerate the points of a code path
_SEEN: dict[str, int] = {}
_COUNTING = False

POINTS = (
    "config_validated",
    "manifest_build",
    "host_allocation",
    "host_share",
    "pin_allocation",
    "host_fill",
    "encode",
    "slot_allocation",
    "staging_allocation",
    "device_placement",
    "hook_install",
    "agreement",
    "first_transfer",
    "decode",
    "commit",
    "block_forward",
)


def check(point: str) -> None:
    """Raise :class:`InjectedFault` if ``point`` is armed and its passes are used up."""
    if not _ARMED and not _COUNTING:
        return
    _SEEN[point] = _SEEN.get(point, 0) + 1
    left = _ARMED.get(point)
    if left is None:
        return
    if left <= 0:
        del _ARMED[point]
        raise InjectedFault(point)
    _ARMED[point] = left - 1


@contextlib.contextmanager
def inject(point: str, *, after: int = 0) -> Iterator[None]:
    """Arm ``point`` so that its ``after + 1``-th check raises, for the duration of the block."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known points: {', '.join(POINTS)}")
    _ARMED[point] = after
    try:
        yield
    finally:
        _ARMED.pop(point, None)


@contextlib.contextmanager
def count_points() -> Iterator[dict[str, int]]:
    """Record how many times each point is reached inside the block (for test enumeration)."""
    global _COUNTING
    _SEEN.clear()
    _COUNTING = True
    try:
        yield _SEEN
    finally:
        _COUNTING = False
