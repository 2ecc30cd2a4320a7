"""Several ranks of a node on one GPU: which GPU a local rank computes on, how many ranks
share it, and which process-group backend such a job uses.

[Note: ranks sharing a GPU]
NCCL refuses two ranks of one communicator on the same device ("Duplicate GPU detected"),
so a node with fewer GPUs than local ranks cannot run dlo's multi-rank paths with NCCL.
``DLO_SHARE_GPU=1`` asks for it anyway, as a correctness lane: local rank ``r`` computes on
GPU ``r % device_count`` and the default process group is gloo, whose collectives take CUDA
tensors (each staged through pinned host memory, on gloo's own streams, ordered with the
caller's current stream by events). Everything dlo runs on the device (slots, streams,
events, the codec's decode, compile, ``cudaHostRegister`` of a node-shared copy) is the
same code as with one GPU per rank; only the bytes between ranks travel through the host.

What cannot run there: NCCL itself (and so ``nccl_max_ctas``), and timing figures (the
ranks share one GPU's SMs, copy engines and PCIe link: a step's time is not a speed
result), and the copy-engine gather: torch's symmetric memory refuses allocations of
several ranks on one device ("detected allocations from overlapping devices", measured on an
H100), so ``gather_engine="auto"`` takes the process group's collective (gloo) in such a
job and ``"copy"`` is refused at enable, by name. Each rank's device budget is its share of the GPU: free memory
divided by the ranks on that GPU.

Without ``DLO_SHARE_GPU=1``, a local rank beyond the visible GPUs is an error naming the
variable, never a silent slow run.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo.platform.env import share_gpu, torchrun_env


@dataclass(frozen=True)
class GpuShare:
    """This local rank's GPU and the local ranks on it."""

    index: int
    """The CUDA device index this rank computes on."""
    sharers: int
    """How many local ranks compute on that GPU (1: a GPU of its own)."""

    @property
    def shared(self) -> bool:
        return self.sharers > 1


def gpu_share(
    local_rank: int, local_world_size: int, device_count: int, *, share: bool
) -> GpuShare:
    """The GPU of ``local_rank`` among ``device_count`` visible GPUs (pure).

    Raises:
        ValueError: ``local_rank`` is beyond the visible GPUs and ``share`` is off, or no
            GPU is visible (naming the variables).
    """
    if device_count < 1:
        raise ValueError(f"LOCAL_RANK={local_rank} but no CUDA device is visible")
    if local_rank < device_count and (not share or local_world_size <= device_count):
        return GpuShare(local_rank, 1)
    if not share:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but only {device_count} CUDA devices are visible "
            "(set DLO_SHARE_GPU=1 to run several ranks per GPU: a correctness lane whose "
            "collectives run on gloo)"
        )
    index = local_rank % device_count
    sharers = len(range(index, local_world_size, device_count))
    return GpuShare(index, sharers)


def job_shares_gpus(device_count: int) -> bool:
    """Whether local ranks share GPUs in this job: ``DLO_SHARE_GPU=1`` and more local ranks
    than visible GPUs. Decided for the whole job, never per GPU, so every rank picks the same
    process-group backend (with 3 ranks on 2 GPUs, the rank alone on its GPU uses gloo too)."""
    return share_gpu() and torchrun_env().local_world_size > device_count


def this_rank_share(device_count: int, local_rank: int | None = None) -> GpuShare:
    """:func:`gpu_share` for this process, from torchrun's environment."""
    env = torchrun_env()
    rank = env.local_rank if local_rank is None else local_rank
    return gpu_share(rank, env.local_world_size, device_count, share=share_gpu())
