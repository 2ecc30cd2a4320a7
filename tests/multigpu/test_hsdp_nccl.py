"""HSDP 1x2 + DLO on two CUDA GPUs with NCCL: bitwise parity, one owner per parameter."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dlo
from dlo.backends.hsdp import shard_non_block
from dlo.backends.layerwise import LayerwiseBackend
from dlo.platform.device import CudaPlatform
from tests.harness import assert_all_ok, gpu
from tests.multigpu.test_dlo_nccl import engine_ranks
from tests.toys import ToyDiT, clone


def _hsdp(rank: int, world: int, engine: str) -> dict[str, Any]:
    dev = gpu(rank)
    par = dlo.ParallelConfig(data_parallel_size=world, hsdp_shard_size=world)
    cfg = dlo.OffloadConfig(
        mode="layer",
        transfer="allgather",
        resident_layers=0,
        collective_timeout_s=60.0,
        gather_engine=engine,
    )
    model = ToyDiT(5, dim=128)
    ref = clone(model).to(dev)
    shard_non_block(model, cfg, par, device_type="cuda")
    backend = LayerwiseBackend(cfg, par, CudaPlatform(dev))
    backend.enable(model)
    same = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * rank + step)
        x = torch.randn(2, 32, 128, generator=g).to(dev)
        with torch.no_grad():
            same.append(torch.equal(ref(x), model(x)))
    st = backend.stats()
    backend.disable()
    return {
        "same": same,
        "group_size": st["group_size"],
        "pinned": st["host_pinned_nbytes"],
        "engine": st["gather_engine"],
    }


@pytest.mark.parametrize("engine", ["nccl", "copy"])
def test_hsdp_1x2_dlo_parity_nccl(engine: str) -> None:
    outs = engine_ranks(engine, _hsdp, 2, engine, timeout_s=240)
    for r in assert_all_ok(outs) if outs is not None else []:
        assert all(r["same"]) and r["group_size"] == 2 and r["pinned"] > 0
        assert r["engine"] == engine  # the copy engine on the shard axis's group
