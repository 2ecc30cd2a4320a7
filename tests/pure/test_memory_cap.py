"""dlo.platform.memory_cap with a stand-in for torch.cuda's fraction calls: budgets stack,
the smallest binds, any order of undo gives the process back its own fraction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dlo.platform.memory_cap as memory_cap

TOTAL = 100 << 30


@pytest.fixture
def fraction(monkeypatch: pytest.MonkeyPatch) -> dict[int, float]:
    state = {0: 0.9}  # the user's own cap on device 0
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: state[i])
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, i: state.__setitem__(i, f)
    )
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=TOTAL)
    )
    return state


@pytest.mark.parametrize("order", ["first-out", "last-out"])
def test_budgets_stack_and_unwind_in_any_order(fraction: dict[int, float], order: str) -> None:
    dev = torch.device("cuda", 0)
    undo_a = memory_cap.cap(dev, 40 << 30)
    assert fraction[0] == pytest.approx(0.4)
    undo_b = memory_cap.cap(dev, 60 << 30)
    assert fraction[0] == pytest.approx(0.4)  # the smallest budget binds
    assert undo_a is not None and undo_b is not None
    first, second = (undo_a, undo_b) if order == "first-out" else (undo_b, undo_a)
    first()
    first()  # idempotent
    assert fraction[0] == pytest.approx(0.6 if order == "first-out" else 0.4)
    second()
    assert fraction[0] == pytest.approx(0.9)  # the user's fraction, not 1.0
    assert memory_cap._CAPS == {} and memory_cap._BEFORE == {}


def test_a_budget_above_the_users_fraction_keeps_the_users(fraction: dict[int, float]) -> None:
    undo = memory_cap.cap(torch.device("cuda", 0), 95 << 30)
    assert fraction[0] == pytest.approx(0.9)
    assert undo is not None
    undo()


def test_a_torch_that_cannot_read_the_fraction_plans_without_a_cap(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    assert memory_cap.cap(torch.device("cuda", 0), 1 << 30) is None
    assert "does not cap the allocator" in caplog.text


def test_a_cap_that_fails_to_apply_leaves_no_entry_behind(
    fraction: dict[int, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = torch.device("cuda", 0)
    real = torch.cuda.set_per_process_memory_fraction

    def broken(f: float, i: int) -> None:
        raise RuntimeError("driver said no")

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", broken)
    with pytest.raises(RuntimeError, match="driver said no"):
        memory_cap.cap(dev, 10 << 30)
    assert memory_cap._CAPS == {} and memory_cap._BEFORE == {}
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", real)
    undo = memory_cap.cap(dev, 50 << 30)  # binds alone: the failed 10 GiB left nothing
    assert fraction[0] == pytest.approx(0.5) and undo is not None
    undo()
    assert fraction[0] == pytest.approx(0.9)
