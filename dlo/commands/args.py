"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse

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
