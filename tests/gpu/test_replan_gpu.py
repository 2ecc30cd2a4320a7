"""Re-plans between forwards on a GPU ([Note: re-plan between forwards] in dlo.plan.replan),
from the CUDA allocator's own statistics under a device budget: the blocks enable keeps are
pins, more are pinned once a forward was measured, unpinned before a larger input, a forward that
cannot fit is refused before it runs (no out-of-memory error), and every output is the
resident model's bits, eager and compiled."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import dlo
from tests.toys import ToyDiT

DEV = torch.device("cuda")
DIM = 4096
BLOCKS = 32  # 96 MiB each (bf16), 3 GiB in all, with 128 MiB of fp32 non-block weights
BUDGET_GB = 3.5
"""Enable keeps a fifth of it for activations and streams about 7 blocks; a re-plan keeps
its margin (256 MiB) and reserve (5%) and pins some of them."""

DEFAULTS: dict[str, Any] = {"device_budget_gb": BUDGET_GB, "codec": "none"}
"""The automatic defaults under the budget, but the codec: these tests are the re-plans'
(an unset codec is "auto" on a GPU since 2026-12-07, and the 256-row forwards wait on their
copies, so it would turn on between forwards: tests/gpu/test_late_codec_gpu.py)."""


def _model(seed: int = 0) -> ToyDiT:
    torch.manual_seed(seed)
    return ToyDiT(BLOCKS, dim=DIM, seed=seed)


def _inputs(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, DIM, generator=g).to(DEV)


def _reference(rows_list: list[int], compile_blocks: bool) -> list[torch.Tensor]:
    model = _model().to(DEV)
    if compile_blocks:  # a static graph per shape: the same kernels in both models
        for b in model.blocks:
            b.compile(dynamic=False)
    with torch.inference_mode():
        out = [model(_inputs(r, i)).cpu() for i, r in enumerate(rows_list)]
    del model
    torch._dynamo.reset()  # its compiled code holds the model's weights
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _stats(backend: Any) -> dict[str, Any]:
    return dict(backend.stats())


@pytest.mark.parametrize("compile_blocks", [False, True], ids=["eager", "compiled"])
def test_budgeted_defaults_pin_unpin_and_stay_bitwise(compile_blocks: bool) -> None:
    rows = [256, 256, 256, 256, 4096, 4096, 256]
    want = _reference(rows, compile_blocks)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = _model()
    if compile_blocks:
        for b in model.blocks:
            b.compile(dynamic=False)
    backend = dlo.enable_offload(model, dlo.OffloadConfig(**DEFAULTS), device=DEV)
    try:
        st = _stats(backend)
        kept = st["num_pinned_blocks"]  # the policy's kept blocks: pins in the ring
        assert st["num_streamed_blocks"] == BLOCKS and st["num_resident_blocks"] == 0
        assert 0 < BLOCKS - kept < BLOCKS, st["policy"]["explanation"]
        outs, pinned, loads = [], [], []
        for i, r in enumerate(rows):
            try:
                with torch.inference_mode():
                    outs.append(model(_inputs(r, i)).cpu())
            except torch.OutOfMemoryError as e:
                raise AssertionError(f"forward {i}: pinned {pinned}, {_stats(backend)}") from e
            st = _stats(backend)
            pinned.append(st["num_pinned_blocks"])
            loads.append(st["num_loads"])
        for i, (a, b) in enumerate(zip(outs, want)):
            assert torch.equal(a, b), i
        records = st["policy"]["replans"]
        assert pinned[0] == kept and pinned[1] > kept, (pinned, records)
        assert loads[3] - loads[2] == BLOCKS - pinned[2]  # pinned blocks load nothing
        # 4096 rows of 4096 floats: activations of about half a GiB, more than the room the
        # pinned blocks left: unpinned before that forward ran
        assert pinned[4] < pinned[3], (pinned, records)
        assert [r["action"] for r in records][:2] == ["pin", "unpin"], records
    finally:
        backend.disable()


def test_a_larger_forward_unpins_what_enable_kept_instead_of_failing() -> None:
    """The blocks enable keeps are pins: a 10 K-row forward, which did not fit beside them
    (refused while they were resident blocks), runs once they are unpinned, bitwise and with
    no out-of-memory error. (A refusal needs memory no re-plan can free: CPU-tested.)"""
    rows = [256, 512, 768, 10240, 256]
    want = _reference(rows, False)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = _model()
    backend = dlo.enable_offload(model, dlo.OffloadConfig(**DEFAULTS), device=DEV)
    try:
        kept = _stats(backend)["num_pinned_blocks"]
        pinned = []
        for i, r in enumerate(rows):
            with torch.inference_mode():
                assert torch.equal(model(_inputs(r, i)).cpu(), want[i]), i
            pinned.append(_stats(backend)["num_pinned_blocks"])
        assert pinned[3] < kept, (kept, pinned, _stats(backend)["policy"]["replans"])
    finally:
        backend.disable()
