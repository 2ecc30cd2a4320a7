"""Store records are JSON with a schema check, never pickle (:mod:`dlo.parallel.records`)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import pytest

from dlo.parallel.agreement import RankReport
from dlo.parallel.records import decode, encode
from dlo.runtime.measure import RankMeasurement


@dataclass
class Other:
    x: int = 0
    y: dict[str, float] = field(default_factory=dict)


def test_records_round_trip_with_tuples_and_dataclasses() -> None:
    report = RankReport(
        rank=1,
        ok=True,
        groups=(((0, 1),), ((0,), (1,))),
        settings=(("num_slots", 2), ("budget", None), ("ratio", float("inf"))),
    )
    assert decode(encode(report), [RankReport]) == report
    m = RankMeasurement(rank=0, h2d_bps=5.5e10, allgather_bps={"dp": 1e11})
    assert decode(encode(m), [RankMeasurement]) == m
    value = (False, "error text", [1, (2, 3)], {"k": (None,)})
    assert decode(encode(value)) == value


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (pickle.dumps(("x", 1)), "not JSON"),
        (b'{"__record__": "Other", "fields": {"x": 1, "y": {}}}', "not one this exchange accepts"),
        (
            b'{"__record__": "RankReport", "fields": {"rank": 0}}',
            r"has fields \['rank'\], expected",
        ),
        (b'{"__tuple__": 3}', "tuple tag is malformed"),
        (b'{"__record__": "RankReport"}', "record tag is malformed"),
    ],
)
def test_a_malformed_or_foreign_record_is_refused_naming_it(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode(data, [RankReport])


def test_only_plain_values_and_dataclasses_are_written() -> None:
    with pytest.raises(TypeError, match="cannot hold a set"):
        encode({"a": {1, 2}})
    with pytest.raises(TypeError, match="keys must be str"):
        encode({1: "a"})
    assert decode(encode(Other(3, {"a": 1.5})), [Other]) == Other(3, {"a": 1.5})


def test_nothing_dlo_reads_from_another_process_is_unpickled() -> None:
    """Issue 26 (2): the store has no authentication; a planted pickle would run code."""
    from pathlib import Path

    import dlo

    root = Path(dlo.__file__).parent
    users = [p for p in root.rglob("*.py") if "pickle.load" in p.read_text()]
    assert users == []
