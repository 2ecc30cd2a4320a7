"""Reading byte ranges of a file around the page cache: ``O_DIRECT`` where the filesystem
allows it, else buffered reads whose pages are dropped behind them.

[Note: reads around the page cache]
Blocks that ``host_budget_gb`` leaves in their file are read at every use (see [Note: host
budget tiers] in :mod:`dlo.plan.host_tiers`). Read through the page cache, a model larger
than the host's memory makes the cache thrash and the process's node run out of memory
sooner than the budget promised, so:

* the file is opened with ``O_DIRECT``: the disk writes into this process's memory, no page
  of the file is cached. ``O_DIRECT`` wants the file offset, the length and the memory
  address aligned to the device's logical block (:data:`DIRECT_ALIGN` covers every
  common one); a tensor's bytes start anywhere in a safetensors file, so each read covers
  the aligned range around it in a page-aligned scratch buffer of the reading thread, and
  the wanted bytes are copied out (a host copy at memory speed, beside a disk read);
* where the filesystem refuses ``O_DIRECT`` (tmpfs refuses the open, some FUSE filesystems
  the first read), the file is read buffered and ``posix_fadvise(DONTNEED)`` drops the
  range's pages after each read, so the page cache does not keep what was read;
* every read first compares the file's size and modification time with what they were
  when it was opened: a file rewritten or truncated while it serves fails the read, naming
  the file, instead of feeding other bytes to the model (a read past a truncated end is a
  short read, the same error).

:func:`read_bandwidth` times a short read of the actual file this way (the policy's disk
tier; the page cache dropped first where ``O_DIRECT`` is not available).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dlo.io.checkpoint import Checkpoint
from dlo.io.checksums import Verified, read_verified
from dlo.io.header_checks import CheckpointError

DIRECT_ALIGN = 4096
"""Alignment of ``O_DIRECT`` offsets, lengths and buffers (the largest common logical block)."""

SCRATCH_NBYTES = 2 << 20
"""Bytes one ``O_DIRECT`` read covers at most (a longer range is read in pieces): each
reading thread holds one scratch buffer of this size."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_scratch = threading.local()


def _scratch_view() -> memoryview:
    """This thread's page-aligned scratch buffer (an anonymous mapping is page-aligned)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = mmap.mmap(-1, SCRATCH_NBYTES + DIRECT_ALIGN)
    return memoryview(buf)


class DirectFile:
    """One file opened for reads around the page cache (see [Note: reads around the page
    cache]); safe to read from several threads at once.

    Args:
        path: the file.
        direct: try ``O_DIRECT`` (False: buffered reads, pages dropped behind them).
        identity: ``(st_dev, st_ino, st_size)`` the file must have (the file a checkpoint
            was loaded from: :meth:`~dlo.io.checkpoint.Checkpoint.identity`).
    Raises:
        OSError: the file cannot be opened.
        CheckpointError: it is not the file of ``identity`` (replaced since).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        direct: bool = True,
        identity: tuple[int, int, int] | None = None,
    ) -> None:
        self.path = Path(path)
        self.direct = False
        fd = -1
        if direct and _O_DIRECT:
            try:
                fd = os.open(self.path, os.O_RDONLY | _O_DIRECT | _CLOEXEC)
                self.direct = True
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        if fd < 0:
            fd = os.open(self.path, os.O_RDONLY | _CLOEXEC)
        st = os.fstat(fd)
        if identity is not None and (st.st_dev, st.st_ino, st.st_size) != identity:
            os.close(fd)
            raise CheckpointError(
                f"{self.path}: another file than the one the checkpoint was loaded from "
                "(replaced since): reload the model"
            )
        self._fd = fd
        self._fds = [fd]
        """Every descriptor opened (a fallback keeps the first open until :meth:`close`:
        another thread may still be reading through it)."""
        self.stamp = (st.st_size, st.st_mtime_ns)
        """Size and modification time when opened: a change fails every later read."""
        self.read_nbytes = 0
        """Bytes read from the file (with ``O_DIRECT``: the aligned ranges around them)."""
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raise if the file changed since it was opened (see [Note: reads around the page
        cache])."""
        st = os.fstat(self._fd)
        now = (st.st_size, st.st_mtime_ns)
        if now != self.stamp:
            raise CheckpointError(
                f"{self.path}: changed while dlo reads blocks from it (size "
                f"{self.stamp[0]} -> {now[0]} bytes, mtime {self.stamp[1]} -> {now[1]} "
                "ns): a file that serves blocks must not be rewritten or truncated"
            )

    def read_into(self, offset: int, out: memoryview) -> None:
        """Read ``len(out)`` bytes at ``offset`` into ``out``.

        Raises:
            CheckpointError: the file changed since it was opened, ended early, or a read
                failed (naming the file).
        """
        self.check()
        done = 0
        while done < len(out):
            n = min(SCRATCH_NBYTES, len(out) - done)
            with self._lock:  # one attempt's descriptor and mode, whatever others do
                fd, direct = self._fd, self.direct
            try:
                if direct:
                    self._read_direct(fd, offset + done, out[done : done + n])
                else:
                    self._read_buffered(fd, offset + done, out[done : done + n])
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    self._fall_back()
                    continue
                raise CheckpointError(
                    f"{self.path}: reading {n} bytes at offset {offset + done} failed: {e}"
                ) from e
            done += n

    def _read_direct(self, fd: int, offset: int, out: memoryview) -> None:
        lo = offset - offset % DIRECT_ALIGN
        hi = -(-(offset + len(out)) // DIRECT_ALIGN) * DIRECT_ALIGN
        scratch = _scratch_view()[: hi - lo]
        got = 0
        while got < len(scratch):
            n = os.preadv(fd, [scratch[got:]], lo + got)
            got += max(n, 0)
            if n <= 0 or got % DIRECT_ALIGN:  # the end of the file: no aligned read after
                break
        if got < offset - lo + len(out):
            self._short(offset, len(out))
        with self._lock:
            self.read_nbytes += got
        src = torch.frombuffer(scratch, dtype=torch.uint8)[offset - lo : offset - lo + len(out)]
        torch.frombuffer(out, dtype=torch.uint8).copy_(src)  # releases the GIL

    def _read_buffered(self, fd: int, offset: int, out: memoryview) -> None:
        got = 0
        while got < len(out):
            n = os.preadv(fd, [out[got:]], offset + got)
            if n <= 0:
                self._short(offset, len(out))
            got += n
        with self._lock:
            self.read_nbytes += got
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, len(out), os.POSIX_FADV_DONTNEED)

    def drop_cached(self, offset: int, nbytes: int) -> None:
        """Drop the page cache's pages of a range (where the platform can)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def _short(self, offset: int, nbytes: int) -> None:
        self.check()
        raise CheckpointError(
            f"{self.path}: short read of {nbytes} bytes at offset {offset} (file truncated?)"
        )

    def _fall_back(self) -> None:
        """A filesystem that accepted ``O_DIRECT`` at open but refuses its reads: read
        buffered from now on (idempotent; the stamp stays the first open's)."""
        with self._lock:
            if self.direct:
                self._fd = os.open(self.path, os.O_RDONLY | _CLOEXEC)
                self._fds.append(self._fd)
                self.direct = False

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


