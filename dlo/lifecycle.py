"""The transactional install journal shared by every backend, and the base backend class.

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

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from dlo.errors import OffloadError

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


# component module -> (description of the backend that owns its offloading, its path there)
_CLAIMS: weakref.WeakKeyDictionary[nn.Module, tuple[str, str]] = weakref.WeakKeyDictionary()


def claim_components(
    components: Sequence[tuple[str, nn.Module]], owner: str, journal: Journal, *, rank: int = 0
) -> None:
    """Record that ``owner`` offloads these components; refuse if another backend does.

    At most one strategy owns offload hooks on a pipeline: a layerwise backend hooks blocks
    and a model-level backend hooks components, so per-module hook ownership alone would not
    stop the two from stacking. A component that contains, or lies inside, a component
    another backend claimed is refused too (a wrapper around an offloaded DiT holds the same
    weights). The claim is released by the journal.
    """
    for path, module in components:
        name = path or type(module).__name__
        other, _ = _CLAIMS.get(module, (None, ""))
        if other is not None and other != owner:
            raise OffloadError(
                f"component {name!r} is already offloaded by {other}; "
                "at most one strategy owns offload on a pipeline (disable it first)",
                rank=rank,
            )
        # a wrapper around an offloaded component, or a module inside one, is the same weights
        inside = {id(m) for m in module.modules()}
        for claimed, (other, other_path) in list(_CLAIMS.items()):
            if other == owner or claimed is module:
                continue
            if id(claimed) in inside:
                relation = "contains"
            elif any(m is module for m in claimed.modules()):
                relation = "is inside"
            else:
                continue
            raise OffloadError(
                f"component {name!r} {relation} component "
                f"{other_path or type(claimed).__name__!r} ({type(claimed).__name__}), which "
                f"{other} already offloads; at most one strategy owns offload on a model "
                "(disable it first)",
                rank=rank,
            )
    for path, module in components:
        _CLAIMS[module] = (owner, path)
        journal.record(f"claim {path}", functools.partial(_CLAIMS.pop, module, None))


class OffloadBackend:
    """Base class of every offload strategy.

    Subclasses implement :meth:`_install` (all mutations go through the journal) and
    :meth:`stats`. The base class provides the lifecycle: ``enable`` is transactional,
    ``disable`` is idempotent and undoes exactly what enable did.

    Example:
        >>> backend = dlo.get_offload_backend(cfg, par)
        >>> backend.enable(pipeline)
        >>> pipeline.generate(...)
        >>> backend.disable()
    """

    name = "base"

    def __init__(self) -> None:
        self._journal: Journal | None = None
        self._pipeline_ref: Any = None

    def is_enabled(self) -> bool:
        return self._journal is not None

    def enable(self, pipeline: Any) -> None:
        """Install offloading on ``pipeline``; on any failure nothing stays installed.

        Raises:
            dlo.OffloadError: already enabled, or a runtime failure during install.
            ValueError / TypeError: the pipeline's declarations cannot be served.
        """
        self._check_can_enable()
        journal = Journal()
        # [Note: no inference tensors] what enable and disable allocate (slots, staging,
        # restored weights) is written in place later, by other threads or outside an
        # inference_mode the caller may have entered: it must never be an inference tensor
        with torch.inference_mode(False):
            try:
                self._install(pipeline, journal)
            except BaseException:
                try:
                    journal.rollback()
                finally:
                    self._after_failed_enable()
                raise
        self._journal = journal
        self._pipeline_ref = pipeline

    def disable(self) -> None:
        """Remove everything enable installed; a no-op when not enabled."""
        journal, self._journal = self._journal, None
        self._pipeline_ref = None
        if journal is not None:
            with torch.inference_mode(False):  # [Note: no inference tensors]
                journal.rollback()

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    # ---------------------------------------------------------------- subclass API
    def _install(self, pipeline: Any, journal: Journal) -> None:
        raise NotImplementedError

    def _check_can_enable(self) -> None:
        if self._journal is not None:
            raise OffloadError(f"{self.name} offload is already enabled on this backend")

    def _after_failed_enable(self) -> None:
        """Hook for multi-rank backends to poison themselves after a failed startup."""
        return None
