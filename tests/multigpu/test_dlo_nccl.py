"""DLO on two CUDA GPUs with NCCL: parity, per-rank H2D bytes, no steady-state allocation,
delayed copy stream, lock-step check, one-rank failure bounded in time."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.host.region import LEDGER
from dlo.platform.device import CudaPlatform
from tests.harness import assert_all_ok, gpu, run_ranks, shares_gpu
from tests.toys import ToyDiT, clone

NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "20",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


def _x(rank: int, step: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(2, 64, dim, generator=g).to(gpu(rank))


def _backend(rank: int, world: int, **kw: Any) -> LayerwiseBackend:
    """``gather_engine="copy-kernel"``: the copy engine with torch's barrier kernels (the
    plain ``"copy"`` picks stream memory operations where the driver has them)."""
    kw.setdefault("collective_timeout_s", 30.0)
    if kw.get("gather_engine") == "copy-kernel":
        kw["gather_engine"], kw["gather_sync"] = "copy", "kernel"
    kw.setdefault("transfer", "allgather")
    cfg = dlo.OffloadConfig(**{"mode": "layer", "resident_layers": 0, **kw})
    return LayerwiseBackend(
        cfg, dlo.ParallelConfig(data_parallel_size=world), CudaPlatform(gpu(rank))
    )


def _steps(model: torch.nn.Module, rank: int, n: int, dim: int) -> list[torch.Tensor]:
    out = []
    for s in range(n):
        with torch.inference_mode() if s % 2 else torch.no_grad():
            out.append(model(_x(rank, s, dim)).clone())
    return out


def warm_then_steady(
    model: torch.nn.Module, rank: int, dim: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """4 warm-up steps, then 3 more; returns both outputs and the device segments the
    steady steps allocated (0 when the ring allocates nothing after warm-up)."""
    dev = gpu(rank)
    got = _steps(model, rank, 4, dim)
    torch.cuda.synchronize()
    a0 = torch.cuda.memory_stats(dev)["segment.all.allocated"]
    more = _steps(model, rank, 3, dim)
    torch.cuda.synchronize()
    return got, more, torch.cuda.memory_stats(dev)["segment.all.allocated"] - a0


def delay_copy_stream() -> None:
    """Hold every load's copy stream back 20 M cycles: the ring's events, not luck, must
    order the copies and the reads (in this process, for the rest of the test)."""
    from dlo.runtime.transport import BlockTransport

    load = BlockTransport.load

    def slow(self: BlockTransport, *a: Any, **k: Any) -> None:
        with torch.cuda.stream(self.copy_stream):
            torch.cuda._sleep(20_000_000)
        load(self, *a, **k)

    BlockTransport.load = slow  # type: ignore[method-assign]


def _parity(rank: int, world: int, delayed: bool, engine: str) -> dict[str, Any]:
    dev = gpu(rank)
    dim = 256
    model = ToyDiT(7, dim=dim)
    ref = _steps(clone(model).to(dev), rank, 4, dim)
    if delayed:
        delay_copy_stream()
    b = _backend(rank, world, chunk_mb=1, resident_layers=1, gather_engine=engine)
    b.enable(model)
    got, more, new_segments = warm_then_steady(model, rank, dim)
    st = b.stats()
    shard = sum(x.layout.shard_nbytes for x in b._blocks)
    streamed = sum(x.layout.shard_nbytes for x in b._blocks if not x.resident)
    padded = sum(x.layout.padded_nbytes for x in b._blocks)
    b.disable()
    return {
        "same": all(torch.equal(x, y) for x, y in zip(ref, got))
        and all(
            torch.equal(x, y)
            for x, y in zip(_steps(clone(ToyDiT(7, dim=dim)).to(dev), rank, 3, dim), more)
        ),
        "h2d": st["h2d_nbytes"],
        "gathered": st["allgather_nbytes"],
        "loads": st["num_loads"],
        "shard": shard,
        "padded": padded,
        "pinned": st["host_pinned_nbytes"],
        "streamed": streamed,
        "new_segments": new_segments,
        "engine": st["gather_engine"],
        "sync": st["gather_sync"],
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


ENGINES = pytest.mark.parametrize("engine", ["nccl", "copy", "copy-kernel"])
SYNC = {"nccl": None, "copy": "stream", "copy-kernel": "kernel"}
COPY_REFUSED = "gather_engine='copy' needs a CUDA GPU per rank"


def engine_ranks(engine: str, fn: Any, world: int, *args: Any, timeout_s: float) -> Any:
    """``run_ranks(fn, world, *args)`` on the GPUs. Where the ranks share a GPU (the one-GPU
    lane) the copy engine cannot run (symmetric memory refuses ranks on one device): every
    rank's enable must refuse it by name, checked here, and the result is None."""
    outs = run_ranks(fn, world, *args, backend="nccl", timeout_s=timeout_s, env=NCCL_ENV)
    if engine.startswith("copy") and shares_gpu(world):
        for o in outs:
            assert o.error_type == "ValueError" and COPY_REFUSED in (o.error or ""), o
        return None
    return outs


@ENGINES
def test_nccl_parity_half_bytes_no_alloc(engine: str) -> None:
    outs = engine_ranks(engine, _parity, 2, False, engine, timeout_s=240)
    if outs is None:
        return
    for r in assert_all_ok(outs):
        assert r["same"] and r["engine"] == engine.split("-")[0]
        assert r["sync"] == SYNC[engine]
        # only streamed blocks are pinned: the resident one crosses the link once, at enable
        assert r["shard"] * 2 == r["padded"] and r["pinned"] == r["streamed"] < r["shard"]
        assert r["h2d"] * 2 == r["gathered"]  # each rank moved half of what it gathered
        assert r["new_segments"] == 0 and r["ledger"] == (0, 0)


