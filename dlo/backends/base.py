"""The base class of every backend, and the component claims that keep one strategy per
pipeline.

``enable`` runs a backend's ``_install`` through one :class:`~dlo.journal.Journal` and keeps
it; ``disable`` rolls the same journal back (see [Note: one journal for enable and disable]
in :mod:`dlo.journal`).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dlo.errors import OffloadError
from dlo.journal import Journal, atomic

logger = logging.getLogger(__name__)


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
        with atomic():  # [Note: interrupts during enable] in dlo.journal
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
                with atomic():  # enabled exactly when installed
                    self._journal = journal
                    self._pipeline_ref = pipeline
            except BaseException:
                self._journal = self._pipeline_ref = None
                try:
                    journal.unwind()
                finally:
                    self._after_failed_enable()
                raise

    def disable(self, *, restore: bool = False) -> None:
        """Remove everything enable installed; a no-op when not enabled.

        ``restore=True`` also rebuilds weights that only a collective can rebuild (the
        layerwise backend's AllGather blocks); backends that keep whole copies always
        restore them. An interrupt leaves it enabled with what is left to undo (forwards
        refused or failing, never wrong): call it again to finish ([Note: interrupts during
        disable] in :mod:`dlo.journal`)."""
        journal = self._journal
        if journal is None:
            return
        try:
            with torch.inference_mode(False):  # [Note: no inference tensors]
                journal.rollback()
        finally:
            if not len(journal):  # else interrupted: [Note: interrupts during disable]
                with atomic():
                    self._journal = self._pipeline_ref = None
                    self._forget()

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

    def _forget(self) -> None:
        """Hook: drop what the install built once its rollback has finished (runs in
        :func:`~dlo.journal.atomic`, with the journal's own release)."""
        return None
