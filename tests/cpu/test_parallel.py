"""Rank layout (pure) and process groups built from torchrun-style environments (gloo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import dlo
from dlo.parallel.groups import axis_groups, build_groups, group_of
from tests.harness import assert_all_ok, run_program, run_ranks

ROOT = Path(__file__).resolve().parents[2]


def test_axis_groups_cover_the_world_once() -> None:
    par = dlo.ParallelConfig(data_parallel_size=2, sequence_parallel_size=3, tensor_parallel_size=2)
    for axis in ("data", "sequence", "tensor", "local"):
        ranks = sorted(r for g in axis_groups(par, axis) for r in g)
        assert ranks == list(range(12)), axis
    assert group_of(par, "tensor", 5) == [4, 5]  # tp fastest
    assert group_of(par, "sequence", 5) == [1, 3, 5]
    assert group_of(par, "data", 5) == [5, 11]
    hsdp = dlo.ParallelConfig(data_parallel_size=8, hsdp_replicate_size=2, hsdp_shard_size=4)
    assert group_of(hsdp, "shard", 5) == [4, 5, 6, 7]
    assert group_of(hsdp, "replicate", 5) == [1, 5]


def _groups(rank: int, world: int, kw: dict[str, int]) -> dict[str, Any]:
    state = build_groups(dlo.ParallelConfig(**kw), device_type="cpu")
    out = {axis: dist.get_process_group_ranks(g) for axis, g in state.groups.items()}
    out["mesh"] = None if state.mesh is None else state.mesh.mesh.tolist()
    return out


@pytest.mark.parametrize(
    ("kw", "want_rank1"),
    [
        (
            {"data_parallel_size": 2, "sequence_parallel_size": 2},
            {"data": [1, 3], "sequence": [0, 1]},
        ),
        (
            {"data_parallel_size": 4, "hsdp_replicate_size": 2, "hsdp_shard_size": 2},
            {"data": [0, 1, 2, 3], "shard": [0, 1], "replicate": [1, 3]},
        ),
    ],
)
def test_groups_and_mesh_world_4(kw: dict[str, int], want_rank1: dict[str, list[int]]) -> None:
    res = assert_all_ok(run_ranks(_groups, 4, kw, timeout_s=120))
    got = {k: v for k, v in res[1].items() if k != "mesh"}
    assert got == want_rank1
    if "hsdp_shard_size" in kw:
        assert res[0]["mesh"] == [[0, 1], [2, 3]]


def _mismatch(rank: int, world: int) -> str:
    try:
        build_groups(dlo.ParallelConfig(data_parallel_size=3))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_sizes_not_matching_world_name_the_fields() -> None:
    outs = assert_all_ok(run_ranks(_mismatch, 2, timeout_s=60))
    assert all("data_parallel_size=3" in o and "WORLD_SIZE=2" in o for o in outs)


_EXIT_PROGRAM = """
import atexit, sys
import torch
import torch.distributed as dist
from torch import nn
import dlo

# registered before dlo's handler, so it runs after it (atexit runs last-in, first-out)
atexit.register(lambda: print(f"group at exit: {dist.is_initialized()}", flush=True))
if sys.argv[1] == "user":
    dist.init_process_group("gloo")


class Model(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


torch.manual_seed(0)
model = Model()
backend = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer", transfer="allgather"))
with torch.inference_mode():
    model(torch.randn(2, 8))
backend.disable()
if sys.argv[1] == "user":
    print(f"user group still there: {dist.is_initialized()}", flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("who", ["dlo", "user"])
def test_the_group_dlo_creates_is_destroyed_at_exit(who: str, tmp_path: Path) -> None:
    # [Note: the group dlo creates]: left to interpreter finalization, gloo can abort a
    # successful run; a group the user created stays the user's
    program = tmp_path / "program.py"
    program.write_text(_EXIT_PROGRAM)
    done = run_program(program, who, ranks=2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("group at exit: False") == 2, done.stdout + done.stderr
    if who == "user":
        assert done.stdout.count("user group still there: True") == 2, done.stdout