def test_auto_gather_engine_takes_the_copy_engine_on_one_node() -> None:
    """With a GPU per rank; where the ranks share one GPU, ``auto`` takes the process group's
    collective (gloo there: [Note: ranks sharing a GPU])."""
    res = assert_all_ok(
        run_ranks(_parity, 2, False, "auto", backend="nccl", timeout_s=240, env=NCCL_ENV)
    )
    shared = shares_gpu(2)
    for r in res:
        assert r["same"] and r["engine"] == ("nccl" if shared else "copy")
        assert r["sync"] == (None if shared else "stream")


@ENGINES
def test_nccl_delayed_copy_stream_parity(engine: str) -> None:
    outs = engine_ranks(engine, _parity, 2, True, engine, timeout_s=240)
    assert outs is None or all(r["same"] for r in assert_all_ok(outs))


def _diverge(rank: int, world: int, engine: str) -> str:
    model = ToyDiT(6, dim=64)
    b = _backend(rank, world, num_slots=1, gather_engine=engine, collective_timeout_s=15.0)
    b.enable(model)
    if rank == 1:
        model.skip = {2}
    try:
        for s in range(3):
            with torch.no_grad():
                model(_x(rank, s, 64))
        torch.cuda.synchronize()
        with torch.no_grad():
            model(_x(rank, 9, 64))
    except dlo.OffloadError as e:
        return str(e)
    return "no error"


@ENGINES
def test_nccl_diverging_sequence_reported(engine: str) -> None:
    outs = engine_ranks(engine, _diverge, 2, engine, timeout_s=120)
    if outs is None:
        return
    # a rank reports the divergence or is ended (NCCL's or dlo's watchdog); none is left
    # hanging to the harness's bound
    assert not any(o.timed_out for o in outs), outs
    values = [o.value for o in outs if o.ok]
    assert values and all("different blocks" in v for v in values), outs


def _one_rank_fails(rank: int, world: int, how: str, engine: str) -> str:
    import os
    import time

    from dlo import faults

    model = ToyDiT(6, dim=64)
    b = _backend(rank, world, gather_engine=engine, collective_timeout_s=10.0)
    b.enable(model)
    t0 = time.monotonic()
    if rank == 1:
        if how == "kill":  # the process dies inside block 2, a prefetch in flight
            model.blocks[2].register_forward_pre_hook(lambda m, a: os._exit(3))
            with torch.no_grad():
                model(_x(rank, 0, 64))
        with faults.inject("block_forward", after=2), torch.no_grad():
            model(_x(rank, 0, 64))
        return "no error"
    try:
        with torch.no_grad():
            for s in range(3):
                model(_x(rank, s, 64))
        torch.cuda.synchronize()
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
    return "no error"


@pytest.mark.parametrize("how", ["raise", "kill"])
@ENGINES
def test_nccl_one_rank_failing_ends_its_peer_within_the_bound(how: str, engine: str) -> None:
    # FAULTS.md B: the survivor is discarded (an error, or the NCCL watchdog's abort), never
    # left hanging; the bound here is the harness's, well under the CI limit
    outs = engine_ranks(engine, _one_rank_fails, 2, how, engine, timeout_s=150)
    if outs is None:
        return
    survivor, failed = outs
    if how == "raise":
        assert failed.error_type == "InjectedFault", failed
    else:
        assert failed.exitcode == 3, failed
    assert not survivor.timed_out, survivor
    assert not (survivor.ok and survivor.value == "no error"), survivor


def _missing_peer(rank: int, world: int) -> str:
    if rank == 1:
        return "skipped enable"
    b = _backend(rank, world, collective_timeout_s=5.0)
    try:
        b.enable(ToyDiT(2, dim=64))
    except dlo.OffloadError as e:
        return str(e)
    return "enabled"


def test_nccl_rank_that_never_enables_is_named_within_the_timeout() -> None:
    outs = assert_all_ok(run_ranks(_missing_peer, 2, backend="nccl", timeout_s=90, env=NCCL_ENV))
    assert "rank(s) [1] never reached enable" in outs[0]


def _restore_cycles(rank: int, world: int, engine: str, cycles: int) -> dict[str, Any]:
    from dlo.platform.env import process_rss_bytes
    from tests.toys import assert_same, snapshot

    model = ToyDiT(5, dim=64)  # built on the host: restore gives it back there
    dev = gpu(rank)
    ref_model = clone(model).to(dev)
    ref = _steps(ref_model, rank, 2, 64)
    del ref_model
    before = snapshot(model)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    same, rss, device = [], [], []
    for _ in range(cycles):
        b = _backend(rank, world, gather_engine=engine, resident_layers=1)
        b.enable(model)
        got = _steps(model, rank, 2, 64)
        b.disable(restore=True)
        assert_same(before, model)  # same objects, on the host, same bytes
        same.append(all(torch.equal(a, c) for a, c in zip(ref, got)))
        del b, got  # the outputs too: the 64 KiB this test kept on the H100 (2 x 2x64x64 fp32)
        torch.cuda.synchronize()
        device.append(torch.cuda.memory_allocated(dev) - base)
        rss.append(process_rss_bytes())
    return {
        "same": same,
        "device": device,
        "rss": rss,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.mark.parametrize("engine", ["nccl", "copy"])
def test_restore_cycles_give_back_the_model_and_the_memory(engine: str) -> None:
    outs = engine_ranks(engine, _restore_cycles, 2, engine, 6, timeout_s=300)
    for r in assert_all_ok(outs) if outs is not None else []:
        assert all(r["same"]) and r["ledger"] == (0, 0), r
        assert max(r["device"]) <= 0, r["device"]  # device memory back at its baseline
