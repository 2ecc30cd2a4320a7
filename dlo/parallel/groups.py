"""Process groups: the rank layout of a :class:`~dlo.config.parallel.ParallelConfig`, and the
communicators dlo's weight collectives run on.

[Note: rank layout]
Ranks are laid out with tensor parallelism fastest, then sequence, then data parallelism:
``rank = (dp_index * sp + sp_index) * tp + tp_index``. HSDP lays a 2-D mesh
``("replicate", "shard")`` over the same ranks: ``rank = replicate_index * shard + shard_index``,
so a shard group is ``shard`` consecutive ranks (one node, typically) and the replicate axis
spans nodes. With TP > 1 those consecutive ranks would be the tensor groups, so
:class:`~dlo.config.parallel.ParallelConfig` refuses HSDP with TP. The DP group of a rank holds the ranks with its sp and tp indices; the SP group
the ranks with its dp and tp indices. TP groups are never a weight-collective axis.

dlo's weight collectives run on their own communicator (a new group over the same ranks as
the chosen axis), so a user's collective inside a block never interleaves with a prefetch
gather. Groups are created collectively (every rank creates every group of an axis, in the
same order) and cached for the process lifetime, so re-enabling creates nothing new.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dlo.config.parallel import ParallelConfig
from dlo.parallel.store import forget_reads, store_unreachable

logger = logging.getLogger(__name__)


def axis_groups(par: ParallelConfig, axis: str) -> list[list[int]]:
    """Every group of ``axis`` as lists of global ranks (pure; see [Note: rank layout])."""
    dp, sp, tp = par.data_parallel_size, par.sequence_parallel_size, par.tensor_parallel_size
    world = par.world_size
    if axis == "local":
        return [[r] for r in range(world)]
    if axis == "shard":
        shard = par.hsdp_shard_size
        return [list(range(i * shard, (i + 1) * shard)) for i in range(world // shard)]
    if axis == "replicate":
        shard = par.hsdp_shard_size
        return [list(range(j, world, shard)) for j in range(shard)]
    if axis == "data":
        return [[(d * sp + s) * tp + t for d in range(dp)] for s in range(sp) for t in range(tp)]
    if axis == "sequence":
        return [[(d * sp + s) * tp + t for s in range(sp)] for d in range(dp) for t in range(tp)]
    if axis == "tensor":
        return [[(d * sp + s) * tp + t for t in range(tp)] for d in range(dp) for s in range(sp)]
    raise ValueError(f"unknown axis {axis!r}")


def group_of(par: ParallelConfig, axis: str, rank: int) -> list[int]:
    """The ranks of ``rank``'s group along ``axis`` (pure)."""
    for ranks in axis_groups(par, axis):
        if rank in ranks:
            return ranks
    raise ValueError(f"rank {rank} is not in any {axis!r} group of {par}")


@dataclass(frozen=True)
class World:
    """This process's place in the default process group (rank 0 of 1 without one)."""

    rank: int
    size: int
    backend: str | None

    @property
    def distributed(self) -> bool:
        return self.size > 1


def current_world() -> World:
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))
    return World(0, 1, None)


_GROUPS: dict[tuple[Any, ...], Any] = {}


def nccl_options(max_ctas: int | None) -> Any:
    """ProcessGroupNCCL options capping the CTAs of a communicator (None: defaults)."""
    if max_ctas is None:
        return None
    pg = getattr(dist, "ProcessGroupNCCL", None)
    if pg is None:
        raise ValueError(f"nccl_max_ctas={max_ctas} needs a torch built with NCCL")
    opts = pg.Options()
    opts.config.max_ctas = max_ctas
    return opts


