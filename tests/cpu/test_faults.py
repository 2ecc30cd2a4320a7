"""FAULTS.md cases on the CPU lane (single rank and gloo groups), each with the expected
outcome and "nothing lost" where the case rolls back. Cases already covered elsewhere are
listed in docs/reliability.md with their test."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dlo
from dlo import faults
from dlo.backends.layerwise import LayerwiseBackend
from dlo.errors import InjectedFault, OffloadError
from dlo.host.region import LEDGER
from dlo.platform.device import CpuPlatform
from dlo.platform.env import process_rss_bytes
from dlo.runtime import transport
from tests.harness import assert_all_ok, run_ranks
from tests.nothing_lost import Baseline
from tests.toys import ToyBlock, ToyDiT, clone

DIM = 16


# ----------------------------------------------------------------------------- models
class Empty(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.5


class Tiny(nn.Module):
    """Smaller than one AllGather unit of a group of 4 (3 floats)."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor([1.1, 0.9, 1.05]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g.mean()


class Quant(nn.Module):
    """fp8 and int8 weights with fp32 scales, a channels_last conv: dtypes and strides kept."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w8 = nn.Parameter(
            (torch.randn(DIM, DIM, generator=g) * 0.3).to(torch.float8_e4m3fn), requires_grad=False
        )
        self.s8 = nn.Parameter(torch.tensor(0.5), requires_grad=False)
        self.wi = nn.Parameter(
            torch.randint(-100, 100, (DIM, DIM), generator=g, dtype=torch.int8), requires_grad=False
        )
        self.register_buffer("si", torch.tensor(0.01))
        conv = nn.Conv2d(2, 2, 3, padding=1)
        conv.weight.data = (torch.randn(2, 2, 3, 3, generator=g) * 0.2).contiguous(
            memory_format=torch.channels_last
        )
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ (self.w8.float() * self.s8) + x @ (self.wi.float() * self.si)
        b, t, d = h.shape
        img = h.reshape(b, 2, t, d // 2)
        return x + 0.1 * torch.tanh(self.conv(img).reshape(b, t, d))


class Mixed(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _mixed() -> Mixed:
    torch.manual_seed(0)
    return Mixed(ToyBlock(DIM, 1), Empty(), Quant(2), Tiny(), ToyBlock(DIM, 3), Empty())


def _x(rank: int = 0, step: int = 0) -> torch.Tensor:
    return torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(100 * rank + step))


def _steps(model: nn.Module, rank: int = 0, n: int = 3) -> list[torch.Tensor]:
    out = []
    for s in range(n):
        with torch.inference_mode() if s % 2 else torch.no_grad():
            out.append(model(_x(rank, s)).clone())
    return out


def _enable(model: nn.Module, **kw: Any) -> dlo.OffloadBackend:
    b = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer", **kw), device="cpu")
    assert b is not None
    return b


# ----------------------------------------------------------------------------- A: structure
def test_zero_param_blocks_fp8_int8_channels_last_single_rank() -> None:
    model = _mixed()
    ref = _steps(clone(model))
    base = Baseline.take(model)
    backend = _enable(model, chunk_mb=1)
    got = _steps(model)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    empty = [b for b in backend._blocks if b.layout.num_chunks == 0]
    assert len(empty) == 2 and all(b.layout.shard_nbytes == 0 for b in empty)
    backend.disable()
    base.check(model)


def _mixed_ranks(rank: int, world: int) -> dict[str, Any]:
    model = _mixed()
    ref = _steps(clone(model), rank)
    counts: Counter[str] = Counter()
    real = transport.all_gather_into

    def counting(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
        counts["gathers"] += 1
        real(output, input, group)

    transport.all_gather_into = counting  # type: ignore[assignment]
    try:
        cfg = dlo.OffloadConfig(
            mode="layer", transfer="allgather", chunk_mb=1, collective_timeout_s=20.0
        )
        backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
        backend.enable(model)
        got = _steps(model, rank)
        loads = backend.stats()["num_loads"]
        chunks = {b.name: b.layout.num_chunks for b in backend._blocks}
        backend.disable()
    finally:
        transport.all_gather_into = real  # type: ignore[assignment]
    return {
        "same": all(torch.equal(a, b) for a, b in zip(ref, got)),
        "gathers": counts["gathers"],
        "loads": loads,
        "chunks": chunks,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_zero_param_blocks_move_nothing_and_tiny_blocks_pad_for_any_group(world: int) -> None:
    res = assert_all_ok(run_ranks(_mixed_ranks, world, timeout_s=120))
    for r in res:
        assert r["same"]
        assert r["chunks"]["blocks.1"] == 0 and r["chunks"]["blocks.5"] == 0
        assert r["chunks"]["blocks.3"] == 1  # 12 bytes, padded to one unit of world x 256
    # every rank issued the same gathers; empty blocks issued none (and no lock-step check)
    assert len({r["gathers"] for r in res}) == 1


class SubParam(nn.Parameter):
    pass


def test_tensor_subclass_parameters_refused_by_name() -> None:
    model = ToyDiT(3)
    model.blocks[1].lin.weight = SubParam(model.blocks[1].lin.weight.data)
    base = Baseline.take(model)
    with pytest.raises(OffloadError, match=r"blocks\.1\.lin\.weight \(SubParam\)"):
        _enable(model)
    base.check(model)


def test_parameter_shared_between_block_and_non_block_refused_naming_both() -> None:
    model = ToyDiT(3)
    model.head.weight = model.blocks[0].norm.weight  # both (16,), fp32... tie a norm to head
    model.head.weight = nn.Parameter(torch.zeros(DIM, DIM))
    model.head.bias = model.blocks[0].norm.bias
    base = Baseline.take(model)
    with pytest.raises(OffloadError) as info:
        _enable(model)
    assert "blocks.0.norm.bias" in str(info.value) and "head.bias" in str(info.value)
    base.check(model)


def test_parameter_shared_between_two_blocks_refused_naming_both() -> None:
    model = ToyDiT(3)
    model.blocks[2].norm.weight = model.blocks[0].norm.weight
    base = Baseline.take(model)
    with pytest.raises(OffloadError) as info:
        _enable(model)
    assert "blocks.0.norm.weight" in str(info.value) and "blocks.2.norm.weight" in str(info.value)
    base.check(model)


def test_block_hooked_by_another_offloader_refused_and_its_hook_untouched() -> None:
    model = ToyDiT(3)
    marker = object()
    model.blocks[1]._hf_hook = marker  # accelerate's attribute
    base = Baseline.take(model)
    with pytest.raises(OffloadError, match="accelerate"):
        _enable(model)
    assert model.blocks[1]._hf_hook is marker
    base.check(model)


def test_disable_without_enable_is_a_no_op() -> None:
    backend = dlo.get_offload_backend(dlo.OffloadConfig(mode="layer"), device="cpu")
    assert backend is not None
    backend.disable()
    backend.disable()
    assert not backend.is_enabled()


# ----------------------------------------------------------------------------- B: forward
def test_injected_failure_inside_block_with_prefetch_in_flight() -> None:
    model = ToyDiT(5)
    ref = _steps(clone(model))
    backend = _enable(model, num_slots=3)
    with faults.inject("block_forward", after=2), pytest.raises(InjectedFault), torch.no_grad():
        model(_x())
    got = _steps(model)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    base_after = LEDGER.host_nbytes
    backend.disable()
    assert base_after > 0 and LEDGER.host_nbytes == 0


def test_two_threads_calling_forward_refused_and_ring_intact() -> None:
    model = ToyDiT(4)
    ref = _steps(clone(model), n=1)[0]
    backend = _enable(model)
    errors: list[BaseException] = []
    inside = threading.Event()
    done = threading.Event()

    def second_caller() -> None:
        inside.wait(10)
        try:
            with torch.no_grad():
                model(_x())
        except BaseException as e:
            errors.append(e)
        done.set()

    def hold(module: nn.Module, args: tuple) -> None:
        inside.set()
        done.wait(10)

    t = threading.Thread(target=second_caller)
    t.start()
    h = model.blocks[1].register_forward_pre_hook(hold)
    with torch.no_grad():
        out = model(_x())
    h.remove()
    t.join(10)
    assert len(errors) == 1 and "another thread" in str(errors[0])
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(_steps(clone(ToyDiT(4))), _steps(model)))
    backend.disable()


def test_second_thread_arriving_inside_enter_is_refused_and_ring_intact() -> None:
    # the window between the ring's "already running?" check and its claim: thread A is held
    # inside enter (waiting for its block's weights) while the main thread calls another block
    model = ToyDiT(4)
    x = _x()
    with torch.no_grad():
        want = clone(model).blocks[2](x)
    backend = _enable(model, num_slots=2)
    sched = backend._scheduler  # type: ignore[attr-defined]
    wait, inside, go = sched._wait, threading.Event(), threading.Event()
    got: list[Any] = []

    def held_wait(*a: Any) -> Any:
        if threading.current_thread().name == "A":
            inside.set()
            go.wait(10)
        return wait(*a)

    def run_a() -> None:
        try:
            with torch.no_grad():
                got.append(model.blocks[2](x))
        except BaseException as e:
            got.append(e)

    sched._wait = held_wait
    a = threading.Thread(target=run_a, name="A")
    a.start()
    assert inside.wait(10)
    with pytest.raises(OffloadError, match="another thread"), torch.no_grad():
        model.blocks[0](x)
    go.set()
    a.join(10)
    sched._wait = wait
    assert len(got) == 1 and isinstance(got[0], torch.Tensor) and torch.equal(got[0], want)
    assert all(torch.equal(a, b) for a, b in zip(_steps(clone(ToyDiT(4))), _steps(model)))
    backend.disable()


def test_input_on_the_wrong_device_refused_before_any_transfer() -> None:
    model = ToyDiT(3)
    backend = _enable(model)
    loads = backend.stats()["num_loads"]
    with pytest.raises(OffloadError, match="input on meta"), torch.no_grad():
        model.blocks[0](torch.empty(2, 4, DIM, device="meta"))
    assert backend.stats()["num_loads"] == loads
    backend.disable()


class Collective(nn.Module):
    """A block that runs a user collective on the default group inside its forward."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.inner = ToyBlock(DIM, seed, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        s = y.sum().reshape(1).clone()
        dist.all_reduce(s)
        return y + 1e-3 * s


