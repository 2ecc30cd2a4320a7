"""The disk tier on a GPU ([Note: disk read-ahead]): blocks beyond ``host_budget_gb`` read
from their file with O_DIRECT into page-locked read-ahead buffers, copied on the copy
stream while the previous block computes, bitwise against the resident model on the
device; pipeline folders through ``dlo run --pipeline --host-budget-gb``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.cli import main
from dlo.host.region import LEDGER
from dlo.io.writer import save_checkpoint
from dlo.models import build_pipeline, make_inputs
from dlo.pipelines.load import load_pipeline
from tests.cpu.test_disk_tier import _skeleton, _steps
from tests.cpu.test_loader import DTYPE, PRESET
from tests.cpu.test_pipeline_folders import _call_flags, _folder


def _bitwise_stats(
    ckpt: str, cfg: dlo.OffloadConfig, ids: torch.Tensor, latents: torch.Tensor, refs: list[Any]
) -> dict[str, Any]:
    """The preset loaded from ``ckpt`` under ``cfg`` on the GPU, its steps bitwise against
    ``refs``; its stats, disabled."""
    pipe, backend = load_pipeline(_skeleton, ckpt, cfg, None, "cuda")
    assert backend is not None
    outs = _steps(pipe, ids, latents)
    torch.cuda.synchronize()
    st = backend.stats()
    backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(outs, refs))
    return st


@pytest.mark.parametrize(("share", "slots"), [(0.0, 2), (0.5, 3)])
def test_disk_blocks_are_bitwise_on_the_gpu(tmp_path: Path, share: float, slots: int) -> None:
    resident = build_pipeline(PRESET, dtype=DTYPE)
    path = save_checkpoint(resident, tmp_path, max_shard_nbytes=12 << 20)
    ids, latents = make_inputs(PRESET, seed=0, dtype=DTYPE, device="cuda")
    refs = _steps(resident.to("cuda"), ids, latents)
    blocks = sum(
        t.numel() * t.element_size()
        for n, t in resident.state_dict().items()
        if ".blocks." in n or ".layers." in n
    )
    del resident
    cfg = dlo.OffloadConfig(
        mode="layer",
        components=("dit", "encoder"),
        resident_layers=0,
        num_slots=slots,
        chunk_mb=4,
        host_budget_gb=share * blocks / (1 << 30),
    )
    st = _bitwise_stats(str(path.parent), cfg, ids, latents, refs)
    assert st["num_disk_blocks"] > 0 and st["disk_read_nbytes"] >= st["disk_nbytes"]
    # the read-ahead buffers are page-locked (the copies run from pinned memory)
    assert st["host_pinned_nbytes"] >= 2 * st["read_ahead_buffer_nbytes"] > 0
    assert st["host_region_nbytes"] <= share * blocks and st["disk_probe_gbps"] > 0
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


# each folder in the dtype it is stored in: a cast on load copies the blocks, and the tier
# refuses a block that is not in its file (tests/cpu/test_disk_tier.py)
@pytest.mark.parametrize(("name", "dtype"), [("tiny-flux", "float32"), ("tiny-wan2.2", "bfloat16")])
def test_pipeline_folder_from_disk_is_bitwise_on_the_gpu(
    tmp_path: Path, name: str, dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path, name)
    argv = ["run", "--pipeline", str(folder), "--steps", "2", "--check", "--json"]
    argv += ["--dtype", dtype, *_call_flags(name), "--resident-layers", "0"]
    argv += ["--host-budget-gb", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    (r,) = json.loads(out[out.index("[") :])
    assert r["parity"] is True and r["num_disk_blocks"] > 0 and r["disk_read_nbytes"] > 0, r
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


@pytest.mark.parametrize(("share", "presaved"), [(0.0, True), (0.5, False)])
def test_encoded_disk_blocks_are_bitwise_on_the_gpu(
    tmp_path: Path, share: float, presaved: bool
) -> None:
    """[Note: encoded blocks on disk]: the encoded checkpoint's bytes read at every use, every
    piece checked, decoded by nvCOMP on the decode stream; bitwise against resident. Without
    a file written before, the budgeted enable encodes the disk blocks into it first."""
    pytest.importorskip("nvidia.nvcomp", reason="codec='ans' on CUDA needs nvidia-nvcomp-cu13")
    resident = build_pipeline(PRESET, dtype=DTYPE)
    path = save_checkpoint(resident, tmp_path, max_shard_nbytes=12 << 20)
    ids, latents = make_inputs(PRESET, seed=0, dtype=DTYPE, device="cuda")
    refs = _steps(resident.to("cuda"), ids, latents)
    del resident
    cfg = dict(mode="layer", components=("dit", "encoder"), resident_layers=0, chunk_mb=4)
    _, backend = load_pipeline(
        _skeleton, str(path.parent), dlo.OffloadConfig(**cfg, codec="ans"), None, "cuda"
    )
    assert backend is not None
    raw = sum(b.layout.shard_nbytes for b in backend._blocks)  # type: ignore[attr-defined]
    if presaved:
        backend.save_encoded()  # type: ignore[attr-defined]
    backend.disable()
    budget = dlo.OffloadConfig(**cfg, codec="ans", host_budget_gb=share * raw / (1 << 30))
    st = _bitwise_stats(str(path.parent), budget, ids, latents, refs)
    assert st["num_disk_encoded_blocks"] == st["num_disk_blocks"] > 0
    assert st["codec_bitstream"] == "nvcomp-ans-f2" and st["encoded_h2d_nbytes"] > 0
    assert 0 < st["disk_nbytes"] <= st["disk_read_nbytes"]
    assert st["host_pinned_nbytes"] >= 2 * st["read_ahead_buffer_nbytes"] > 0
    assert st["host_region_nbytes"] <= share * raw
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
