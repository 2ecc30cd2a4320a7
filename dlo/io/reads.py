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

import functools
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dlo.io.buffers import bytes_of
from dlo.io.checkpoint import Checkpoint
from dlo.journal import atomic
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
            buf = torch.empty(STAGE_NBYTES, dtype=torch.uint8)
            pinned = self.platform.register_host(buf)
            if pinned:
                with self._lock:
                    self._registered.append(buf)
            self._local.stage = buf if pinned else None
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


def read_into_tensor(
    ckpt: Checkpoint, name: str, dst: torch.Tensor, stage: torch.Tensor | None = None
) -> None:
    """Read entry ``name`` into ``dst`` (its shape; any dtype, strides and device), with
    ``pread`` (through ``stage``, page-locked, for a device; see [Note: staged device
    reads]); a cast or strided copy is made from the stored bytes where ``dst`` lives."""
    e = ckpt.entries[name]
    on_cpu = dst.device.type == "cpu"
    direct = dst.is_contiguous() and dst.dtype == e.dtype and (on_cpu or stage is not None)
    raw = (
        dst
        if direct
        else torch.empty(e.shape, dtype=e.dtype, device="cpu" if stage is None else dst.device)
    )
    if e.nbytes:
        flat = raw.reshape(-1).view(torch.uint8)
        if stage is None:
            ckpt.read_into(name, 0, bytes_of(flat))
        else:
            read_through(ckpt, name, flat, stage)
    if not direct:
        dst.copy_(raw)


def _destination(job: ReadJob) -> torch.Tensor:
    """New memory for ``job``: the skeleton tensor's shape, strides and dtype on its device."""
    _, like, device = job
    return torch.empty_strided(
        tuple(like.shape), tuple(like.stride()), dtype=like.dtype, device=device
    )


def read_copy(ckpt: Checkpoint, job: ReadJob, stage: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor of ``job``, read into new memory (:func:`read_into_tensor`)."""
    data = _destination(job)
    read_into_tensor(ckpt, job[0], data, stage)
    return data


class PendingReads:
    """Copied tensors being read into their destinations, allocated up front
    (:attr:`tensors`, in job order), on a pool of :data:`COPY_READERS` threads.

    Nothing runs until :meth:`start` (so a caller can record :meth:`cancel` first).
    :meth:`wait` returns once every read has finished and raises the first failure (the
    reads not started are then cancelled and the running ones waited for); :meth:`cancel`
    stops them without raising. Either leaves no read running; both are idempotent.
    """

    def __init__(self, ckpt: Checkpoint, jobs: Sequence[ReadJob]) -> None:
        self.ckpt = ckpt
        self.tensors = [_destination(j) for j in jobs]
        platforms = {
            t.device: get_platform(t.device) for t in self.tensors if t.device.type != "cpu"
        }
        self._stages = {d: _Stages(p) for d, p in platforms.items() if p.can_pin}
        self._platforms = list(platforms.values())
        self._names = [name for name, _, _ in jobs]
        self._futures: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._bar: Any = None
        self._done = False

    def start(self) -> None:
        """Start the reads on the pool (one job is read by :meth:`wait` itself)."""
        if self._done or self._pool is not None or len(self._names) < 2:
            return
        ckpt = self.ckpt
        total = sum(ckpt.entries[n].nbytes for n in self._names)
        self._bar = progress_bar(
            total=total, desc="dlo: reading weights", unit="B", unit_scale=True
        )
        self._pool = ThreadPoolExecutor(max_workers=min(COPY_READERS, len(self._names)))
        bar = self._bar
        for n, t in zip(self._names, self.tensors):
            f = self._pool.submit(self._read, n, t)
            f.add_done_callback(functools.partial(_advance, bar, ckpt.entries[n].nbytes))
            self._futures.append(f)

    def _read(self, name: str, dst: torch.Tensor) -> None:
        s = self._stages.get(dst.device)
        read_into_tensor(self.ckpt, name, dst, s.get() if s is not None else None)

    def wait(self) -> None:
        if self._done:
            return
        try:
            if self._pool is None:
                for n, t in zip(self._names, self.tensors):
                    self._read(n, t)
            for f in self._futures:
                f.result()  # the first failure stops the rest (cancelled, running ones waited)
        finally:
            self._finish()

    def cancel(self) -> None:
        if self._done:
            return
        for f in self._futures:
            f.cancel()
        self._finish()

    def _finish(self) -> None:
        with atomic():  # no read left running behind a second interrupt
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            if self._bar is not None:
                self._bar.close()
            for s in self._stages.values():
                s.close()
            for p in self._platforms:
                p.synchronize()  # a cast or strided copy is an asynchronous kernel
            self._futures, self._pool, self._bar, self._stages = [], None, None, {}
            self._done = True


def _advance(bar: Any, nbytes: int, _: Future[None]) -> None:
    """A read's done-callback: the progress bar advances (no reference to the reads, so no
    cycle through the futures)."""
    bar.update(nbytes)


def read_copies(ckpt: Checkpoint, jobs: Sequence[ReadJob]) -> list[torch.Tensor]:
    """:func:`read_copy` of every job, several at a time (``pread`` and the copy to the
    device release the GIL), in order. Every job has finished, or failed, before this
    returns or raises: nothing is installed until all are read."""
    pending = PendingReads(ckpt, jobs)
    try:
        pending.start()
        pending.wait()
    finally:
        pending.cancel()  # a no-op once waited for
    return pending.tensors
