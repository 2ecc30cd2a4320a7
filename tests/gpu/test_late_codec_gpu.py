"""The codec turned on by measurement on a GPU ([Note: codec turned on by measurement] in
dlo.runtime.late_codec): a ring of large blocks computing little waits on its copies, so
``codec="auto"`` (no ``block_compute_ms``) encodes it in the background with nvCOMP and
switches it between forwards; every output is the resident model's bits, before, during and
after the switch, eager and compiled; a ring that computes enough stays raw."""

from __future__ import annotations

import gc
import weakref
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


def _decoder_refs(b: Any) -> list[weakref.ref]:
    """Weak references to the late codec's decoder and its device staging buffers (its only
    device memory that outlives a forward): disable must free them."""
    (ring,) = b._scheduler.rings
    decoders = {id(s.transport.decoder): s.transport.decoder for s in ring.blocks if s.raw}
    assert decoders, "no block was switched"
    return [weakref.ref(x) for d in decoders.values() for x in [d, *d._staging]]


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
        decoder = _decoder_refs(b)
    finally:
        b.disable()
    assert all(r() is None for r in decoder)  # freed by disable itself, compiled or not
    if compiled:  # its compiled code keeps tensors it ran with alive (as test_replan_gpu's)
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() < 64 << 20


ROWS_RAW = 16384
"""A block's two matmuls at 16384 rows are about 1.65 TFLOP, 2.5-3.5 ms on an H100 (its
fp32 norm and tanh about 1 ms more), while its 96 MiB copy takes about 1.9 ms (pinned,
~52 GB/s): a block computes about twice as long as the next one's copy takes."""

BLOCKS_RAW = 176
BUDGET_RAW_GB = 10.0
"""Enable keeps 20% of the budget for activations it cannot know yet (FREE_MEMORY_HEADROOM;
the first re-plan corrects it from the second forward): 2 GiB here, where a forward at 16384
rows peaks at about 1.5 GiB (the fp32 input and hidden states, 256 MiB each, and the
block's fp32 temporaries, up to four of those at once); with a 3 GiB budget it ran out in
the first forward (H100, 2026-12-07). The other 8 GiB hold the non-block weights (128 MiB),
two slots and about 80 of the blocks, pinned: with 176 blocks more of them stream than are
pinned, so runs of streamed blocks follow each other and their copies must hide under one
block's compute (not only under the pinned blocks spread between them)."""


def test_a_ring_that_computes_enough_stays_raw() -> None:
    """The copies hide under the compute: measured on the ring's own forwards, the exposed
    wait stays under a tenth of the forward and the codec is never turned on."""
    torch.manual_seed(0)
    model = ToyDiT(BLOCKS_RAW, dim=DIM)
    cfg = dlo.OffloadConfig(mode="layer", codec="auto", device_budget_gb=BUDGET_RAW_GB)
    b = dlo.enable_offload(model, cfg, device=DEV)
    assert b is not None
    try:
        st = b.stats()
        pinned = st["num_pinned_blocks"]
        assert st["num_streamed_blocks"] - pinned >= pinned > 0, st["policy"]["explanation"]
        with torch.inference_mode():
            for i in range(6):
                model(_inputs(ROWS_RAW, i))
        torch.cuda.synchronize()
        st = b.stats()
        assert st["num_streamed_blocks"] - st["num_pinned_blocks"] >= BLOCKS_RAW // 3
        late = _late(b)
        late.timings.collect()
        late._bound()  # reads the last steady forward's times
        assert late.state == "watching", late.record.__self__
        assert late.forward_ms > 0 and late.exposed_ms < 0.1 * late.forward_ms
        assert st["codec_late"] == {"": "watching"} and st["decoded_nbytes"] == 0
    finally:
        b.disable()
