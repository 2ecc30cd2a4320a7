"""The codec and quantized weights on two CUDA GPUs (issue 22 on issue 24's machine): AllGather
with ``codec="ans"`` (each rank decodes its slices, then the gather; NCCL and the copy engine)
and node-shared with the codec (each sharer encodes 1/L of the blocks), bitwise against the
resident model, restore bitwise; torchao int8 weights under AllGather, the wrappers on the
device while enabled and back on the host after disable."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from dlo.host.region import LEDGER
from tests.cpu.test_codec import Fp8DiT
from tests.harness import assert_all_ok, gpu, run_ranks
from tests.multigpu.test_dlo_nccl import (
    NCCL_ENV,
    _backend,
    _steps,
    engine_ranks,
    warm_then_steady,
)
from tests.toys import clone, snapshot


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_nvcomp = pytest.mark.skipif(
    not _has("nvidia.nvcomp"), reason="codec='ans' on CUDA needs nvidia-nvcomp-cu13"
)

DIM = 256


def _codec(rank: int, world: int, transfer: str, engine: str) -> dict[str, Any]:
    dev = gpu(rank)
    model = Fp8DiT(7, dim=DIM)  # bf16 weights, fp32 norms, fp8 weights with fp32 scales
    ref = _steps(clone(model).to(dev), rank, 4, DIM)
    ref_more = _steps(clone(model).to(dev), rank, 3, DIM)
    before = snapshot(model)
    kw: dict[str, Any] = {"gather_engine": engine} if transfer == "allgather" else {}
    b = _backend(rank, world, transfer=transfer, codec="ans", chunk_mb=1, resident_layers=1, **kw)
    b.enable(model)
    got, more, new_segments = warm_then_steady(model, rank, DIM)
    st = b.stats()
    b.disable(restore=True)
    after = snapshot(model)
    restored = all(
        torch.equal(before[k][-1], after[k][-1]) and before[k][:-1] == after[k][:-1] for k in before
    )
    return {
        "same": all(torch.equal(x, y) for x, y in zip(ref + ref_more, got + more)),
        "restored": restored,
        "encoded": st["host_encoded_nbytes"],
        "raw": st["host_encoded_raw_nbytes"],
        "host": st["host_nbytes"],
        "decoded": st["decoded_nbytes"],
        "transfer": st["transfer"],
        "new_segments": new_segments,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@needs_nvcomp
@pytest.mark.parametrize(
    ("transfer", "engine"), [("allgather", "nccl"), ("allgather", "copy"), ("node-shared", "")]
)
def test_codec_across_two_gpus_is_bitwise(transfer: str, engine: str) -> None:
    outs = engine_ranks(engine, _codec, 2, transfer, engine, timeout_s=300)
    for rank, r in enumerate(assert_all_ok(outs) if outs is not None else []):
        assert r["same"] and r["restored"], rank
        assert r["transfer"] == transfer and r["decoded"] > 0, (rank, r)
        assert 0 < r["encoded"] < r["raw"], (rank, r)
        assert r["new_segments"] == 0, (rank, r)  # the decode allocates nothing either
        assert r["ledger"] == (0, 0), rank


def _quantized(rank: int, world: int) -> dict[str, Any]:
    from tests.cpu.test_subclasses import QDiT, _xs

    dev = gpu(rank)
    xs = [x.to(dev) for x in _xs(rank)]
    with torch.no_grad():
        want = [QDiT("int8", 5).to(dev)(x) for x in xs]
    model = QDiT("int8", 5)
    b = _backend(rank, world, chunk_mb=1)
    b.enable(model)
    on_device = all(p.device == dev for p in model.parameters())
    with torch.no_grad():
        got = [model(x) for x in xs]
    st = b.stats()
    b.disable(restore=True)
    with torch.no_grad():
        host = [QDiT("int8", 5)(x.cpu()) for x in xs]
        back = [model(x.cpu()) for x in xs]
    return {
        "same": all(torch.equal(a, c) for a, c in zip(want, got)),
        "on_device": on_device,
        "back_on_host": all(p.device.type == "cpu" for p in model.parameters()),
        "restored": all(torch.equal(a, c) for a, c in zip(host, back)),
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
        "gathered": (st["transfer"], st["group_size"], st["allgather_nbytes"] > 0),
    }


@pytest.mark.skipif(not _has("torchao"), reason="needs torchao")
def test_torchao_weights_under_allgather_on_two_gpus() -> None:
    res = assert_all_ok(run_ranks(_quantized, 2, backend="nccl", timeout_s=300, env=NCCL_ENV))
    for rank, r in enumerate(res):
        assert r["same"] and r["on_device"] and r["back_on_host"] and r["restored"], (rank, r)
        assert r["ledger"] == (0, 0), rank
        assert r["gathered"] == ("allgather", 2, True), (rank, r["gathered"])
