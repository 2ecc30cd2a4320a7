"""The codec turned on by measurement on a GPU ([Note: codec turned on by measurement] in
dlo.runtime.late_codec): a ring of large blocks computing little waits on its copies, so
``codec="auto"`` (no ``block_compute_ms``) encodes it in the background with nvCOMP and
switches it between forwards; every output is the resident model's bits, before, during and
after the switch, eager and compiled; a ring that computes enough stays raw."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import dlo
from tests.toys import ToyDiT

pytest.importorskip("nvidia.nvcomp", reason="codec='ans' on CUDA needs nvidia-nvcomp-cu13")

DEV = torch.device("cuda")
DIM = 4096
BLOCKS = 16  # 96 MiB each (bf16): 1.5 GiB streamed through 2 slots


def _model() -> ToyDiT:
    torch.manual_seed(0)
    return ToyDiT(BLOCKS, dim=DIM)


def _inputs(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, DIM, generator=g).to(DEV)


def _reference(rows: int, n: int, compiled: bool) -> list[torch.Tensor]:
    model = _model().to(DEV)
    if compiled:
        for b in model.blocks:
            b.compile(dynamic=False)
    with torch.inference_mode():
        out = [model(_inputs(rows, i)).cpu() for i in range(n)]
    del model
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _late(b: Any) -> Any:
    (ring,) = b._scheduler.rings
    return ring.replanner.late


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_transfer_bound_ring_is_encoded_and_switched_bitwise(compiled: bool) -> None:
    """Eight rows a forward: the blocks compute next to nothing, every copy is exposed."""
    n = 12
    ref = _reference(8, n, compiled)
    model = _model()
    if compiled:
        for blk in model.blocks:
            blk.compile(dynamic=False)
    cfg = dlo.OffloadConfig(mode="layer", codec="auto", device_budget_gb=1.2)
    b = dlo.enable_offload(model, cfg, device=DEV)
    assert b is not None
    try:
        xs = [_inputs(8, i) for i in range(n)]  # on the device: nothing below synchronizes
        out = []
        with torch.inference_mode():
            for x in xs:
                out.append(model(x))
                late = _late(b)
                if late.state == "encoding" and late._thread is not None:
                    late._thread.join()  # the switch comes at the next forward
        assert all(torch.equal(x, y.cpu()) for x, y in zip(ref, out))
        st = b.stats()
        records = [r for r in st["policy"]["replans"] if r["action"].startswith("codec")]
        assert st["codec_late"] == {"": "on"}, records
        on = records[-1]
        assert on["exposed_wait_ms"] >= 0.1 * on["forward_ms"] > 0
        assert 0.5 < on["ratio"] < 0.8  # random normal bf16: about 0.69
        assert st["decoded_nbytes"] > 0 and st["encoded_h2d_nbytes"] < st["decoded_nbytes"]
    finally:
        b.disable()
    assert torch.cuda.memory_allocated() < 64 << 20


def test_a_ring_that_computes_enough_stays_raw() -> None:
    """16384 rows a forward: a block computes about twice as long as its copy takes, and
    the copies hide under the compute."""
    torch.manual_seed(0)
    model = ToyDiT(48, dim=DIM)
    b = dlo.enable_offload(
        model, dlo.OffloadConfig(mode="layer", codec="auto", device_budget_gb=3.0), device=DEV
    )
    assert b is not None
    try:
        assert b.stats()["num_streamed_blocks"] > b.stats()["num_pinned_blocks"]
        with torch.inference_mode():
            for i in range(6):
                model(_inputs(16384, i))
        torch.cuda.synchronize()
        late = _late(b)
        late.timings.collect()
        late._bound()  # reads the last steady forward's times
        assert late.state == "watching", late.record.__self__
        assert late.forward_ms > 0 and late.exposed_ms < 0.1 * late.forward_ms
    finally:
        b.disable()
