"""The one place that knows about the accelerator and the process environment.

Everything that picks a device, creates a stream or an event, synchronizes, registers
(pins) host memory or reads ``os.environ`` goes through here, so the rest of dlo is written
once against :class:`Platform` and runs unchanged on CUDA and on a CPU-only torch.

Two implementations exist:

* :class:`CudaPlatform` -- real streams and timing events; host memory is page-locked with
  ``cudaHostRegister`` on exact-size regions (the caching host allocator behind
  ``Tensor.pin_memory()`` rounds every request up to a power of two, which would break dlo's
  exact pinned-bytes contract).
* :class:`CpuPlatform` -- the "device" is the CPU; streams and events are no-ops (every
  operation is already ordered on the host) and pinning is never requested, because a
  CPU-only torch raises on any pinning call.

The generic ``torch.accelerator`` API is used to detect the accelerator where torch has it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dlo.platform import memory_cap
from dlo.platform.env import host_available_bytes
from dlo.platform.sharing import job_shares_gpus, this_rank_share

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- CPU stand-ins
@dataclass(frozen=True)
class MemoryNow:
    """A device allocator's statistics at one moment (nothing reset)."""

    allocated: int
    peak: int
    """The most allocated since the process started or its peak was last reset."""
    limit: int
    """The most the allocator may hold: its cap (a device budget's, or the user's fraction)
    or the free device memory plus what it holds, whichever is smaller."""


class NullStream:
    """A stream on a device whose operations are already ordered on the host."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class NullEvent:
    """An event on such a device: always complete, zero elapsed time."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: Any) -> float:
        return 0.0


# ----------------------------------------------------------------------------- platforms
class Platform:
    """Device, streams, events, synchronization and host-memory pinning for one device."""

    device: torch.device
    can_pin: bool = False
    has_streams: bool = False
    num_gpu_sharers: int = 1
    """Local ranks computing on this device (see :mod:`dlo.platform.sharing`)."""

    # streams and events
    def new_stream(self) -> Any:
        raise NotImplementedError

    def current_stream(self) -> Any:
        raise NotImplementedError

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager making ``stream`` current for the enclosed enqueues."""
        raise NotImplementedError

    def new_event(self, *, timing: bool = False) -> Any:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def stream_capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (never on CPU)."""
        return False

    # stream memory operations (the copy-engine gather's kernel-free barrier)
    def stream_write_u32(self, stream: Any, address: int, value: int) -> None:
        """Enqueue on ``stream``: after every earlier operation of the stream, write
        ``value`` to the 32-bit device word at ``address`` (with a fence before it)."""
        raise NotImplementedError(f"{type(self).__name__} has no stream memory operations")

    def stream_wait_u32(self, stream: Any, address: int, value: int) -> None:
        """Enqueue on ``stream``: wait, without a kernel, until the 32-bit word at
        ``address`` is >= ``value`` (cyclic comparison, so counters may wrap)."""
        raise NotImplementedError(f"{type(self).__name__} has no stream memory operations")

    def device_context(self) -> contextlib.AbstractContextManager[Any]:
        """Make this platform's device current (for threads dlo starts: they begin on
        device 0)."""
        return contextlib.nullcontext()

    def peers_accessible(self) -> bool:
        """Whether this device can read every other visible device of its node directly
        (peer access, for the copy-engine gather)."""
        return False

    # host memory
    def register_host(self, tensor: torch.Tensor) -> bool:
        """Page-lock a CPU tensor's memory in place; False when the platform refused."""
        return False

    def unregister_host(self, tensor: torch.Tensor) -> None:
        return None

    # memory statistics
    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        return None

    def num_allocs(self) -> int:
        """Cumulative count of device allocator allocations (0 where not tracked)."""
        return 0

    def empty_cache(self) -> None:
        return None

    def free_memory(self) -> int | None:
        """Free device memory in bytes now (None where unknown)."""
        return None

    def held_memory(self) -> int | None:
        """Device bytes this process holds in tensors now (None where unknown)."""
        return None

    def memory_now(self) -> MemoryNow | None:
        """The allocator's bytes now, its peak and the most it may hold (None where unknown:
        the CPU)."""
        return None

    def cap_memory(self, nbytes: int) -> Callable[[], None] | None:
        """Cap this process's device allocations at ``nbytes`` (a device budget: a larger
        allocation fails as on a device of that size); returns the undo (idempotent), or None
        where the platform cannot cap (the CPU; :mod:`dlo.platform.memory_cap`)."""
        return None

    @property
    def dist_backend(self) -> str:
        """The process-group backend that serves this device."""
        raise NotImplementedError


class CpuPlatform(Platform):
    """CPU as the device: no streams, no events, no pinning."""

    has_streams = False
    can_pin = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def new_stream(self) -> NullStream:
        return NullStream()

    def current_stream(self) -> NullStream:
        return NullStream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    def new_event(self, *, timing: bool = False) -> NullEvent:
        return NullEvent()

    def synchronize(self) -> None:
        return None

    def free_memory(self) -> int | None:
        return host_available_bytes()

    @property
    def dist_backend(self) -> str:
        return "gloo"