def weight_group(
    par: ParallelConfig,
    axis: str,
    *,
    rank: int,
    timeout_s: float,
    backend: str | None = None,
    max_ctas: int | None = None,
) -> tuple[Any, list[int]]:
    """The communicator of ``rank``'s ``axis`` group for dlo's weight collectives.

    Every rank must call this with the same arguments (it creates every group of the axis).
    Returns ``(group, ranks)``; ``group`` is None for a group of one.
    """
    all_groups = axis_groups(par, axis)
    mine = group_of(par, axis, rank)
    if len(mine) == 1:
        return None, mine
    nccl = "nccl" in str(dist.get_backend())
    options = nccl_options(max_ctas) if nccl else None
    key = (
        tuple(tuple(g) for g in all_groups),
        backend,
        float(timeout_s),
        max_ctas if nccl else None,
    )
    cached = _GROUPS.get(key)
    if cached is None:
        cached = {}
        for ranks in all_groups:
            try:
                g = dist.new_group(
                    ranks=ranks,
                    timeout=datetime.timedelta(seconds=timeout_s),
                    backend=backend,
                    pg_options=options,
                )
            except dist.DistNetworkError as e:  # new_group goes through the store
                raise store_unreachable(f"creating the {axis} weight group", e, rank=rank) from e
            cached[tuple(ranks)] = g
        _GROUPS[key] = cached
        logger.debug("created %d dlo %s groups", len(all_groups), axis)
    return cached[tuple(mine)], mine