def _user_collectives(rank: int, world: int) -> bool:
    model = Mixed(*(Collective(i) for i in range(4)))
    ref = _steps(clone(model), rank)
    cfg = dlo.OffloadConfig(mode="layer", transfer="allgather", collective_timeout_s=20.0)
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    backend.enable(model)
    got = _steps(model, rank)
    backend.disable()
    return all(torch.equal(a, b) for a, b in zip(ref, got))


def test_user_collectives_inside_blocks_do_not_interleave_with_dlo() -> None:
    assert all(assert_all_ok(run_ranks(_user_collectives, 2, timeout_s=120)))


def _one_rank_fails(rank: int, world: int, how: str) -> str:
    import os

    model = ToyDiT(6)
    cfg = dlo.OffloadConfig(mode="layer", transfer="allgather", collective_timeout_s=5.0)
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    backend.enable(model)
    t0 = time.monotonic()
    if rank == 1:
        if how == "kill":  # the process dies inside block 2, a prefetch in flight
            model.blocks[2].register_forward_pre_hook(lambda m, a: os._exit(3))
            with torch.no_grad():
                model(_x(rank))
        with faults.inject("block_forward", after=2), torch.no_grad():
            model(_x(rank))
        return "no error"
    try:
        with torch.no_grad():
            for s in range(3):
                model(_x(rank, s))
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
    return "no error"


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_one_rank_failing_ends_its_peer_within_the_timeout(how: str) -> None:
    outs = run_ranks(_one_rank_fails, 2, how, timeout_s=90)
    survivor, failed = outs
    if how == "raise":
        assert failed.error_type == "InjectedFault", failed
    else:
        assert failed.exitcode == 3, failed
    assert survivor.ok and survivor.value.startswith("OffloadError"), survivor
    seconds = float(survivor.value.split(" after ")[1].split("s:")[0])
    assert seconds < 30, survivor.value


