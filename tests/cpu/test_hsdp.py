"""HSDP composition on CPU (gloo): FSDP2 owns the non-block weights, dlo the blocks, and
dlo's AllGather runs on the shard axis only."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dlo
from dlo.backends.hsdp import shard_non_block
from dlo.backends.layerwise import LayerwiseBackend
from dlo.parallel.groups import group_of
from dlo.platform.device import CpuPlatform
from dlo.runtime import transport
from tests.harness import assert_all_ok, run_ranks
from tests.toys import ToyDiT, clone


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(10 * rank + step))


def _hsdp(rank: int, world: int, replicate: int, shard: int, transfer: str) -> dict[str, Any]:
    par = dlo.ParallelConfig(
        data_parallel_size=world, hsdp_replicate_size=replicate, hsdp_shard_size=shard
    )
    cfg = dlo.OffloadConfig(mode="layer", transfer=transfer, collective_timeout_s=20.0)
    model = ToyDiT(5)
    ref_model = clone(model)
    counts: Counter[tuple[int, ...]] = Counter()
    real = transport.all_gather_into

    def counting(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
        counts[tuple(dist.get_process_group_ranks(group))] += 1
        real(output, input, group)

    transport.all_gather_into = counting  # type: ignore[assignment]
    shard_non_block(model, cfg, par, device_type="cpu")
    dtensor_names = {n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"}
    backend = LayerwiseBackend(cfg, par, CpuPlatform())
    backend.enable(model)
    block_names = {
        f"{b.name}.{n}" for b in backend._blocks for n, k, _ in b.entries if k == "param"
    }
    same = []
    for step in range(4):
        ctx = torch.inference_mode() if step % 2 else torch.no_grad()
        with ctx:
            same.append(torch.equal(ref_model(_x(rank, step)), model(_x(rank, step))))
    st = backend.stats()
    backend.disable()
    transport.all_gather_into = real  # type: ignore[assignment]
    all_params = {n for n, _ in ref_model.named_parameters()}
    return {
        "share_ranks": st["host_share_ranks"],
        "same": same,
        "dtensor": sorted(dtensor_names),
        "blocks": sorted(block_names),
        "all": sorted(all_params),
        "groups": sorted(counts),
        "group_size": st["group_size"],
        "shard_group": group_of(par, "shard", rank),
    }


@pytest.mark.parametrize(("replicate", "shard"), [(2, 2), (1, 2)])
@pytest.mark.parametrize("transfer", ["allgather", "rank-local", "node-shared"])
def test_hsdp_parity_ownership_and_shard_axis(replicate: int, shard: int, transfer: str) -> None:
    world = replicate * shard
    res = assert_all_ok(run_ranks(_hsdp, world, replicate, shard, transfer, timeout_s=180))
    for r in res:
        assert all(r["same"]), r["same"]
        # every parameter has exactly one owner
        assert set(r["dtensor"]).isdisjoint(r["blocks"])
        assert set(r["dtensor"]) | set(r["blocks"]) == set(r["all"])
        assert r["dtensor"] == ["embed.bias", "embed.weight", "head.bias", "head.weight"]
        if transfer == "allgather":
            assert r["groups"] == [tuple(r["shard_group"])]  # the shard axis only
            assert r["group_size"] == shard
        else:
            assert r["groups"] == [] and r["group_size"] == 1
        # node-shared: one host copy per shard group (the axis AllGather would use)
        assert r["share_ranks"] == (shard if transfer == "node-shared" else 1)


def test_shard_non_block_needs_hsdp() -> None:
    with pytest.raises(ValueError, match="needs HSDP"):
        shard_non_block(ToyDiT(2), dlo.OffloadConfig(), dlo.ParallelConfig())


class _UnevenDiT(ToyDiT):
    """FSDP2 shards ``extra`` (3 rows) as 2 + 1 rows: the ranks hold different non-block bytes."""

    def __init__(self) -> None:
        super().__init__(4)
        self.extra = torch.nn.Parameter(torch.zeros(3, 8192))


def _budget(rank: int, world: int, budget_nbytes: int) -> dict[str, Any]:
    par = dlo.ParallelConfig(data_parallel_size=world, hsdp_shard_size=world)
    cfg = dlo.OffloadConfig(
        mode="layer",
        transfer="allgather",
        device_budget_gb=budget_nbytes / (1 << 30),
        collective_timeout_s=20.0,
    )
    model = _UnevenDiT()
    ref_model = clone(model)
    shard_non_block(model, cfg, par, device_type="cpu")
    backend = LayerwiseBackend(cfg, par, CpuPlatform())
    try:
        backend.enable(model)
    except ValueError as e:
        return {"error": str(e)}
    with torch.no_grad():
        same = torch.equal(ref_model(_x(0, 0)), model(_x(0, 0)))
    st = backend.stats()
    backend.disable()
    return {"same": same, "resident": st["num_resident_blocks"], "policy": st["policy"]}


@pytest.mark.parametrize("budget_nbytes", [72_000, 76_000])
def test_device_budget_with_unevenly_sharded_non_block_weights(budget_nbytes: int) -> None:
    """The ranks hold 64 KiB and 32 KiB of non-block weights; each used to size its resident
    blocks (or fail the budget) from its own bytes, so they disagreed. Now every rank decides
    from the largest: 72000 bytes is too small on every rank with one message, 76000 (room
    for two slots beside 64 KiB and the activation fifth) gives every rank the same resident
    count."""
    res = assert_all_ok(run_ranks(_budget, 2, budget_nbytes, timeout_s=120))
    assert res[0] == res[1]
    if budget_nbytes == 72_000:
        assert "device_budget_gb=" in res[0]["error"] and "cannot hold" in res[0]["error"]
    else:
        assert res[0]["same"] and res[0]["resident"] == 0
        assert [p["non_block_nbytes"] for p in res[0]["policy"]["per_rank"]] == [66624, 33856]
