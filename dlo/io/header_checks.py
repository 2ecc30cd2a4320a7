"""Checks of a safetensors header at least as strict as the safetensors library's: integer
shapes and offsets, unique keys, no two tensors' bytes overlapping; and the JSON parse every
file dlo reads goes through (:func:`loads_json`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot serve the model (bad file, missing/extra/mismatched tensors).

    Raised before anything is mutated; the message names the tensors and the files.
    """


def loads_json(raw: str | bytes, **kwargs: Any) -> Any:
    """``json.loads(raw, **kwargs)``, where JSON nested deeper than the parser recurses is a
    ``json.JSONDecodeError`` like any other text that is not JSON (``json`` raises a
    RecursionError, which callers catching bad JSON would let through as a traceback)."""
    try:
        return json.loads(raw, **kwargs)
    except RecursionError:
        err = json.JSONDecodeError("", raw if isinstance(raw, str) else "", 0)
        err.args = ("nested too deep to parse",)  # no position: the parser gave up, not failed
        raise err from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:  # json keeps the last; the safetensors library refuses
            raise _DuplicateKey(repr(key))
        out[key] = value
    return out


def _check_disjoint(path: Path, entries: dict[str, Any]) -> None:
    """No two tensors' bytes overlap (one tensor's bytes would be read as another's)."""
    spans = sorted((e.start, e.end, e.name) for e in entries.values() if e.nbytes)
    reach, owner = 0, ""
    for start, end, name in spans:
        if start < reach:
            raise CheckpointError(
                f"{path}: tensors {owner!r} and {name!r} overlap in the file (bytes "
                f"{start}..{min(end, reach)}); a safetensors file holds each tensor's bytes once"
            )
        if end > reach:
            reach, owner = end, name
