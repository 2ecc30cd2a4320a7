"""Device budgets as allocator caps: every enabled budget on a CUDA device caps the process's
caching allocator at the smallest of them (``torch.cuda.set_per_process_memory_fraction``),
and the fraction the process had before the first one comes back when the last one goes
(see [Note: device budget] in :mod:`dlo.backends.auto`). Two backends with budgets, disabled
in any order, leave the cap of the one still enabled; a fraction the user set stays the
bound. Not thread-safe across enables of one device, as enable itself is not.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

_CAPS: dict[int, dict[int, int]] = {}
"""Device index -> {cap token: budget bytes} of the budgets in force."""

_BEFORE: dict[int, float] = {}
"""Device index -> the fraction before the first budget in force."""

_TOKENS = itertools.count()


def cap(device: torch.device, nbytes: int) -> Callable[[], None] | None:
    """Cap ``device``'s allocator at ``nbytes`` while the returned undo has not run (it is
    idempotent). None, with a warning, where this torch cannot read the current fraction
    (then it could not be given back)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get is None:
        logger.warning(
            "dlo: this torch cannot read the allocator's memory fraction: device_budget_gb "
            "plans the run but does not cap the allocator"
        )
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    caps = _CAPS.setdefault(index, {})
    if not caps:
        _BEFORE[index] = float(get(index))
    token = next(_TOKENS)
    caps[token] = nbytes
    try:
        _apply(index)
    except BaseException:  # no cap applied: no entry left to bind a later budget
        caps.pop(token, None)
        _forget_if_empty(index)
        raise
    done = False

    def undo() -> None:
        nonlocal done
        if not done:
            done = True
            caps.pop(token, None)
            _apply(index)

    return undo


def fraction(device: torch.device) -> float:
    """The fraction of ``device``'s memory the allocator may hold now (1.0 where this torch
    cannot say)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return float(get(index)) if get is not None else 1.0


def _apply(index: int) -> None:
    caps = _CAPS.get(index, {})
    before = _BEFORE.get(index, 1.0)
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min([before, *(n / total for n in caps.values())])
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    _forget_if_empty(index)


def _forget_if_empty(index: int) -> None:
    """No budget left on ``index``: the next first one reads the fraction afresh."""
    if not _CAPS.get(index):
        _CAPS.pop(index, None)
        _BEFORE.pop(index, None)
