"""torchao int8/fp8 weight-only tensors streamed as stored on one CUDA GPU ([Note: tensor
subclasses], issue 22 item 5): bitwise against the same quantized model resident, the
wrappers report the device while enabled and their host devices after disable, with and
without the codec, and under torch.compile (inductor)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import dlo
from dlo.host.region import LEDGER
from dlo.plan.subclasses import flatten, is_wrapper, tensor_nbytes
from tests.cpu.test_subclasses import QDiT, _xs

DEV = torch.device("cuda", 0)


def _has_nvcomp() -> bool:
    try:
        return importlib.util.find_spec("nvidia.nvcomp") is not None
    except ModuleNotFoundError:  # no nvidia namespace at all
        return False


CODECS = ["none", "ans"] if _has_nvcomp() else ["none"]


def _run(model: torch.nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x.to(DEV)) for x in xs]


def _leaves(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        leaf: x
        for name, t in model.named_parameters()
        if is_wrapper(t)
        for leaf, x in flatten(name, t).leaves()
    }


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_blocks_stream_as_stored_on_the_gpu(kind: str, codec: str) -> None:
    xs = _xs(n=3)
    want = _run(QDiT(kind).to(DEV), xs)
    model = QDiT(kind)
    before = {k: v.clone() for k, v in _leaves(model).items()}
    ids = {n: id(t) for n, t in model.named_parameters()}
    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0, num_slots=2, codec=codec)
    b = dlo.enable_offload(model, cfg, device=DEV)
    got = _run(model, xs)
    assert all(torch.equal(a, c) for a, c in zip(want, got))
    assert all(t.device == DEV for t in model.parameters()), "a wrapper left on the host"
    stats = b.stats()
    bf16 = sum(p.numel() * 2 for p in QDiT(kind).blocks.parameters())
    stored = sum(tensor_nbytes(p) for p in QDiT(kind).blocks.parameters())
    assert stats["host_nbytes"] < 0.7 * bf16 and stored < 0.7 * bf16
    sd = model.state_dict()
    ref = QDiT(kind).state_dict()
    for k in ("blocks.0.up.weight", "blocks.2.down.weight"):
        for (_, x), (_, y) in zip(flatten(k, sd[k]).leaves(), flatten(k, ref[k]).leaves()):
            assert torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8)), k
    b.disable()
    assert {n: id(t) for n, t in model.named_parameters()} == ids
    assert all(t.device.type == "cpu" for t in model.parameters())
    after = _leaves(model)
    assert all(after[k].device.type == "cpu" for k in before)
    assert all(
        torch.equal(v.view(torch.uint8), after[k].view(torch.uint8)) for k, v in before.items()
    )
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_compiled_quantized_blocks_on_the_gpu(kind: str) -> None:
    xs = _xs(n=3)
    torch._dynamo.reset()
    ref = QDiT(kind).to(DEV)
    for blk in ref.blocks:
        blk.compile(fullgraph=True)
    want = _run(ref, xs)
    torch._dynamo.reset()
    model = QDiT(kind)
    for blk in model.blocks:
        blk.compile(fullgraph=True)
    b = dlo.enable_offload(
        model, dlo.OffloadConfig(mode="layer", resident_layers=0, num_slots=1), device=DEV
    )
    got = _run(model, xs)
    again = _run(model, xs)
    b.disable()
    assert all(torch.equal(a, c) for a, c in zip(want, got))
    assert all(torch.equal(a, c) for a, c in zip(want, again))
