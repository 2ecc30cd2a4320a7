"""Enable and disable inside ``torch.inference_mode()`` (a pipeline's ``__call__`` often is).

What dlo allocates at enable (slots, staging buffers, resident copies) is written in place
later, by the staging thread or by forwards outside inference mode; what disable restores
is the user's again. None of it may be an inference tensor ([Note: no inference tensors] in
``dlo.backends.base``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.platform.device import CpuPlatform
from tests.harness import assert_all_ok, run_ranks
from tests.toys import ToyDiT, ToyPipeline, clone


def _x(seed: int) -> torch.Tensor:
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed))


def _alternating(model: torch.nn.Module, ref: torch.nn.Module) -> list[bool]:
    same = []
    for s in range(4):
        with torch.no_grad() if s % 2 == 0 else torch.inference_mode():
            same.append(torch.equal(model(_x(s)), ref(_x(s))))
    return same


def _usable_after_disable(model: torch.nn.Module) -> None:
    with torch.no_grad():  # in-place on the restored weights, outside inference mode
        for t in [*model.parameters(), *model.buffers()]:
            assert not t.is_inference()
            t.add_(0)


@pytest.mark.parametrize(
    "kw",
    [
        {"mode": "layer"},
        {"mode": "layer", "num_slots": 1, "resident_layers": 1},
        {"mode": "module"},
    ],
    ids=["ring", "ring-resident", "model-swap"],
)
def test_enable_and_disable_inside_inference_mode(kw: dict[str, Any]) -> None:
    pipe = ToyPipeline()
    ref = clone(pipe)
    with torch.inference_mode():
        backend = dlo.enable_offload(pipe, dlo.OffloadConfig(**kw), device="cpu")
    assert backend is not None
    assert all(_alternating(pipe, ref))
    with torch.inference_mode():
        backend.disable()
    _usable_after_disable(pipe)
    assert all(_alternating(pipe, ref))


def _allgather(rank: int, world: int) -> list[bool]:
    model = ToyDiT(5)
    ref = clone(model)
    backend = LayerwiseBackend(
        dlo.OffloadConfig(mode="layer", transfer="allgather", collective_timeout_s=20.0),
        dlo.ParallelConfig(data_parallel_size=world),
        CpuPlatform(),
    )
    with torch.inference_mode():
        backend.enable(model)
    same = _alternating(model, ref)
    backend.disable()
    return same


def test_allgather_enabled_inside_inference_mode() -> None:
    for same in assert_all_ok(run_ranks(_allgather, 2, timeout_s=120)):
        assert all(same)


def test_mapped_backing_loaded_inside_inference_mode(tmp_path: Path) -> None:
    # the staging thread is never in inference mode: its buffers must not be inference tensors
    from dlo.io.checkpoint import Checkpoint
    from dlo.io.writer import save_checkpoint
    from dlo.models import build_pipeline, make_inputs
    from dlo.pipelines.load import load_pipeline
    from tests.cpu.test_loader import DTYPE, PRESET

    resident = build_pipeline(PRESET, dtype=DTYPE)
    path = save_checkpoint(resident, tmp_path, max_shard_nbytes=12 << 20)
    ids, latents = make_inputs(PRESET, seed=0, dtype=DTYPE)
    with torch.no_grad():
        want = resident.decode(resident.denoise(latents, resident.encode(ids), 2))
    cfg = dlo.OffloadConfig(
        mode="layer", components=("dit", "encoder"), chunk_mb=4, host_backing="mapped"
    )

    def skeleton() -> Any:
        return build_pipeline(PRESET, dtype=DTYPE, device="meta")

    with torch.inference_mode():
        pipe, backend = load_pipeline(skeleton, Checkpoint(path), cfg, dlo.ParallelConfig(), "cpu")
    assert backend is not None and backend.stats()["host_mapped_nbytes"] > 0
    for s in range(2):
        with torch.no_grad() if s == 0 else torch.inference_mode():
            got = pipe.decode(pipe.denoise(latents, pipe.encode(ids), 2))
        assert torch.equal(got, want)
    backend.disable()
