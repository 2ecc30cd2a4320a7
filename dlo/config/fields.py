"""The closed vocabularies of config fields and the checks every field goes through (a bad
value raises ``TypeError``/``ValueError`` naming the field and the value).
"""

from __future__ import annotations

import math
from typing import Any

MIB = 1 << 20
GIB = 1 << 30

MODES = ("none", "module", "layer")


COMPONENTS = ("dit", "encoder")
"""The component kinds dlo offloads (the canonical names)."""
COMPONENT_ALIASES = {"dit": "dit", "encoder": "encoder", "text_encoder": "encoder", "vae": "vae"}
"""What ``components`` and ``layer_options`` accept: the seeds' names as written
(``"text_encoder"`` is ``"encoder"``; ``"vae"`` selects nothing to offload: VAEs stay
device resident in every mode)."""


TRANSFERS = ("rank-local", "allgather", "node-shared", "auto")


GATHER_ENGINES = ("nccl", "copy", "auto")


GATHER_SYNCS = ("auto", "stream", "kernel")


HOST_BACKINGS = ("region", "mapped")
CODECS = ("none", "ans", "auto")


PIN_FAILURE_POLICIES = ("fail", "whole_block_fallback")


WEIGHT_AXES = ("auto", "shard", "data", "sequence", "local")


# ----------------------------------------------------------------------------- checks
def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def _check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    # bool is an int subclass: True where a count is expected is a bug, not a 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_int_or_auto(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, str):
        if value != "auto":
            raise TypeError(f"{name} must be an int or 'auto', got {value!r} (str)")
        return
    _check_int(name, value, minimum=minimum, maximum=maximum)


MAX_SLOTS = 1024
"""More device slots than any model has streamed blocks (a million once allocated 14 GB
of host memory and kept going)."""

MAX_CHUNK_MB = 1 << 16
"""64 GiB: larger than any block."""


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r} ({type(value).__name__})")
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def _gib_nbytes(gib: float | None) -> int | None:
    """``gib`` GiB in bytes (None stays None)."""
    return int(gib * GIB) if gib is not None else None


def _check_positive_number(
    name: str, value: Any, *, maximum: float = 1e7, zero: bool = False
) -> None:
    """A number in ``(0, maximum]`` (``[0, maximum]`` with ``zero``): the bound keeps a value
    that would overflow later (a timeout in ms as a C int, GB as bytes) an error here,
    naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... (too large)"
    if not finite or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be a finite number {'>=' if zero else '>'} 0, got {shown}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum:g}, got {shown}")
