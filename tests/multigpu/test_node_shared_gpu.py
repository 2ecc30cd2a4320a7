"""Node-shared host copy on two CUDA GPUs: both processes register the one shared mapping
and stream whole blocks from it (see [Note: node-shared host copy])."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dlo.host.region import LEDGER
from dlo.platform.env import shared_memory_dir
from tests.harness import assert_all_ok, gpu, run_ranks
from tests.multigpu.test_dlo_nccl import (
    NCCL_ENV,
    _backend,
    _steps,
    delay_copy_stream,
    warm_then_steady,
)
from tests.toys import ToyDiT, clone

DIM = 256


def _node_shared(rank: int, world: int, delayed: bool) -> dict[str, Any]:
    dev = gpu(rank)
    model = ToyDiT(7, dim=DIM)
    ref = _steps(clone(model).to(dev), rank, 4, DIM)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if delayed:
        delay_copy_stream()
    b = _backend(rank, world, transfer="node-shared", resident_layers=1)
    b.enable(model)
    left = [f for f in os.listdir(shared_memory_dir()) if f.startswith("dlo-")]
    got, more, new_segments = warm_then_steady(model, rank, DIM)
    st = b.stats()
    assert b._shared is not None
    streamed = [i for i, x in enumerate(b._blocks) if not x.resident]
    registered = LEDGER.pinned_nbytes
    all_pinned = all(b._shared.is_pinned(i) for i in streamed)
    streamed_nbytes = sum(b._blocks[i].layout.shard_nbytes for i in streamed)
    b.disable()
    ref_more = _steps(clone(ToyDiT(7, dim=DIM)).to(dev), rank, 3, DIM)
    return {
        "same": all(torch.equal(x, y) for x, y in zip(ref + ref_more, got + more)),
        "restored": all(torch.equal(before[k], v) for k, v in model.state_dict().items()),
        "stats": {k: v for k, v in st.items() if k != "block_wait_ms"},
        "streamed_nbytes": streamed_nbytes,
        "registered": registered,
        "all_pinned": all_pinned,
        "files_while_enabled": left,
        "new_segments": new_segments,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.mark.parametrize("delayed", [False, True])
def test_node_shared_parity_whole_blocks_one_copy(delayed: bool) -> None:
    res = assert_all_ok(
        run_ranks(_node_shared, 2, delayed, backend="nccl", timeout_s=240, env=NCCL_ENV)
    )
    for r in res:
        st = r["stats"]
        assert r["same"] and r["restored"]
        assert st["transfer"] == "node-shared" and st["host_share_ranks"] == 2
        assert st["group_size"] == 1 and st["allgather_nbytes"] == 0
        # whole blocks (all of one size) over this rank's own link: every streamed block
        # once per forward (7), the ring's prefetch of the next forward's first, the
        # resident one at enable
        block = r["streamed_nbytes"] // 6
        assert st["num_loads"] == 7 * 6 + 1 + 1 and st["num_demand_loads"] == 0
        assert st["h2d_nbytes"] == st["num_loads"] * block
        # each process registered the whole shared mapping's streamed blocks; charged half
        assert r["all_pinned"] and r["registered"] == r["streamed_nbytes"]
        assert st["host_pinned_nbytes"] * 2 >= r["streamed_nbytes"]
        assert st["host_pinned_nbytes"] * 2 <= r["streamed_nbytes"] + 2 * 6
        assert r["files_while_enabled"] == []  # unlinked once both had it mapped
        assert r["new_segments"] == 0 and r["ledger"] == (0, 0)
