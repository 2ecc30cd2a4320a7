"""Multi-rank GPU paths that tests/multigpu's two-GPU cases do not cover: three ranks
(AllGather and node-shared), compile under AllGather, and a rank killed with SIGKILL
mid-forward (the survivor ends within its bound; nothing is left in the shared-memory folder
or on the GPU). They run with a GPU per rank, or in the one-GPU multi-rank lane
(``DLO_SHARE_GPU=1``: every rank on one GPU, gloo between them; see [Note: ranks sharing a
GPU] in dlo/platform/sharing.py), where timings are not speed figures."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch

import dlo
from dlo.bench.methods import _inputs
from dlo.host.region import LEDGER
from dlo.models import build_pipeline
from dlo.platform.env import share_gpu, shared_memory_dir
from tests.harness import assert_all_ok, gpu, run_ranks
from tests.multigpu.test_dlo_nccl import NCCL_ENV, _backend, _steps, warm_then_steady
from tests.toys import ToyDiT, clone

DIM = 256


def _need_ranks(world: int) -> None:
    if torch.cuda.device_count() < world and not share_gpu():
        pytest.skip(f"{world} ranks need {world} GPUs, or DLO_SHARE_GPU=1 on fewer")


def _three(rank: int, world: int, transfer: str) -> dict[str, Any]:
    dev = gpu(rank)
    model = ToyDiT(7, dim=DIM)
    ref = _steps(clone(model).to(dev), rank, 4, DIM) + _steps(clone(model).to(dev), rank, 3, DIM)
    b = _backend(rank, world, transfer=transfer, chunk_mb=1, resident_layers=1)
    b.enable(model)
    got, more, new_segments = warm_then_steady(model, rank, DIM)
    st = b.stats()
    streamed = sum(x.layout.padded_nbytes for x in b._blocks if not x.resident)
    b.disable()
    return {
        "same": all(torch.equal(x, y) for x, y in zip(ref, got + more)),
        "h2d": st["h2d_nbytes"],
        "gathered": st["allgather_nbytes"],
        "loads": st["num_loads"],
        "streamed": streamed,
        "transfer": st["transfer"],
        "new_segments": new_segments,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.mark.timeout(360)
@pytest.mark.parametrize("transfer", ["allgather", "node-shared"])
def test_three_ranks_are_bitwise(transfer: str) -> None:
    _need_ranks(3)
    res = assert_all_ok(run_ranks(_three, 3, transfer, backend="nccl", timeout_s=300, env=NCCL_ENV))
    for r in res:
        assert r["same"] and r["new_segments"] == 0 and r["ledger"] == (0, 0), r
        if transfer == "allgather":  # each rank moved a third of what it gathered
            assert r["h2d"] * 3 == r["gathered"] > 0, r
        else:  # whole blocks from the one shared copy, nothing gathered
            assert r["gathered"] == 0 and r["h2d"] > 0 and r["transfer"] == "node-shared", r


def _compiled(rank: int, world: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    dev = gpu(rank)
    dit = build_pipeline("tiny", dtype=torch.bfloat16).transformer
    tokens = (64, 64, 96, 64)

    def forwards(fn: Any) -> list[torch.Tensor]:
        out = []
        with torch.no_grad():
            for t in tokens:
                latents, ts, text = _inputs("tiny", t, dev, torch.bfloat16)
                out.append(fn(latents, ts, text).clone())
        torch.cuda.synchronize()
        return out

    resident = clone(dit).to(dev)
    cast(Any, resident).compile_repeated_blocks(fullgraph=True)
    ref = forwards(resident)
    ref_again = forwards(resident)
    del resident
    torch._dynamo.reset()
    start = int(counters["stats"]["unique_graphs"])
    b = dlo.enable_offload(
        dit,
        dlo.OffloadConfig(mode="layer", resident_layers=0, num_slots=2, transfer="allgather"),
        dlo.ParallelConfig(data_parallel_size=world),
        device=dev,
    )
    assert b is not None
    try:
        cast(Any, dit).compile_repeated_blocks(fullgraph=True)
        got = forwards(dit)
        graphs = int(counters["stats"]["unique_graphs"]) - start
        again = forwards(dit)  # the blocks land in other slots
        st = b.stats()
        recompiled = int(counters["stats"]["unique_graphs"]) - start - graphs
    finally:
        b.disable()
    return {
        "same": all(torch.equal(x, y) for x, y in zip(ref + ref_again, got + again)),
        "graphs": graphs,
        "recompiled": recompiled,
        "gathered": st["allgather_nbytes"],
        "h2d": st["h2d_nbytes"],
    }


@pytest.mark.timeout(460)
def test_compile_under_allgather_is_bitwise() -> None:
    res = assert_all_ok(run_ranks(_compiled, 2, backend="nccl", timeout_s=400, env=NCCL_ENV))
    for r in res:
        assert r["same"] and r["graphs"] > 0 and r["recompiled"] == 0, r
        assert r["h2d"] * 2 == r["gathered"] > 0, r


def _killed(rank: int, world: int, transfer: str, where: str) -> str:
    Path(where, f"pid{rank}").write_text(str(os.getpid()))
    model = ToyDiT(6, dim=64)
    b = _backend(rank, world, transfer=transfer, collective_timeout_s=10.0)
    b.enable(model)
    if rank == 1:  # SIGKILL inside block 2, a prefetch in flight: no handler, no atexit
        model.blocks[2].register_forward_pre_hook(lambda m, a: os.kill(os.getpid(), signal.SIGKILL))
    t0 = time.monotonic()
    try:
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(2, 64, 64, device=gpu(rank)))
        torch.cuda.synchronize()
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
    finally:
        b.disable()  # bounded too, after a failed gather
    return "no error"


def _gpu_used_mib() -> int:
    """Device memory in use on every GPU, from the driver (this process holds no context)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return sum(int(x) for x in out.split())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("transfer", ["allgather", "node-shared"])
def test_a_killed_rank_leaves_nothing_behind(tmp_path: Path, transfer: str) -> None:
    shm = Path(shared_memory_dir())
    before = {p.name for p in shm.glob("dlo-*")}
    used = _gpu_used_mib()
    outs = run_ranks(
        _killed, 2, transfer, str(tmp_path), backend="nccl", timeout_s=150, env=NCCL_ENV
    )
    survivor, killed = outs
    assert killed.exitcode == -signal.SIGKILL, killed
    assert not survivor.timed_out, survivor  # ended within the bound: an error, or done
    if transfer == "allgather":  # its peer's slices never come: the gather fails
        assert not (survivor.ok and survivor.value == "no error"), survivor
    pids = {int((tmp_path / f"pid{r}").read_text()) for r in range(2)}
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), pids
    while _gpu_used_mib() > used + 64 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _gpu_used_mib() <= used + 64, (used, _gpu_used_mib())  # both contexts gone
    assert {p.name for p in shm.glob("dlo-*")} <= before  # no shared-memory file left
