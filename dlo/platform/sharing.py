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

What cannot run there: NCCL itself (and so ``nccl_max_ctas``); timing figures (the ranks
share one GPU's SMs, copy engines and PCIe link: a step's time is not a speed result); and
the copy-engine gather: torch's symmetric memory refuses allocations of several ranks on
one device ("detected allocations from overlapping devices", measured on an H100), so
``gather_engine="auto"`` takes the process group's collective (gloo) in such a job and
``"copy"`` is refused at enable, by name. Each rank's device budget is its share of the
GPU: free memory divided by the ranks on that GPU.

Without ``DLO_SHARE_GPU=1``, more local ranks than visible GPUs is an error on every rank
naming the variable, never a silent slow run. The flag assumes every local rank sees the
node's GPUs: with ``CUDA_VISIBLE_DEVICES`` set to one GPU per rank, every rank would count one
GPU shared by all and plan with a fraction of it; leave the GPUs visible instead (dlo picks
GPU ``LOCAL_RANK``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo.platform.env import env_str, share_gpu, torchrun_env


@dataclass(frozen=True)
class GpuShare:
    """This local rank's GPU and the local ranks on it."""

    index: int
    """The CUDA device index this rank computes on."""
    num_sharers: int
    """How many local ranks compute on that GPU (1: a GPU of its own)."""

    @property
    def shared(self) -> bool:
        return self.num_sharers > 1


def gpu_share(
    local_rank: int, local_world_size: int, device_count: int, *, share: bool
) -> GpuShare:
    """The GPU of ``local_rank`` among the ``device_count`` GPUs every local rank sees (pure).

    Args:
        local_rank, local_world_size: torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``.
        device_count: the CUDA devices this process sees (the same on every local rank).
        share: ``DLO_SHARE_GPU=1``.

    Returns:
        The GPU and the number of local ranks computing on it.

    Raises:
        ValueError: more local ranks than GPUs without ``share`` (on every rank, so none
            goes on to a rendezvous its peers never reach), or no GPU visible; naming the
            variables.
    """
    if device_count < 1:
        raise ValueError(f"LOCAL_RANK={local_rank} but no CUDA device is visible")
    if local_rank < device_count and local_world_size <= device_count:
        return GpuShare(local_rank, 1)
    if not share:
        raise ValueError(
            f"LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE={local_world_size} ranks on a node, but "
            f"only {device_count} CUDA device(s) visible: set DLO_SHARE_GPU=1 to run several "
            "ranks per GPU (a "
            "correctness lane whose collectives run on gloo), or, where each rank sees only "
            "its own GPU through CUDA_VISIBLE_DEVICES, let every rank see the node's GPUs "
            "(dlo picks GPU LOCAL_RANK)"
        )
    index = local_rank % device_count
    return GpuShare(index, len(range(index, max(local_world_size, local_rank + 1), device_count)))


def job_shares_gpus(device_count: int) -> bool:
    """Whether local ranks share GPUs in this job: ``DLO_SHARE_GPU=1`` and more local ranks
    than visible GPUs. Decided for the whole job, never per GPU, so every rank picks the same
    process-group backend (with 3 ranks on 2 GPUs, the rank alone on its GPU uses gloo too);
    every node is assumed to run as many ranks on as many GPUs as this one (torchrun's
    ``--nproc-per-node`` on identical nodes).

    Raises:
        ValueError: ``DLO_SHARE_GPU=1`` in a job of several ranks without
            ``LOCAL_WORLD_SIZE`` (nothing tells how many ranks share the node's GPUs).
    """
    if not share_gpu():
        return False
    env = torchrun_env()
    if env.is_distributed and env_str("LOCAL_WORLD_SIZE") is None:
        raise ValueError(
            f"DLO_SHARE_GPU=1 with WORLD_SIZE={env.world_size} needs LOCAL_WORLD_SIZE (torchrun "
            "sets it): the ranks of a node that share its GPUs"
        )
    return ranks_share_gpus(env.local_world_size, device_count)


def ranks_share_gpus(local_world_size: int, device_count: int) -> bool:
    """Whether ``local_world_size`` ranks of a node share its ``device_count`` GPUs:
    ``DLO_SHARE_GPU=1`` and more ranks than GPUs."""
    return share_gpu() and local_world_size > device_count


def this_rank_share(device_count: int, local_rank: int | None = None) -> GpuShare:
    """:func:`gpu_share` for this process (or ``local_rank``), from torchrun's environment."""
    env = torchrun_env()
    rank = env.local_rank if local_rank is None else local_rank
    return gpu_share(rank, env.local_world_size, device_count, share=share_gpu())
