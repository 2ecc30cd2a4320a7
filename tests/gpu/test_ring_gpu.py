"""The ring on one CUDA GPU: parity, pinned ledger, no steady-state allocation, event
ordering under a delayed copy stream, overlap against a serialized baseline."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch
from torch import nn

import dlo
from dlo.host.region import LEDGER
from dlo.models import build_pipeline, make_inputs
from dlo.runtime.ring import RingScheduler
from dlo.runtime.transport import BlockTransport
from tests.toys import ToyDiT, ToyPipeline, assert_same, clone, snapshot

DEV = torch.device("cuda", 0)


def _x(seed: int, dim: int = 16, tokens: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, dim, generator=g).to(DEV)


def _enable(model: nn.Module, **kw: Any) -> dlo.OffloadBackend:
    b = dlo.enable_offload(
        model, dlo.OffloadConfig(**{"mode": "layer", "resident_layers": 0, **kw}), device=DEV
    )
    assert b is not None
    return b


def _steps(model: nn.Module, n: int, **kw: Any) -> list[torch.Tensor]:
    outs = []
    for s in range(n):
        with torch.inference_mode() if s % 2 else torch.no_grad():
            outs.append(model(_x(s, **kw)).clone())
    return outs


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_toy_parity_pinned_and_restore(num_slots: int) -> None:
    model = ToyDiT(5)
    ref = _steps(clone(model).to(DEV), 4)
    before = snapshot(model)
    b = _enable(model, num_slots=num_slots)
    st = b.stats()
    assert st["host_pinned_nbytes"] == st["host_nbytes"] > 0
    assert LEDGER.pinned_nbytes == st["host_pinned_nbytes"]
    got = _steps(model, 4)
    assert all(torch.equal(a, c) for a, c in zip(ref, got))
    b.disable()
    assert LEDGER.pinned_nbytes == 0 and LEDGER.host_nbytes == 0
    assert_same(before, model)


def test_two_dits_and_encoder_ring_parity() -> None:
    pipe = ToyPipeline()
    ref = clone(pipe).to(DEV)
    b = _enable(pipe, num_slots=2)
    x = _x(3)
    with torch.no_grad():
        for steps in (3, 4, 1):
            assert torch.equal(ref(x, steps), pipe(x, steps))
    b.disable()


def test_unstreamed_components_are_placed_on_the_device_and_moved_back() -> None:
    """The layerwise contract: encoders, VAEs and non-block modules are device resident
    unless streamed; a pipeline built on the CPU works after enable with no ``.to()``."""
    pipe = build_pipeline("tiny", device="cpu")
    ref = build_pipeline("tiny", device=DEV)
    before = snapshot(pipe)
    cfg = dlo.OffloadConfig(
        mode="layer", resident_layers=0, components=("dit",)
    )  # the encoder is not streamed
    b = dlo.enable_offload(pipe, cfg, device=DEV)
    assert b is not None
    assert all(p.device == DEV for p in pipe.text_encoder.parameters())
    assert all(p.device == DEV for p in pipe.vae.parameters())
    ids, lat = make_inputs("tiny", seed=1, device=DEV)
    assert torch.equal(ref.generate(ids, lat, 3), pipe.generate(ids, lat, 3))
    b.disable()
    assert_same(before, pipe)  # every tensor back on the CPU, same objects


def test_demo_pipeline_parity_bf16() -> None:
    ref = build_pipeline("tiny", device=DEV)
    pipe = build_pipeline("tiny")
    pipe.vae.to(DEV)
    b = _enable(pipe, resident_layers=1)
    ids, lat = make_inputs("tiny", seed=1, device=DEV)
    for _ in range(2):
        assert torch.equal(ref.generate(ids, lat, 3), pipe.generate(ids, lat, 3))
    b.disable()


def _allocs() -> int:
    return int(torch.cuda.memory_stats(DEV)["allocation.all.allocated"])


def _segments() -> int:
    return int(torch.cuda.memory_stats(DEV)["segment.all.allocated"])


def test_no_device_allocation_after_warmup() -> None:
    model = ToyDiT(6, dim=256)
    ref = clone(model).to(DEV)
    x = _x(0, dim=256)
    with torch.no_grad():
        ref(x)
        a0 = _allocs()
        ref(x)
        resident_allocs = _allocs() - a0
    b = _enable(model)
    with torch.no_grad():
        model(x)  # warm-up
        torch.cuda.synchronize()
        a0, s0 = _allocs(), _segments()
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        dlo_allocs = (_allocs() - a0) / 3
        assert _segments() == s0  # no cudaMalloc in steady state
    # dlo adds no allocation per block: the forward allocates what the resident one does
    assert dlo_allocs == resident_allocs
    b.disable()


def test_delayed_copy_stream_still_bitwise_and_race_is_detectable(monkeypatch: Any) -> None:
    model = ToyDiT(6, dim=256)
    ref = _steps(clone(model).to(DEV), 3, dim=256, tokens=64)
    load = BlockTransport.load

    def slow_load(self: BlockTransport, *a: Any, **k: Any) -> None:
        with torch.cuda.stream(self.copy_stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles before every copy
        load(self, *a, **k)

    monkeypatch.setattr(BlockTransport, "load", slow_load)
    b = _enable(model)
    got = _steps(model, 3, dim=256, tokens=64)
    assert all(torch.equal(a, c) for a, c in zip(ref, got))
    # negative control: without the compute stream's wait on `ready`, the same delay
    # makes the forward read slots before their bytes land
    monkeypatch.setattr(RingScheduler, "_wait", lambda self, block, slot, compute: None)
    bad = _steps(model, 3, dim=256, tokens=64)
    assert not all(torch.equal(a, c) for a, c in zip(ref, bad))
    b.disable()


class _Heavy(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16)
        self.b = nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = self.b(torch.relu(self.a(x)))
        return x


class _HeavyModel(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Heavy(dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


def _time(model: nn.Module, x: torch.Tensor, reps: int = 5) -> float:
    times = []
    with torch.no_grad():
        model(x)
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            model(x)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def test_overlap_beats_serialized_baseline() -> None:
    # 64 MiB blocks; tokens picked so compute per block is of the order of its transfer
    dim, n = 4096, 8
    model = _HeavyModel(dim, n)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.01)
    x = torch.randn(4096, dim, device=DEV, dtype=torch.bfloat16)
    b = _enable(model, num_slots=1)  # serialized: the next load waits for the slot
    t_serial = _time(model, x)
    b.disable()
    b = _enable(model, num_slots=2)  # overlapped
    t_overlap = _time(model, x)
    st = b.stats()
    b.disable()
    print(
        f"serialized {t_serial:.2f} ms, overlapped {t_overlap:.2f} ms, "
        f"exposed wait {st['exposed_wait_ms']:.2f} ms"
    )
    assert t_overlap < 0.8 * t_serial


def test_cuda_graph_capture_is_a_clear_error_and_leaves_the_ring_intact() -> None:
    model = ToyDiT(4)
    ref = _steps(clone(model).to(DEV), 2)
    b = _enable(model)
    x = _x(0)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(dlo.OffloadError, match="CUDA graph capture"),
        torch.no_grad(),
        torch.cuda.graph(graph, stream=side),
    ):
        model(x)
    torch.cuda.synchronize(DEV)
    assert all(torch.equal(a, c) for a, c in zip(ref, _steps(model, 2)))
    b.disable()
    assert LEDGER.pinned_nbytes == 0


def test_hundred_cycles_return_device_and_pinned_memory() -> None:
    model = ToyDiT(6, dim=256)
    x = _x(1, dim=256, tokens=32)
    with torch.no_grad():  # torch's own lazily kept state (the cuBLAS workspace) is not dlo's
        clone(model).to(DEV)(x)
    torch.cuda.synchronize(DEV)
    base = torch.cuda.memory_allocated(DEV)
    seen = []
    for cycle in range(100):
        b = _enable(model, num_slots=2)
        with torch.no_grad():
            model(x)
        b.disable()
        torch.cuda.synchronize(DEV)
        assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0), cycle
        seen.append(torch.cuda.memory_allocated(DEV))
    # the model's own weights went back to the device they came from (CPU): nothing of dlo's
    # stays allocated, and cycle 99 holds what cycle 10 held
    assert seen[99] == seen[10] <= base + (1 << 20), (base, seen[10], seen[99])


def test_the_device_budget_caps_the_allocator_until_disable() -> None:
    """[Note: device budget]: under device_budget_gb the process allocates as on a device of
    that size (a larger tensor fails), the run stays bitwise, and disable lifts the cap."""
    total = torch.cuda.get_device_properties(DEV).total_memory
    before = torch.cuda.get_per_process_memory_fraction(DEV)
    model = ToyDiT(5, dim=256)
    ref = _steps(clone(model).to(DEV), 2, dim=256)
    budget_gb = 2.0
    held = torch.cuda.memory_allocated(DEV)
    b = _enable(model, resident_layers=None, device_budget_gb=budget_gb)
    try:
        cap = torch.cuda.get_per_process_memory_fraction(DEV)
        assert cap == pytest.approx(min(before, budget_gb * 2**30 / total))
        st = b.stats()
        assert st["num_pinned_blocks"] == 5  # the toy fits the budget: nothing streams
        assert "device_budget_gb 2.00 GiB: at most" in st["policy"]["explanation"]
        assert all(torch.equal(a, c) for a, c in zip(ref, _steps(model, 2, dim=256)))
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(budget_gb * 2**30) - held, dtype=torch.uint8, device=DEV)
    finally:
        b.disable()
    assert torch.cuda.get_per_process_memory_fraction(DEV) == before
    torch.empty(int(budget_gb * 2**30), dtype=torch.uint8, device=DEV)  # lifted


def test_two_budgets_stack_and_unwind_in_either_order() -> None:
    """dlo.platform.memory_cap on the device: the smaller budget binds while both are
    enabled; disabling the first leaves the second's cap; the last gives back the fraction
    the process had."""
    total = torch.cuda.get_device_properties(DEV).total_memory
    before = torch.cuda.get_per_process_memory_fraction(DEV)
    a = _enable(ToyDiT(5), resident_layers=None, device_budget_gb=2.0)
    b = _enable(ToyDiT(5), resident_layers=None, device_budget_gb=3.0)
    try:
        assert torch.cuda.get_per_process_memory_fraction(DEV) == pytest.approx(
            min(before, 2 * 2**30 / total)
        )
        a.disable()
        assert torch.cuda.get_per_process_memory_fraction(DEV) == pytest.approx(
            min(before, 3 * 2**30 / total)
        )
    finally:
        a.disable()
        b.disable()
    assert torch.cuda.get_per_process_memory_fraction(DEV) == before