def _world_mismatch(rank: int, world: int) -> str:
    backend = LayerwiseBackend(
        dlo.OffloadConfig(mode="layer", transfer="allgather"),
        dlo.ParallelConfig(data_parallel_size=3),
        CpuPlatform(),
    )
    model = ToyDiT(2)
    base = Baseline.take(model)
    try:
        backend.enable(model)
    except ValueError as e:
        base.check(model)
        return str(e)
    return "enabled"


def test_parallel_config_not_matching_world_size_is_refused_at_enable() -> None:
    outs = assert_all_ok(run_ranks(_world_mismatch, 2, timeout_s=60))
    assert all("data_parallel_size=3" in o and "WORLD_SIZE=2" in o for o in outs)


@pytest.mark.parametrize("mode", ["layer", "module"])  # streamed blocks; swapped components
def test_cuda_graph_capture_around_offloaded_modules_is_a_clear_error(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlo.platform.device import CpuPlatform

    model = ToyDiT(3)
    ref = _steps(clone(model))
    b = dlo.enable_offload(model, dlo.OffloadConfig(mode=mode), device="cpu")
    assert b is not None
    monkeypatch.setattr(CpuPlatform, "stream_capturing", lambda self: True)
    with pytest.raises(OffloadError, match="CUDA graph capture"), torch.no_grad():
        model(_x())
    monkeypatch.undo()
    assert all(torch.equal(a, c) for a, c in zip(ref, _steps(model)))  # the ring is intact
    b.disable()


# ----------------------------------------------------------------------------- cycles
def test_hundred_enable_forward_disable_cycles_do_not_grow() -> None:
    model = ToyDiT(6, dim=64)
    x = torch.randn(2, 8, 64)
    rss = []
    for cycle in range(100):
        backend = _enable(model)
        with torch.no_grad():
            model(x)
        backend.disable()
        assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
        if cycle in (10, 99):
            rss.append(process_rss_bytes())
    assert rss[1] - rss[0] < 8 << 20, f"RSS grew by {(rss[1] - rss[0]) >> 20} MiB over 90 cycles"
