"""Functional all-gathers of CUDA tensors over gloo, routed around torch's crash.

Note [functional all-gathers over gloo]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's functional collectives (``torch.distributed._functional_collectives``) reach
gloo's ``allgather_into_tensor_coalesced``, which copies CUDA tensors as if they were host
memory: SIGSEGV on every rank (pytorch/pytorch#152645, open). diffusers' context
parallelism calls them twice per forward at least: the sequence's unshard after the last
block and ring attention's key/value gather. In the one-GPU lane ([Note: ranks sharing a
GPU] in :mod:`dlo.platform.sharing`) every collective runs on gloo with CUDA tensors, and
resident context parallelism died there on an H100 (2026-12-07) exactly as it did under dlo.
gloo's ``_allgather_base`` (``all_gather_into_tensor``) stages CUDA tensors through host
memory correctly: dlo's own AllGather runs on it in the lane, bitwise.

:func:`route_gathers` registers, once per process, a kernel for the functional all-gathers
(``all_gather_into_tensor``, its ``_out`` and ``_coalesced`` forms) on the CUDA dispatch key
that calls that collective. torch registers its own for every device at once
(CompositeExplicitAutograd), so a kernel on one device's key takes precedence for that
device only; the meta kernels (compile's tracing) are untouched. The kernel is synchronous:
the collective has finished on the current stream when it returns, and the functional
``wait_tensor`` then finds no work to wait for. It gives the same result on any backend, so
a later NCCL group in the same process would still be correct, only not overlapped: it is
registered only where the job's collectives run on gloo with CUDA tensors
(:func:`needs_routing`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from dlo.runtime.collectives import all_gather_into

_OPS = ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced")
_libraries: dict[str, Any] = {}  # dispatch key -> its torch.library.Library (kept alive)
_lock = threading.Lock()


def needs_routing(device: torch.device, backend: str | None) -> bool:
    """Whether functional all-gathers on ``device`` over a default group of ``backend``
    would reach gloo's crash: CUDA tensors over gloo."""
    return device.type == "cuda" and backend == "gloo"


def route_gathers(dispatch_key: str = "CUDA") -> bool:
    """Register the kernels of the note on ``dispatch_key`` (once per process and key;
    True where this call registered them)."""
    with _lock:
        if dispatch_key in _libraries:
            return False
        lib = torch.library.Library("_c10d_functional", "IMPL")
        try:
            lib.impl(_OPS[0], _gather, dispatch_key)
            lib.impl(_OPS[1], _gather_out, dispatch_key)
            lib.impl(_OPS[2], _gather_coalesced, dispatch_key)
        except BaseException:
            lib._destroy()  # nothing half-registered stays behind
            raise
        _libraries[dispatch_key] = lib
        return True


def unroute_gathers(dispatch_key: str = "CUDA") -> None:
    """Take :func:`route_gathers`' kernels on ``dispatch_key`` off again (torch's own
    serve that device once more)."""
    with _lock:
        lib = _libraries.pop(dispatch_key, None)
    if lib is not None:
        lib._destroy()


def _group(name: Any) -> Any:
    if isinstance(name, dist.ProcessGroup):
        return name
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _gather(input: torch.Tensor, group_size: int, group_name: Any) -> torch.Tensor:
    src = input.contiguous()
    out = src.new_empty((src.shape[0] * group_size, *src.shape[1:]))
    all_gather_into(out, src, _group(group_name))
    return out


def _gather_out(
    input: torch.Tensor, group_size: int, group_name: Any, *, out: torch.Tensor
) -> torch.Tensor:
    all_gather_into(out, input.contiguous(), _group(group_name))
    return out


def _gather_coalesced(
    inputs: list[torch.Tensor], group_size: int, group_name: Any
) -> list[torch.Tensor]:
    return [_gather(t, group_size, group_name) for t in inputs]
