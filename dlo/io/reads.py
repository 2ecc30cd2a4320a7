"""Reading copied checkpoint tensors into their own memory on their device.

[Note: staged device reads]
A tensor :func:`~dlo.io.materialize.materialize` copies (a non-block weight, a text encoder,
a VAE) is read with ``pread`` (nothing of the file is mapped into the process), several at a
time. For a CUDA device each reading thread reads through its own page-locked staging buffer
of :data:`STAGE_NBYTES`, copied to the device piece by piece: no pageable host copy of the
tensor is made (its fresh pages would be faulted and zeroed first, and a pageable copy to
the device goes through the driver's own staging at a fraction of the link's rate). A cast
or a strided destination is done on the device from the stored bytes. Elsewhere (CPU, or a
staging buffer the platform will not pin) the tensor is read into host memory and copied.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch

from dlo.io.checkpoint import Checkpoint, bytes_of
from dlo.platform.device import Platform, get_platform
from dlo.platform.env import cpu_share
from dlo.platform.progress import progress_bar

COPY_READERS = max(2, min(8, cpu_share()))
"""Copied tensors read (and moved to the device) at a time: a few hundred MB each at most
in flight, so the peak RSS grows by little."""

STAGE_NBYTES = 32 << 20
"""Each reading thread's page-locked staging buffer for a device read."""

ReadJob = tuple[str, torch.Tensor, torch.device | str]
"""``(checkpoint name, the skeleton's tensor, device)``: read that entry into new memory
shaped, strided and typed like the skeleton's tensor on that device."""


class _Stages:
    """One page-locked staging buffer per reading thread, unregistered by :meth:`close`."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self._local = threading.local()
        self._lock = threading.Lock()
        self._registered: list[torch.Tensor] = []

    def get(self) -> torch.Tensor | None:
        """This thread's buffer; None when the platform will not pin it."""
        if not hasattr(self._local, "stage"):
            buf: torch.Tensor | None = torch.empty(STAGE_NBYTES, dtype=torch.uint8)
            assert buf is not None
            if self.platform.register_host(buf):
                with self._lock:
                    self._registered.append(buf)
            else:
                buf = None
            self._local.stage = buf
        stage: torch.Tensor | None = self._local.stage
        return stage

    def close(self) -> None:
        with self._lock:
            for buf in self._registered:
                self.platform.unregister_host(buf)
            self._registered.clear()


def read_through(ckpt: Checkpoint, name: str, dst: torch.Tensor, stage: torch.Tensor) -> None:
    """Read entry ``name``'s bytes into the uint8 tensor ``dst`` (any device, as long as the
    entry) through the host buffer ``stage``, one piece of its size at a time."""
    n = ckpt.entries[name].nbytes
    assert dst.numel() == n and dst.dtype == torch.uint8
    piece, out = stage.numel(), bytes_of(stage)
    for off in range(0, n, piece):
        m = min(piece, n - off)
        ckpt.read_into(name, off, out[:m])
        dst[off : off + m].copy_(stage[:m])  # synchronous: the buffer is read again next


def read_copy(ckpt: Checkpoint, job: ReadJob, stage: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor of ``job``, read with ``pread`` (through ``stage``, page-locked, for a
    device; see [Note: staged device reads])."""
    name, like, device = job
    e = ckpt.entries[name]
    on_cpu = torch.device(device).type == "cpu"
    raw = torch.empty(e.shape, dtype=e.dtype, device="cpu" if stage is None else device)
    if e.nbytes:
        flat = raw.reshape(-1).view(torch.uint8)
        if stage is None:
            ckpt.read_into(name, 0, bytes_of(flat))
        else:
            read_through(ckpt, name, flat, stage)
    if like.is_contiguous() and like.dtype == raw.dtype and (on_cpu or stage is not None):
        return raw
    data = torch.empty_strided(
        tuple(like.shape), tuple(like.stride()), dtype=like.dtype, device=device
    )
    data.copy_(raw)
    return data


def read_copies(ckpt: Checkpoint, jobs: Sequence[ReadJob]) -> list[torch.Tensor]:
    """:func:`read_copy` of every job, several at a time (``pread`` and the copy to the
    device release the GIL), in order. Every job has finished, or failed, before this
    returns or raises: nothing is installed until all are read."""
    devices = {torch.device(d) for _, _, d in jobs if torch.device(d).type != "cpu"}
    platforms = {d: get_platform(d) for d in devices}
    stages = {d: _Stages(p) for d, p in platforms.items() if p.can_pin}

    def one(job: ReadJob) -> torch.Tensor:
        s = stages.get(torch.device(job[2]))
        return read_copy(ckpt, job, s.get() if s is not None else None)

    try:
        if len(jobs) < 2:
            return [one(j) for j in jobs]
        total = sum(ckpt.entries[name].nbytes for name, _, _ in jobs)
        bar = progress_bar(total=total, desc="dlo: reading weights", unit="B", unit_scale=True)
        pool = ThreadPoolExecutor(max_workers=min(COPY_READERS, len(jobs)))
        try:
            futures = {pool.submit(one, j): j for j in jobs}
            for done in as_completed(futures):
                done.result()  # the first failure stops the rest (cancelled, running ones waited)
                bar.update(ckpt.entries[futures[done][0]].nbytes)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()
        return [f.result() for f in futures]
    finally:
        for s in stages.values():
            s.close()