def init(
    par: ParallelConfig | None = None,
    *,
    device: Any = None,
    timeout_s: float = 600.0,
) -> World:
    """Initialize the default process group from torchrun's environment.

    NCCL with one GPU per local rank when CUDA is available (gloo where ``DLO_SHARE_GPU=1``
    puts several local ranks on one GPU), gloo on CPU; nothing (a world of one) when
    ``WORLD_SIZE`` is 1 or unset. ``par`` (default: data parallel over the world)
    is checked against the world size. ``device`` (default: this rank's GPU, else the CPU)
    decides the backend: NCCL for CUDA (gloo where the job's ranks share GPUs), gloo for
    the CPU.

    [Note: the group dlo creates]
    A process group dlo initialized is dlo's to tear down: an ``atexit`` handler destroys
    it while the interpreter is still whole, unless :func:`shutdown` or the user already
    did. Left to interpreter finalization, gloo's worker threads can still hold tensors
    whose release needs the GIL, and the process aborts ("terminate called without an
    active exception", exit -6) after a run that succeeded; NCCL warns that the group was
    never destroyed. The handler takes no barrier (on a failure path a barrier would wait
    out the collective timeout for a peer that will not come) and waits at most 30 s for
    the destroy, so a stuck peer cannot hold this rank's exit. A group the user initialized
    is the user's.

    Raises:
        ValueError: ``par``'s sizes do not multiply to ``WORLD_SIZE`` (naming the fields).
    """
    from dlo.platform.device import default_device
    from dlo.platform.env import set_env_default, torchrun_env

    env = torchrun_env()
    par = par or ParallelConfig.for_world(env.world_size)
    par.check_world_size(env.world_size)
    if env.world_size == 1 or dist.is_initialized():
        return current_world()
    import torch

    device = torch.device(device) if device is not None else default_device(env.local_rank)
    kwargs: dict[str, Any] = {}
    backend = "gloo"
    if device.type == "cuda":
        set_env_default("NCCL_NVLS_ENABLE", "0")
        set_env_default("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # the copy engine needs none
        set_env_default("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        torch.cuda.set_device(device)
        if gpu_backend(device) == "nccl":
            backend, kwargs["device_id"] = "nccl", device
    dist.init_process_group(
        backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    atexit.register(_destroy_at_exit)
    return current_world()


def gpu_backend(device: Any) -> str:
    """The process-group backend of a job computing on CUDA ``device``.

    Returns:
        ``"nccl"``, or ``"gloo"`` where the job's local ranks share GPUs ([Note: ranks
        sharing a GPU] in :mod:`dlo.platform.sharing`; decided for the whole job, so every
        rank agrees).
    """
    from dlo.platform.device import CudaPlatform

    platform = CudaPlatform(device)
    if platform.dist_backend == "gloo":
        logger.warning(
            "dlo: local ranks share GPUs (DLO_SHARE_GPU=1; %d on %s): collectives run on gloo "
            "through host memory; a correctness lane, its timings are not speed figures",
            platform.num_gpu_sharers,
            platform.device,
        )
    return platform.dist_backend


def _destroy_at_exit(bound_s: float = 30.0) -> None:
    """Destroy the process group :func:`init` created, at interpreter exit, waiting at most
    ``bound_s`` (see [Note: the group dlo creates])."""
    if not (dist.is_available() and dist.is_initialized()):
        return  # shutdown() or the user destroyed it
    failed: list[BaseException] = []

    def destroy() -> None:
        try:
            _GROUPS.clear()
            dist.destroy_process_group()
        except BaseException as e:  # exiting anyway: report it, never mask the exit status
            failed.append(e)

    worker = threading.Thread(target=destroy, name="dlo-destroy-group", daemon=True)
    worker.start()
    worker.join(bound_s)
    if worker.is_alive():
        logger.warning("dlo: destroying the process group at exit took over %.0f s", bound_s)
    elif failed:
        logger.warning("dlo: destroying the process group at exit failed: %r", failed[0])


def hsdp_mesh(par: ParallelConfig, device_type: str | None = None) -> Any:
    """The 2-D ``("replicate", "shard")`` DeviceMesh of ``par`` (collective: every rank
    calls it). ``device_type`` defaults to ``"cuda"`` when CUDA is usable, else ``"cpu"``."""
    from torch.distributed.device_mesh import init_device_mesh

    from dlo.platform.device import accelerator_available

    if not par.use_hsdp:
        raise ValueError("hsdp_mesh needs hsdp_shard_size or hsdp_replicate_size > 1")
    dev = device_type or ("cuda" if accelerator_available() else "cpu")
    return init_device_mesh(
        dev, (par.hsdp_replicate_size, par.hsdp_shard_size), mesh_dim_names=("replicate", "shard")
    )


@dataclass
class ParallelState:
    """The process groups of a job: one per axis in use, and the HSDP mesh."""

    world: World
    config: ParallelConfig
    groups: dict[str, Any]
    """Axis (``"data"``, ``"sequence"``, ``"tensor"``, ``"shard"``, ``"replicate"``) -> this
    rank's group of it; axes of size 1 are absent."""
    mesh: Any = None
    """The 2-D ``("replicate", "shard")`` DeviceMesh when HSDP is on, else None."""

    def ranks(self, axis: str) -> list[int]:
        return group_of(self.config, axis, self.world.rank)


def build_groups(
    par: ParallelConfig, *, timeout_s: float = 600.0, device_type: str | None = None
) -> ParallelState:
    """Create every group of every axis in use, and the HSDP mesh (collective: every rank
    calls it, in the same order). Without a process group it returns an empty state.

    Raises:
        ValueError: ``par`` does not match the live world size (naming the fields).
    """
    world = current_world()
    par.check_world_size(world.size)
    state = ParallelState(world, par, {})
    if not world.distributed:
        return state
    sizes = {
        "data": par.data_parallel_size,
        "sequence": par.sequence_parallel_size,
        "tensor": par.tensor_parallel_size,
        "shard": par.hsdp_shard_size if par.use_hsdp else 1,
        "replicate": par.hsdp_replicate_size if par.use_hsdp else 1,
    }
    for axis, size in sizes.items():
        if size > 1:
            state.groups[axis], _ = weight_group(par, axis, rank=world.rank, timeout_s=timeout_s)
    if par.use_hsdp:
        state.mesh = hsdp_mesh(par, device_type)
    return state


def shutdown() -> None:
    """Tear the default process group down after a successful run (barrier first, so no
    rank leaves while a peer still talks to it). Never call this on a failure path: with a
    stuck peer it can block for the whole collective timeout."""
    if dist.is_available() and dist.is_initialized():
        _GROUPS.clear()  # drop dlo's communicators before the default group goes
        dist.barrier()  # every rank has read every exchange: nothing to wait for at exit
        forget_reads()
        dist.destroy_process_group()


def expected_sharers(parallel: ParallelConfig, world: World, axis: str, size: int) -> int:
    """L before the agreement names the hosts: the ranks of this rank's share group (the
    weight axis ``axis`` of ``size`` ranks) on its node, as torchrun places them
    (``LOCAL_WORLD_SIZE`` consecutive ranks per node)."""
    if not world.distributed or size == 1:
        return 1
    from dlo.platform.env import torchrun_env

    per_node = max(1, torchrun_env().local_world_size)
    node = world.rank // per_node
    group = group_of(parallel, axis, world.rank)
    return max(1, sum(r // per_node == node for r in group))