PROBE_NBYTES = 256 << 20
"""Bytes :func:`read_bandwidth` reads (or the whole file, if smaller)."""


def read_bandwidth(
    path: str | os.PathLike[str],
    *,
    nbytes: int = PROBE_NBYTES,
    workers: int = 8,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, bool]:
    """Bytes per second of reads around the page cache from the middle of ``path``, on
    ``workers`` threads in :data:`SCRATCH_NBYTES` pieces (the disk tier's reads), and
    whether they were ``O_DIRECT``. Without ``O_DIRECT`` the range's cached pages are
    dropped first, so the disk is what is timed.

    Raises:
        OSError: the file cannot be read.
    """
    f = DirectFile(path)
    try:
        size = f.stamp[0]
        n = min(nbytes, size)
        lo = max(0, (size - n) // 2)
        lo -= lo % DIRECT_ALIGN
        n = min(n, size - lo)
        if n <= 0:
            return 0.0, f.direct
        if not f.direct:
            f.drop_cached(lo, n)
        pieces = [(a, min(SCRATCH_NBYTES, lo + n - a)) for a in range(lo, lo + n, SCRATCH_NBYTES)]
        dst = memoryview(bytearray(SCRATCH_NBYTES * min(workers, len(pieces))))

        def read(k: int) -> None:
            a, m = pieces[k]
            w = k % min(workers, len(pieces))
            f.read_into(a, dst[w * SCRATCH_NBYTES : w * SCRATCH_NBYTES + m])

        t0 = clock()
        with ThreadPoolExecutor(max_workers=min(workers, len(pieces))) as pool:
            list(pool.map(read, range(len(pieces))))
        return n / max(clock() - t0, 1e-9), f.direct
    finally:
        f.close()


class DirectReads:
    """The files one backend reads blocks from around the page cache, each opened once (see
    [Note: reads around the page cache]); reads are checked against the checkpoint's
    checksums where it verifies them."""

    def __init__(self) -> None:
        self._files: dict[Path, DirectFile] = {}
        self._lock = threading.Lock()

    def file(self, ckpt: Checkpoint, path: Path) -> DirectFile:
        """``path`` opened for reads around the page cache, once: the file ``ckpt`` was
        loaded from (the same inode and size), its stamp taken then (see [Note: reads around
        the page cache])."""
        with self._lock:
            f = self._files.get(path)
            if f is None:
                f = DirectFile(path, identity=ckpt.identity(path))
                self._files[path] = f
            return f

    def read_into(
        self, ckpt: Checkpoint, name: str, offset: int, out: memoryview, *, every_read: bool = False
    ) -> None:
        """:meth:`Checkpoint.read_into <dlo.io.checkpoint.Checkpoint.read_into>`, around the
        page cache; ``every_read``: every piece checked against the checkpoint's checksums at
        every read, not once per checkpoint (bytes a decoder trusts: see [Note: encoded
        blocks on disk] in :mod:`dlo.codec.on_disk`)."""
        e = ckpt.entries[name]
        assert offset >= 0 and offset + len(out) <= e.nbytes
        f = self.file(ckpt, e.file)

        def pread(at: int, buf: memoryview) -> None:
            f.read_into(e.start + at, buf)

        if every_read:
            assert ckpt.verify_checksum and e.checksums is not None
            where = str(e.file)
            read_verified(pread, where, name, e.nbytes, e.checksums, offset, out, Verified())
        else:
            ckpt.read_checked(name, offset, out, pread)

    @property
    def files(self) -> list[DirectFile]:
        with self._lock:
            return list(self._files.values())

    @property
    def read_nbytes(self) -> int:
        return sum(f.read_nbytes for f in self.files)

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()
