"""Ranks sharing a GPU (the one-GPU multi-rank lane): which GPU a local rank takes, how many
share it, and the clear errors (see [Note: ranks sharing a GPU] in dlo/platform/sharing.py)."""

from __future__ import annotations

import pytest

from dlo.platform.env import share_gpu
from dlo.platform.sharing import GpuShare, gpu_share


def test_a_gpu_per_rank_shares_nothing() -> None:
    assert gpu_share(1, 2, 2, share=False) == GpuShare(1, 1)
    assert gpu_share(1, 2, 8, share=True) == GpuShare(1, 1)  # enough GPUs: the flag is moot
    assert not gpu_share(0, 1, 1, share=True).shared


@pytest.mark.parametrize(
    ("local_rank", "world", "count", "want"),
    [
        (0, 2, 1, GpuShare(0, 2)),
        (1, 2, 1, GpuShare(0, 2)),
        (2, 3, 1, GpuShare(0, 3)),
        (3, 4, 2, GpuShare(1, 2)),
        (2, 3, 2, GpuShare(0, 2)),
        (1, 3, 2, GpuShare(1, 1)),
    ],
)
def test_shared_ranks_go_round_robin(
    local_rank: int, world: int, count: int, want: GpuShare
) -> None:
    assert gpu_share(local_rank, world, count, share=True) == want


def test_more_ranks_than_gpus_without_the_flag_is_named_on_every_rank() -> None:
    for rank in (0, 1):  # rank 0 too: none goes on to a rendezvous the others never reach
        with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=2 .* only 1 CUDA.*DLO_SHARE_GPU=1"):
            gpu_share(rank, 2, 1, share=False)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 of LOCAL_WORLD_SIZE=1 .* only 1 CUDA"):
        gpu_share(1, 1, 1, share=False)  # a rank beyond the GPUs, whatever the world says
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        gpu_share(0, 2, 0, share=True)


def test_the_flag_is_read_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in [("", False), ("0", False), ("1", True), ("true", True), ("No", False)]:
        monkeypatch.setenv("DLO_SHARE_GPU", raw)
        assert share_gpu() is want
    monkeypatch.setenv("DLO_SHARE_GPU", "2")
    with pytest.raises(ValueError, match="DLO_SHARE_GPU='2'"):
        share_gpu()


def test_a_shared_job_plans_with_its_share_and_runs_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA platform of a rank in the lane (no GPU needed: nothing here touches one):
    its device budget is its share of the GPU, and the whole job uses gloo."""
    import torch

    from dlo.platform.device import CudaPlatform

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("DLO_SHARE_GPU", "1")
    mine = CudaPlatform(torch.device("cuda", 0))  # ranks 0 and 2 on GPU 0
    assert mine.num_gpu_sharers == 2 and mine.dist_backend == "gloo"
    assert CudaPlatform(torch.device("cuda", 1)).num_gpu_sharers == 1  # not this rank's GPU
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # alone on GPU 1, gloo all the same: one backend
    alone = CudaPlatform(torch.device("cuda", 1))
    assert alone.num_gpu_sharers == 1 and alone.dist_backend == "gloo"
    monkeypatch.setenv("DLO_SHARE_GPU", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert CudaPlatform(torch.device("cuda", 1)).dist_backend == "nccl"


def test_the_flag_in_a_job_without_local_world_size_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dlo.platform.sharing import job_shares_gpus

    monkeypatch.setenv("DLO_SHARE_GPU", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(
        ValueError, match="DLO_SHARE_GPU=1 with WORLD_SIZE=2 needs LOCAL_WORLD_SIZE"
    ):
        job_shares_gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert job_shares_gpus(1) and not job_shares_gpus(2)
    monkeypatch.setenv("DLO_SHARE_GPU", "0")
    assert not job_shares_gpus(1)
