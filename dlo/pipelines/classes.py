"""Importing the classes a diffusers pipeline folder names, quietly.

:func:`import_class` resolves a ``model_index.json`` entry (library, class name) to a class,
or raises a :class:`~dlo.io.checkpoint.CheckpointError` naming the entry. The first import of
a diffusers or transformers class logs notices about optional packages a CPU-only machine
lacks; :func:`quiet_imports` drops exactly those while dlo imports (see
[Note: pipeline folders] in :mod:`dlo.pipelines.folder`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
from collections.abc import Iterator

from dlo.io.checkpoint import CheckpointError

_IMPORT_NOTICES = (
    ("torchao", re.compile(r"^Failed to load .*torchao.*\.so\b")),
    ("torchao.kernel.intmm", re.compile(r"Detected no triton")),
    ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported")),
    (
        "diffusers.quantizers.torchao.torchao_quantizer",
        re.compile(r"^Unable to import `torchao` Tensor objects"),
    ),
    ("transformers.utils.import_utils", re.compile(r"requires torchvision \(not installed\)")),
)
"""(logger, message) of what the first import of a diffusers or transformers class logs on a
machine without the optional packages it probes (torchvision, triton, torchao's compiled
kernels: a CPU-only torch), which say nothing about the user's job."""


class _DropNotice(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.search(record.getMessage()) is None


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Within: the notices of :data:`_IMPORT_NOTICES`, and nothing else, are dropped. For
    the library imports dlo itself makes: a record on another logger, another message on
    those loggers, or anything logged outside the block (the user's own imports) shows."""
    added = [(logging.getLogger(name), _DropNotice(pattern)) for name, pattern in _IMPORT_NOTICES]
    for log, drop in added:
        log.addFilter(drop)
    try:
        yield
    finally:
        for log, drop in added:
            log.removeFilter(drop)


def import_class(library: str, class_name: str, where: str) -> type:
    """``library.class_name``, or a CheckpointError naming ``where`` (the index entry): not
    installed, no such name, or a name that is not a class (``diffusers.utils``)."""
    try:
        with quiet_imports():
            found = getattr(importlib.import_module(library), class_name)
    except ImportError as e:
        raise CheckpointError(f"{where}: {library} is not installed ({e})") from e
    except AttributeError:
        raise CheckpointError(
            f"{where}: {library} has no class {class_name} (another {library} version wrote "
            "this folder?)"
        ) from None
    if not isinstance(found, type):
        raise CheckpointError(
            f"{where}: {library}.{class_name} is not a class (a {type(found).__name__})"
        )
    return found
