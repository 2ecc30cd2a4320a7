"""What the subcommands share: argument types, range checks, compiling the demo DiT."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from dlo.hooks.compiled import SUPPORTED_MODES

DTYPES = ("bfloat16", "float16", "float32")
PRESET_HELP = (
    "demo pipeline preset: tiny (seconds on a laptop CPU), medium (24 blocks, 8 GB), "
    "wan14b-like (40 blocks, 28 GB)"
)


def int_or_auto(text: str) -> int | str:
    """An int, or ``"auto"`` (the config checks the range and names the field)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or 'auto'") from None


COMPILE_MODES = SUPPORTED_MODES
"""The ``--compile`` modes (those dlo serves; CUDA-graph modes are refused)."""


def check_minimums(checks: Iterable[tuple[str, int | None, int]]) -> None:
    """Refuse a flag below its minimum: ``(flag, value, minimum)`` each, None skipped.

    Raises:
        ValueError: naming the flag, its value and the minimum.
    """
    for flag, value, minimum in checks:
        if value is not None and value < minimum:
            raise ValueError(f"{flag}={value} must be >= {minimum}")


def compile_blocks(dit: Any, mode: str | None) -> Any:
    """Regional compile, as diffusers' ``compile_repeated_blocks``: ``block.compile()`` on
    every block of the DiT (``mode=None``: no compile)."""
    if mode is not None:
        getattr(dit, "compile_repeated_blocks")(mode=None if mode == "default" else mode)  # noqa: B009
    return dit


def parity_word(parity: bool | None) -> str:
    """How a summary row says a ``--check`` result."""
    return {None: "not checked", True: "bitwise equal", False: "MISMATCH"}[parity]
