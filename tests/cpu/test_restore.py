"""``disable(restore=True)``: AllGather blocks gathered back into ordinary tensors on their
original device, so the model runs without dlo and can be enabled again; without it, the
next forward of a released block is a dlo error naming the way out. Real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.errors import OffloadError
from dlo.host.region import LEDGER
from dlo.platform.device import CpuPlatform
from dlo.platform.env import process_rss_bytes
from tests.cpu.test_dlo import _cfg, _par, _steps
from tests.harness import assert_all_ok, run_ranks
from tests.toys import ToyDiT, TwoStackDiT, assert_same, clone, snapshot


def _restore_cycles(rank: int, world: int, cycles: int, resident: int) -> dict[str, Any]:
    model = TwoStackDiT(3, num_blocks2=2)
    ref = _steps(clone(model), rank, 2)
    before = snapshot(model)
    rss: list[int] = []
    same: list[bool] = []
    for _ in range(cycles):
        backend = LayerwiseBackend(_cfg(resident_layers=resident), _par(world), CpuPlatform())
        backend.enable(model)
        got = _steps(model, rank, 2)
        gathered = backend.stats()["allgather_nbytes"]
        backend.disable(restore=True)
        same.append(gathered > 0 and all(torch.equal(a, b) for a, b in zip(ref, got)))
        assert_same(before, model)  # same objects, shapes, strides, devices and bytes
        same[-1] = same[-1] and all(
            torch.equal(a, b)
            for a, b in zip(ref, _steps(model, rank, 2))  # without dlo
        )
        del backend
        rss.append(process_rss_bytes())
    return {
        "same": same,
        "rss": rss,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
        "hooks": [
            dlo.HookRegistry.owners_on(m) for m in model.modules() if dlo.HookRegistry.owners_on(m)
        ],
    }


@pytest.mark.parametrize("world, resident", [(2, 0), (2, 2), (3, 1)])
def test_restore_gives_back_the_model_bitwise(world: int, resident: int) -> None:
    res = assert_all_ok(run_ranks(_restore_cycles, world, 2, resident, timeout_s=120))
    assert all(all(r["same"]) for r in res), res
    assert all(r["ledger"] == (0, 0) and r["hooks"] == [] for r in res), res


def test_25_restore_cycles_are_bitwise_and_rss_stays_flat() -> None:
    res = assert_all_ok(run_ranks(_restore_cycles, 2, 25, 1, timeout_s=240))
    for r in res:
        assert all(r["same"]), r["same"]
        settled = r["rss"][4:]  # after the fifth cycle (allocator and caches warmed)
        assert max(settled) - min(settled) < 8 << 20, [x >> 20 for x in r["rss"]]


def _without_restore(rank: int, world: int) -> dict[str, Any]:
    model = ToyDiT(4)
    backend = LayerwiseBackend(_cfg(), _par(world), CpuPlatform())
    backend.enable(model)
    _steps(model, rank, 1)
    backend.disable()
    try:
        _steps(model, rank, 1)
        forward = "ran"
    except OffloadError as e:
        forward = str(e)
    try:
        LayerwiseBackend(_cfg(), _par(world), CpuPlatform()).enable(model)
        again = "enabled"
    except OffloadError as e:
        again = str(e)
    return {"forward": forward, "again": again}


def test_a_local_disable_leaves_a_clear_error_on_the_next_forward() -> None:
    res = assert_all_ok(run_ranks(_without_restore, 2, timeout_s=90))
    for r in res:
        assert "restore=True" in r["forward"] and "reload the model" in r["forward"], r
        assert "lost their weights" in r["again"], r


def _restore_inside_forward(rank: int, world: int) -> dict[str, Any]:
    model = ToyDiT(3)
    ref = _steps(clone(model), rank, 1)
    before = snapshot(model)
    backend = LayerwiseBackend(_cfg(), _par(world), CpuPlatform())
    backend.enable(model)
    seen: list[str] = []

    def hook(module: Any, args: Any) -> None:
        try:
            backend.disable(restore=True)
        except OffloadError as e:
            seen.append(str(e))

    # after dlo's own pre-hook (prepended): the block is claimed and running
    handle = model.blocks[1].register_forward_pre_hook(hook)
    during = _steps(model, rank, 1)  # the refused restore changed nothing in this forward
    handle.remove()
    backend.disable(restore=True)
    assert_same(before, model)
    after = _steps(model, rank, 1)  # restored: runs without dlo
    return {
        "refusal": seen[0] if seen else "not refused",
        "same": [torch.equal(a, b) for a, b in zip(ref + ref, during + after)],
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


def test_restore_from_inside_a_forward_is_refused_and_changes_nothing() -> None:
    res = assert_all_ok(run_ranks(_restore_inside_forward, 2, timeout_s=90))
    assert all("from inside a forward" in r["refusal"] for r in res), res
    assert all(r["same"] == [True, True] and r["ledger"] == (0, 0) for r in res), res
