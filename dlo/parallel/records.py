"""The records ranks exchange through the store, as JSON with a schema check: no pickle on a
path another process feeds (the store has no authentication, and unpickling a
planted record would run its code on every rank).

A record is a JSON value built from ``None``, ``bool``, ``int``, ``float``, ``str``, lists,
tuples (tagged, so they come back as tuples), dicts with ``str`` keys, and instances of the
dataclasses the caller names (tagged with their class name; decoding accepts only those
classes and exactly their fields). Anything else is refused when encoding (``TypeError``)
and when decoding (``ValueError`` naming what was wrong), so a malformed or foreign record
ends the exchange with an error instead of running or half-filling anything.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

_TUPLE = "__tuple__"
_RECORD = "__record__"
_FIELDS = "fields"


def encode(obj: Any) -> bytes:
    """``obj`` as JSON bytes (see the module docstring for what it may hold)."""
    return json.dumps(_plain(obj), allow_nan=True, separators=(",", ":")).encode()


def decode(data: bytes, types: Iterable[type] = ()) -> Any:
    """The value :func:`encode` wrote; dataclass records only of ``types``.

    Raises:
        ValueError: not JSON, an unknown record type, a record whose fields are not exactly
            its class's, or a tag of the wrong shape.
    """
    allowed = {t.__name__: t for t in types}
    try:
        value = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"a store record is not JSON: {e}") from None
    return _restore(value, allowed)


def _plain(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {_TUPLE: [_plain(v) for v in obj]}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"a store record's dict keys must be str, got {list(obj)!r}")
        if _TUPLE in obj or _RECORD in obj:
            raise TypeError(f"a store record's dict may not use the key {_TUPLE!r}/{_RECORD!r}")
        return {k: _plain(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {_RECORD: type(obj).__name__, _FIELDS: fields}
    raise TypeError(f"a store record cannot hold a {type(obj).__name__} ({obj!r})")


def _restore(value: Any, allowed: dict[str, type]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_restore(v, allowed) for v in value]
    if not isinstance(value, dict):
        raise ValueError(f"a store record holds a {type(value).__name__}")
    if _TUPLE in value:
        items = value[_TUPLE]
        if len(value) != 1 or not isinstance(items, list):
            raise ValueError(f"a store record's tuple tag is malformed: {value!r}")
        return tuple(_restore(v, allowed) for v in items)
    if _RECORD in value:
        return _record(value, allowed)
    return {k: _restore(v, allowed) for k, v in value.items()}


def _record(value: dict[str, Any], allowed: dict[str, type]) -> Any:
    name, fields = value.get(_RECORD), value.get(_FIELDS)
    if set(value) != {_RECORD, _FIELDS} or not isinstance(fields, dict):
        raise ValueError(f"a store record's record tag is malformed: {sorted(value)}")
    cls = allowed.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"a store record of type {name!r} is not one this exchange accepts "
            f"({sorted(allowed) or 'none'})"
        )
    want = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != want:
        raise ValueError(
            f"a store record {name} has fields {sorted(fields)}, expected {sorted(want)}"
        )
    return cls(**{k: _restore(v, allowed) for k, v in fields.items()})