class CudaPlatform(Platform):
    """One CUDA device with real streams, timing events and cudaHostRegister pinning."""

    has_streams = True
    can_pin = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"device={device} is not a CUDA device")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.num_gpu_sharers = _gpu_sharers(index)
        """Local ranks computing on this GPU ([Note: ranks sharing a GPU]): each plans with
        its share of the free memory."""

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self, *, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def stream_capturing(self) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    def stream_write_u32(self, stream: Any, address: int, value: int) -> None:
        _stream_mem_op("write", stream.cuda_stream, address, value)

    def stream_wait_u32(self, stream: Any, address: int, value: int) -> None:
        _stream_mem_op("wait", stream.cuda_stream, address, value)

    def device_context(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self.device)

    def peers_accessible(self) -> bool:
        me = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return all(
            torch.cuda.can_device_access_peer(me, d)
            for d in range(torch.cuda.device_count())
            if d != me
        )

    def register_host(self, tensor: torch.Tensor) -> bool:
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        if tensor.numel() == 0:
            return True
        with torch.cuda.device(self.device):  # pinning threads start on device 0
            err = torch.cuda.cudart().cudaHostRegister(
                tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0
            )
        code = _cuda_error_code(err)
        if code != 0:
            logger.warning("cudaHostRegister of %d bytes failed (error %d)", tensor.nbytes, code)
            _clear_cuda_error()
            return False
        return True

    def unregister_host(self, tensor: torch.Tensor) -> None:
        if tensor.numel() == 0:
            return
        with torch.cuda.device(self.device):  # as register_host: no context on device 0
            err = torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        code = _cuda_error_code(err)
        if code != 0:
            logger.warning("cudaHostUnregister failed (error %d)", code)
            _clear_cuda_error()

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def num_allocs(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("allocation.all.allocated", 0))

    def empty_cache(self) -> None:
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()

    def free_memory(self) -> int | None:
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free) // self.num_gpu_sharers

    def held_memory(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.device))

    def cap_memory(self, nbytes: int) -> Callable[[], None] | None:
        return memory_cap.cap(self.device, nbytes)

    def memory_now(self) -> MemoryNow | None:
        stats = torch.cuda.memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        return MemoryNow(
            allocated=int(stats.get("allocated_bytes.all.current", 0)),
            peak=int(stats.get("allocated_bytes.all.peak", 0)),
            limit=min(
                int(memory_cap.fraction(self.device) * total),
                reserved + int(free) // self.num_gpu_sharers,
            ),
        )

    @property
    def dist_backend(self) -> str:
        """NCCL, or gloo where the job's ranks share GPUs (see :mod:`dlo.platform.sharing`)."""
        return "gloo" if job_shares_gpus(torch.cuda.device_count()) else "nccl"


def _cuda_error_code(err: Any) -> int:
    if isinstance(err, int):
        return err
    value = getattr(err, "value", None)
    if isinstance(value, int):
        return value
    return int(err)


_STREAM_MEM_OPS: dict[str, Any] = {}


def _stream_mem_op(kind: str, stream: int, address: int, value: int) -> None:
    """``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` (flags 0: fenced write; wait
    until ``(int32)(*address - value) >= 0``) from the driver, loaded once by ctypes."""
    if not _STREAM_MEM_OPS:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, base in (("write", "cuStreamWriteValue32"), ("wait", "cuStreamWaitValue32")):
            fn = getattr(lib, f"{base}_v2", None) or getattr(lib, base)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _STREAM_MEM_OPS[name] = fn
        _STREAM_MEM_OPS["error_name"] = lib.cuGetErrorName
    code = _STREAM_MEM_OPS[kind](stream, address, value & 0xFFFFFFFF, 0)
    if code != 0:
        text = ctypes.c_char_p()
        _STREAM_MEM_OPS["error_name"](code, ctypes.byref(text))
        raise RuntimeError(
            f"cuStream{'Write' if kind == 'write' else 'Wait'}Value32 failed: "
            f"{(text.value or b'?').decode()} ({code})"
        )


def _clear_cuda_error() -> None:
    # cudaHostRegister failures are sticky in cudaGetLastError; clear them so that an
    # unrelated later kernel launch check does not report them.
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaGetLastError()


# ----------------------------------------------------------------------------- selection
def accelerator_available() -> bool:
    """True when torch sees a usable accelerator of a kind dlo supports (CUDA today)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        if not acc.is_available():
            return False
        current = acc.current_accelerator()
        return current is not None and current.type == "cuda"
    return torch.cuda.is_available()


def default_device(local_rank: int | None = None) -> torch.device:
    """The device a process should compute on: its local GPU, else the CPU."""
    if accelerator_available():
        return torch.device("cuda", this_rank_share(torch.cuda.device_count(), local_rank).index)
    return torch.device("cpu")


def _gpu_sharers(index: int) -> int:
    """Local ranks on GPU ``index``: this job's count where this rank computes there, else 1
    (a device addressed explicitly, outside torchrun's mapping)."""
    try:
        share = this_rank_share(torch.cuda.device_count())
    except ValueError:
        return 1
    return share.num_sharers if share.index == index else 1


def warm_up(device: torch.device | str | None = None) -> Callable[[], None]:
    """Start creating ``device``'s CUDA context and its cuBLAS handles on a thread, while
    the caller does host work (building a pipeline on ``meta`` holds the GIL, context
    creation mostly does not); returns the join. Nothing for a CPU device. A failure is
    left for the caller's first real use of the device to report."""
    dev = torch.device(device) if device is not None else default_device()
    if dev.type != "cuda" or not torch.cuda.is_available():
        return lambda: None

    def warm() -> None:
        with contextlib.suppress(Exception):
            a = torch.zeros(64, 64, device=dev, dtype=torch.bfloat16)
            (a @ a).float().sum().item()  # cuBLAS(Lt) handle and workspace, a reduction

    thread = threading.Thread(target=warm, name="dlo-warm-up", daemon=True)
    thread.start()
    return thread.join


def get_platform(device: torch.device | str | None = None) -> Platform:
    """Return the platform that serves ``device`` (default: :func:`default_device`)."""
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cpu":
        return CpuPlatform()
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={dev} requested but this torch has no usable CUDA")
        return CudaPlatform(dev)
    raise ValueError(f"device={dev}: dlo supports 'cuda' and 'cpu' devices")
