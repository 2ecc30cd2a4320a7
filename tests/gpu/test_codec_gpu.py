"""``codec="ans"`` on one CUDA GPU (nvCOMP's ANS; [Note: block codecs], [Note: decode
pipeline]): bitwise parity with the resident model, encoded host bytes, no steady-state
allocation, restore and ``state_dict`` bitwise (issue 22)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dlo
from dlo.host.region import LEDGER
from dlo.models import build_pipeline, make_inputs
from tests.cpu.test_codec import Fp8DiT
from tests.toys import ToyDiT, assert_same, clone, snapshot

pytest.importorskip("nvidia.nvcomp", reason="codec='ans' on CUDA needs nvidia-nvcomp-cu13")

DEV = torch.device("cuda", 0)


def _x(seed: int, dim: int) -> torch.Tensor:
    return torch.randn(2, 7, dim, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _run(model: nn.Module, n: int, dim: int) -> list[torch.Tensor]:
    out = []
    for s in range(n):
        with torch.inference_mode() if s % 2 else torch.no_grad():
            out.append(model(_x(s, dim)).clone())
    return out


def _enable(model: nn.Module, **kw: Any) -> dlo.OffloadBackend:
    b = dlo.enable_offload(
        model,
        dlo.OffloadConfig(**{"mode": "layer", "resident_layers": 0, "codec": "ans", **kw}),
        device=DEV,
    )
    assert b is not None
    return b


def _allocs() -> int:
    return int(torch.cuda.memory_stats(DEV)["allocation.all.allocated"])


@pytest.mark.parametrize("num_slots", [1, 2, 3])
@pytest.mark.parametrize(("make", "dim"), [(ToyDiT, 512), (Fp8DiT, 16)], ids=["bf16+fp32", "fp8"])
def test_parity_encoded_host_bytes_state_dict_and_restore(
    make: Any, dim: int, num_slots: int
) -> None:
    model = make(6, dim=dim) if make is ToyDiT else make(6)
    ref = _run(clone(model).to(DEV), 4, dim)
    before = snapshot(model)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    b = _enable(model, num_slots=num_slots, chunk_mb=1)
    got = _run(model, 4, dim)
    assert all(torch.equal(a, c) for a, c in zip(ref, got))
    sd = model.state_dict()
    assert all(torch.equal(sd[k].cpu(), v) for k, v in want.items())
    st = b.stats()
    assert st["codec_bitstream"] == "nvcomp-ans-f2"
    assert st["host_nbytes"] == st["host_encoded_nbytes"] == st["host_pinned_nbytes"]
    assert st["decode_ms"] > 0 and 0 < st["decode_ms_per_load"] < 50
    # the last piece decodes after its bytes arrived: a positive tail, a real rate
    assert 0 < st["decode_tail_ms_per_load"] < 50 and st["decode_gbps"] > 0
    if make is ToyDiT:  # 512 x 512 bf16 weights: the entropy coder shrinks them
        assert st["codec_ratio"] < 0.9, st["codec_ratio"]
    b.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    assert_same(before, model)


def test_no_device_allocation_after_warmup_with_the_codec() -> None:
    model = ToyDiT(6, dim=512)
    x = _x(0, 512)
    ref = clone(model).to(DEV)
    with torch.no_grad():
        ref(x)
        a0 = _allocs()
        ref(x)
        resident_allocs = _allocs() - a0
    b = _enable(model, chunk_mb=1)
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        a0, free0 = _allocs(), torch.cuda.mem_get_info(DEV)[0]
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        assert (_allocs() - a0) / 3 == resident_allocs  # the decoder allocates nothing
        # nor does nvCOMP outside torch's allocator (its scratch is set up at enable)
        assert torch.cuda.mem_get_info(DEV)[0] == free0
    b.disable()


def test_demo_pipeline_bitwise_with_the_codec_on_the_dit() -> None:
    ref = build_pipeline("tiny", device=DEV)
    pipe = build_pipeline("tiny")
    cfg = dlo.OffloadConfig(
        mode="layer", resident_layers=1, layer_options={"dit": {"codec": "ans"}}
    )
    b = dlo.enable_offload(pipe, cfg, device=DEV)
    assert b is not None
    ids, lat = make_inputs("tiny", seed=1, device=DEV)
    for _ in range(2):
        assert torch.equal(ref.generate(ids, lat, 3), pipe.generate(ids, lat, 3))
    st = b.stats()
    assert 0.5 < st["codec_ratio"] < 0.8, st["codec_ratio"]  # random bf16 weights: a proxy
    b.disable()


def test_node_shared_copy_encoded_and_pinned_on_one_gpu(tmp_path: Any) -> None:
    """A share group of one: the node's copy in shared memory holds the encoded blocks,
    page-locked, and decodes bitwise on the device (issue 22 with transfer="node-shared")."""
    model = ToyDiT(5, dim=512)
    ref = _run(clone(model).to(DEV), 3, 512)
    before = snapshot(model)
    b = _enable(model, transfer="node-shared", resident_layers=1, chunk_mb=1)
    assert all(torch.equal(a, c) for a, c in zip(ref, _run(model, 3, 512)))
    st = b.stats()
    assert st["transfer"] == "node-shared" and st["host_region_nbytes"] == 0
    assert st["host_nbytes"] == st["host_encoded_nbytes"] < st["host_encoded_raw_nbytes"]
    assert 0 < st["host_pinned_nbytes"] <= st["host_shared_nbytes"]
    assert st["decoded_nbytes"] > 0
    b.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    assert_same(before, model)


def test_encoded_checkpoint_written_and_read_on_the_gpu(tmp_path: Any) -> None:
    """nvCOMP's bitstream in an encoded checkpoint: a later enable reads every block from it,
    verified, and runs bitwise (issue 22 item 3; [Note: encoded checkpoint])."""
    from dlo.io.writer import save_checkpoint
    from dlo.pipelines.load import load_pipeline

    dt = torch.bfloat16
    path = save_checkpoint(build_pipeline("tiny", dtype=dt), tmp_path / "ckpt")
    ids, lat = make_inputs("tiny", seed=1, dtype=dt, device=DEV)
    ref = build_pipeline("tiny", dtype=dt, device=DEV).generate(ids, lat, 2)
    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0, codec="ans", chunk_mb=1)

    def load() -> Any:
        return load_pipeline(
            lambda: build_pipeline("tiny", dtype=dt, device="meta"), path, cfg, None, DEV
        )

    pipe, b = load()
    assert b is not None and b.stats()["encoded_read_blocks"] == 0
    (written,) = b.save_encoded()  # type: ignore[attr-defined]
    n = sum(1 for blk in b._blocks if blk.encoded is not None)  # type: ignore[attr-defined]
    b.disable()
    pipe, b = load()
    assert b is not None
    st = b.stats()
    assert st["encoded_read_blocks"] == n > 0 and st["codec_bitstream"] == "nvcomp-ans-f2"
    assert torch.equal(pipe.generate(ids, lat, 2), ref)
    b.disable()
    assert written.exists() and (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_state_dict_from_several_threads_is_bitwise_and_leaves_nothing_pinned() -> None:
    """[Note: bounce buffer]: decodes to the host take turns in the decoder's buffer, so
    concurrent ``state_dict()`` calls each get their own blocks' bytes."""
    from concurrent.futures import ThreadPoolExecutor

    model = ToyDiT(6, dim=512)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    b = _enable(model)
    pinned = LEDGER.pinned_nbytes
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: model.state_dict(), range(8)))
    for sd in got:
        assert sd.keys() == want.keys()
        assert all(torch.equal(sd[k].cpu(), want[k]) for k in want)
    assert LEDGER.pinned_nbytes == pinned  # every call's bounce released
    b.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
