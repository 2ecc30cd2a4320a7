"""Every backend is freed at ``disable`` by reference counting alone.

On a GPU an object of dlo's left in a reference cycle keeps what it references (views of the
device slots, the staging buffers) allocated until the garbage collector happens to run: the
GPU cycle test found one (a ring and its blocks). These tests run each path with the
collector off and assert nothing of dlo's is left for it (``no_cyclic_garbage``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo import faults
from dlo.backends.layerwise import LayerwiseBackend
from dlo.errors import InjectedFault
from dlo.platform.device import CpuPlatform
from tests.harness import assert_all_ok, run_ranks
from tests.nothing_lost import no_cyclic_garbage
from tests.toys import ToyDiT, ToyPipeline


def _x(seed: int = 0, dim: int = 16) -> torch.Tensor:
    return torch.randn(2, 5, dim, generator=torch.Generator().manual_seed(seed))


def _forward(model: torch.nn.Module, steps: int = 2) -> None:
    for s in range(steps):
        with torch.inference_mode() if s % 2 else torch.no_grad():
            model(_x(s))


@pytest.mark.parametrize(
    "kw",
    [
        {"num_slots": 1},
        {"num_slots": 2, "resident_layers": 1},
        {"num_slots": "auto", "transfer": "auto"},
        {"mode": "module"},
    ],
    ids=["ring-1-slot", "ring-resident", "ring-auto", "model-swap"],
)
def test_enable_forward_disable_leaves_no_cycle(kw: dict[str, Any]) -> None:
    pipe = ToyPipeline()
    cfg = dlo.OffloadConfig(**{"mode": "layer", **kw})
    with no_cyclic_garbage():
        backend = dlo.enable_offload(pipe, cfg, device="cpu")
        assert backend is not None
        _forward(pipe)
        backend.stats()
        backend.disable()
        del backend


def test_exception_in_a_block_then_disable_leaves_no_cycle() -> None:
    model = ToyDiT(4)
    with no_cyclic_garbage():
        backend = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer"), device="cpu")
        assert backend is not None
        with faults.inject("block_forward"), pytest.raises(InjectedFault):
            _forward(model, 1)
        _forward(model, 1)
        backend.disable()
        del backend


@pytest.mark.parametrize(
    "point", ["host_fill", "slot_allocation", "first_transfer", "hook_install", "commit"]
)
def test_failed_enable_leaves_no_cycle(point: str) -> None:
    model = ToyDiT(4)
    with no_cyclic_garbage(), faults.inject(point), pytest.raises(InjectedFault):
        dlo.enable_offload(model, dlo.OffloadConfig(mode="layer"), device="cpu")


def _cycle_layerwise(model: torch.nn.Module, cfg: dlo.OffloadConfig, par: Any) -> bool:
    """Enable, run, disable and drop a layerwise backend with the collector off."""
    with no_cyclic_garbage():
        backend = LayerwiseBackend(cfg, par, CpuPlatform())
        backend.enable(model)
        _forward(model)
        backend.disable()
        del backend
    return True


def _allgather(rank: int, world: int) -> bool:
    cfg = dlo.OffloadConfig(mode="layer", transfer="allgather", collective_timeout_s=20.0)
    return _cycle_layerwise(ToyDiT(5), cfg, dlo.ParallelConfig(data_parallel_size=world))


def test_allgather_two_ranks_leaves_no_cycle() -> None:
    assert assert_all_ok(run_ranks(_allgather, 2, timeout_s=120)) == [True, True]


def _hsdp(rank: int, world: int) -> bool:
    from dlo.backends.hsdp import shard_non_block

    par = dlo.ParallelConfig(data_parallel_size=world, hsdp_replicate_size=1, hsdp_shard_size=2)
    cfg = dlo.OffloadConfig(mode="layer", transfer="allgather", collective_timeout_s=20.0)
    model = ToyDiT(5)
    shard_non_block(model, cfg, par, device_type="cpu")  # FSDP2's own objects are not dlo's
    return _cycle_layerwise(model, cfg, par)


def test_hsdp_two_ranks_leaves_no_cycle() -> None:
    assert assert_all_ok(run_ranks(_hsdp, 2, timeout_s=120)) == [True, True]


def test_mapped_host_backing_leaves_no_cycle(tmp_path: Path) -> None:
    from dlo.io.checkpoint import Checkpoint
    from dlo.io.writer import save_checkpoint
    from dlo.models import build_pipeline, make_inputs
    from dlo.pipelines.load import load_pipeline
    from tests.cpu.test_loader import DTYPE, PRESET

    path = save_checkpoint(build_pipeline(PRESET, dtype=DTYPE), tmp_path, max_shard_nbytes=12 << 20)
    ids, latents = make_inputs(PRESET, seed=0, dtype=DTYPE)
    cfg = dlo.OffloadConfig(
        mode="layer", components=("dit", "encoder"), chunk_mb=4, host_backing="mapped"
    )

    def skeleton() -> Any:
        return build_pipeline(PRESET, dtype=DTYPE, device="meta")

    with no_cyclic_garbage():
        pipe, backend = load_pipeline(skeleton, Checkpoint(path), cfg, dlo.ParallelConfig(), "cpu")
        assert backend is not None and backend.stats()["host_mapped_nbytes"] > 0
        with torch.no_grad():
            pipe.decode(pipe.denoise(latents, pipe.encode(ids), 2))
        backend.disable()
        del backend, pipe
