"""The process environment: torchrun's variables, the host name, the shared-memory folder,
page size and resident set size. The only dlo module that reads ``os.environ``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import tempfile
import time
from dataclasses import dataclass

import torch

_IMPORTED = time.time()


# ----------------------------------------------------------------------------- environment
@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun (or SLURM through torchrun) told this process about its place."""

    rank: int
    """Global rank (``RANK``), 0 when unset."""
    world_size: int
    """Number of processes (``WORLD_SIZE``), 1 when unset."""
    local_rank: int
    """Rank on this node (``LOCAL_RANK``), 0 when unset; picks the GPU."""
    local_world_size: int
    """Processes on this node (``LOCAL_WORLD_SIZE``), 1 when unset."""
    master_addr: str | None
    """Rendezvous address (``MASTER_ADDR``), or None."""
    master_port: int | None
    """Rendezvous port (``MASTER_PORT``), or None."""
    agent_store: bool = False
    """torchrun's agent hosts the job's store (``TORCHELASTIC_USE_AGENT_STORE=True``), not
    rank 0."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def torchrun_env() -> TorchrunEnv:
    """Read torchrun's environment variables (all optional)."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE={world} must be >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"environment variable RANK={rank} must be in [0, WORLD_SIZE={world})")
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ValueError(
            f"environment variables LOCAL_RANK={local_rank} and LOCAL_WORLD_SIZE={local_world} "
            "must satisfy 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"
        )
    port = _env_int("MASTER_PORT", -1)
    return TorchrunEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=os.environ.get("MASTER_ADDR"),
        master_port=port if port >= 0 else None,
        agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )


def cpu_share() -> int:
    """CPUs this process may use, divided among the ranks of its node (at least 1).

    torchrun sets ``OMP_NUM_THREADS=1``, so host-side work that parallelizes by Python
    threads (deterministic weight init) sizes its pool from this instead.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // torchrun_env().local_world_size)


def share_gpu() -> bool:
    """Whether the job asked for several local ranks per GPU (``DLO_SHARE_GPU=1``): the
    one-GPU multi-rank lane (see [Note: ranks sharing a GPU] in :mod:`dlo.platform.sharing`)."""
    raw = (os.environ.get("DLO_SHARE_GPU") or "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ValueError(
        f"environment variable DLO_SHARE_GPU={raw!r} must be 0 or 1 (or true/false, yes/no)"
    )


def host_name() -> str:
    """This machine's name (ranks with the same name share a node)."""
    return socket.gethostname()


def shared_memory_dir() -> str:
    """Where a node's processes share memory through files: ``DLO_SHM_DIR``, else
    ``/dev/shm`` (a tmpfs on Linux), else the temporary directory."""
    given = env_str("DLO_SHM_DIR")
    if given:
        return given
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shared_memory_free_nbytes() -> int | None:
    """Bytes free in :func:`shared_memory_dir` for an unprivileged writer; None when unknown
    or when that folder is only the temporary directory's fallback (maybe on disk)."""
    if not env_str("DLO_SHM_DIR") and not os.path.isdir("/dev/shm"):
        return None
    try:
        st = os.statvfs(shared_memory_dir())
    except OSError:
        return None
    return int(st.f_bavail * st.f_frsize)


def env_str(name: str, default: str | None = None) -> str | None:
    """Read one environment variable (the only ``os.environ`` access outside this module)."""
    return os.environ.get(name, default)


def set_env_default(name: str, value: str) -> None:
    """Set an environment variable unless the user already did (used before NCCL init)."""
    os.environ.setdefault(name, value)


# ----------------------------------------------------------------------------- host memory
def page_size() -> int:
    """Size of a host memory page (the alignment of pinned regions)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 4096


def process_rss_bytes() -> int:
    """Resident set size of this process, from /proc (0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page_size()
    except (OSError, ValueError, IndexError):
        return 0


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where unavailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_PAGEMAP_SWAPPED = 1 << 62
_PAGEMAP_FILE_OR_SHARED = 1 << 61


def copied_on_write(address: int, nbytes: int) -> bool | None:
    """Whether any page of ``[address, address + nbytes)`` in a private file mapping has
    been written (copied on write: present and anonymous, ``/proc/self/pagemap``), or None
    where that cannot be read (not Linux). Writes through ``tensor.data`` leave a tensor's
    version counter as it was; the page table still tells."""
    if nbytes <= 0:
        return False
    size = page_size()
    first, last = address // size, (address + nbytes - 1) // size
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            raw = f.read((last - first + 1) * 8)
    except OSError:
        return None
    if len(raw) != (last - first + 1) * 8:
        return None
    entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)  # one scan, not per page
    # a swapped-out page of a private file mapping can only be a copy (the file's own
    # pages are dropped, never swapped)
    present = entries < 0  # bit 63, the sign bit of an int64
    swapped = (entries & _PAGEMAP_SWAPPED) != 0
    anonymous = (entries & _PAGEMAP_FILE_OR_SHARED) == 0
    return bool((swapped | (present & anonymous)).any())


def process_start_time() -> float:
    """When this process started, in ``time.time()`` seconds (Linux ``/proc``; elsewhere
    the import of this module)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        return time.time() - uptime + int(fields[19]) / ticks
    except (OSError, ValueError, IndexError):
        return _IMPORTED


def process_peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM), 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def trim_host_heap() -> None:
    """Ask glibc to give freed heap pages back to the OS (best effort, Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
