"""The disk tier under AllGather on two CUDA GPUs ([Note: disk read-ahead]): each rank reads
its 1/2 of every block left in the file with O_DIRECT into pinned read-ahead buffers, NCCL and
the copy engine gather them, bitwise against the resident model; restore=True gathers them
back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.host.region import LEDGER
from dlo.io.checkpoint import Checkpoint
from dlo.io.writer import save_checkpoint
from dlo.models import build_pipeline, make_inputs
from dlo.pipelines.load import load_pipeline
from tests.cpu.test_disk_tier import _skeleton, _steps
from tests.cpu.test_loader import DTYPE, PRESET
from tests.harness import assert_all_ok, gpu
from tests.multigpu.test_dlo_nccl import engine_ranks


def _disk_gathered(rank: int, world: int, ckpt_dir: str, engine: str) -> dict[str, Any]:
    dev = gpu(rank)
    ids, latents = make_inputs(PRESET, seed=rank, dtype=DTYPE, device=dev)
    refs = _steps(build_pipeline(PRESET, dtype=DTYPE).to(dev), ids, latents)
    cfg = dlo.OffloadConfig(
        mode="layer",
        components=("dit", "encoder"),
        transfer="allgather",
        gather_engine=engine,
        resident_layers=0,
        chunk_mb=4,
        host_budget_gb=0,
    )
    par = dlo.ParallelConfig(data_parallel_size=world)
    pipe, backend = load_pipeline(_skeleton, ckpt_dir, cfg, par, dev)
    assert backend is not None
    outs = _steps(pipe, ids, latents)
    torch.cuda.synchronize()
    st = backend.stats()
    backend.disable(restore=True)
    # the disk blocks alias their file again (on the host, as loaded); every weight as saved
    ckpt = Checkpoint(ckpt_dir)
    sd = pipe.state_dict()
    return {
        "same": all(torch.equal(a, b) for a, b in zip(outs, refs)),
        "restored": all(torch.equal(sd[k].cpu(), ckpt.tensor(k)) for k in ckpt.entries),
        "stats": {
            k: st[k]
            for k in (
                "num_disk_blocks",
                "disk_read_nbytes",
                "group_size",
                "host_pinned_nbytes",
                "read_ahead_buffer_nbytes",
                "gather_engine",
            )
        },
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.mark.parametrize("engine", ["nccl", "copy"])
def test_disk_tier_under_allgather_on_two_gpus_is_bitwise(tmp_path: Path, engine: str) -> None:
    save_checkpoint(build_pipeline(PRESET, dtype=DTYPE), tmp_path, max_shard_nbytes=12 << 20)
    outs = engine_ranks(engine, _disk_gathered, 2, str(tmp_path), engine, timeout_s=300)
    for rank, r in enumerate(assert_all_ok(outs) if outs is not None else []):
        st = r["stats"]
        assert r["same"] and r["restored"], (rank, r)
        assert st["group_size"] == 2 and st["num_disk_blocks"] > 0 and st["disk_read_nbytes"] > 0
        assert st["host_pinned_nbytes"] >= 2 * st["read_ahead_buffer_nbytes"] > 0
        assert st["gather_engine"] == engine
        assert r["ledger"] == (0, 0), rank
