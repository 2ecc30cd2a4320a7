"""The install journal and the fault-injection seam."""

from __future__ import annotations

import pytest

from dlo import faults
from dlo.backends.base import OffloadBackend
from dlo.errors import InjectedFault, OffloadError
from dlo.journal import Journal


def test_journal_undoes_in_reverse_and_is_idempotent() -> None:
    log: list[str] = []
    j = Journal()
    j.record("a", lambda: log.append("undo a"))
    assert j.step("b", lambda: 41 + 1, lambda v: log.append(f"undo b {v}")) == 42
    j.record("c", lambda: log.append("undo c"))
    j.rollback()
    assert log == ["undo c", "undo b 42", "undo a"]
    j.rollback()
    assert log == ["undo c", "undo b 42", "undo a"]
    assert len(j) == 0


def test_failing_step_records_nothing() -> None:
    j = Journal()

    def boom() -> int:
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        j.step("boom", boom, lambda v: None)
    assert len(j) == 0


def test_failing_undo_still_runs_the_rest() -> None:
    log: list[str] = []
    j = Journal()
    j.record("a", lambda: log.append("a"))

    def bad() -> None:
        raise ValueError("undo failed")

    j.record("bad", bad)
    j.record("c", lambda: log.append("c"))
    with pytest.raises(ValueError, match="undo failed"):
        j.rollback()
    assert log == ["c", "a"]


class _Counting(OffloadBackend):
    """A backend whose install performs N journaled steps, each behind a fault point."""

    name = "counting"

    def __init__(self, state: list[int]) -> None:
        super().__init__()
        self.state = state

    def _install(self, pipeline: object, journal: Journal) -> None:
        for point in ("host_allocation", "pin_allocation", "slot_allocation", "hook_install"):
            faults.check(point)
            self.state.append(1)
            journal.record(point, self.state.pop)

    def stats(self) -> dict[str, int]:
        return {"steps": len(self.state)}


@pytest.mark.parametrize(
    "point", ["host_allocation", "pin_allocation", "slot_allocation", "hook_install"]
)
def test_backend_rolls_back_at_every_step(point: str) -> None:
    state: list[int] = []
    b = _Counting(state)
    with faults.inject(point), pytest.raises(InjectedFault) as info:
        b.enable(object())
    assert info.value.point == point
    assert state == [] and not b.is_enabled()
    b.enable(object())  # retry works
    assert state == [1, 1, 1, 1] and b.is_enabled()
    with pytest.raises(OffloadError, match="already enabled"):
        b.enable(object())
    b.disable()
    b.disable()
    assert state == [] and not b.is_enabled()


def test_inject_after_passes_and_unknown_point() -> None:
    seen = []
    with faults.inject("pin_allocation", after=2):
        for i in range(5):
            try:
                faults.check("pin_allocation")
                seen.append(i)
            except InjectedFault:
                break
    assert seen == [0, 1]
    faults.check("pin_allocation")  # disarmed
    with pytest.raises(ValueError, match="unknown fault point"), faults.inject("nope"):
        pass
