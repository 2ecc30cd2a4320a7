"""Files dlo writes, and the files it reads only when they are its user's own.

[Note: writing files]
Every file dlo writes (a checkpoint's shards and index, an encoded checkpoint) goes to a
private temporary file in the target's directory and is renamed over the target once whole,
so a reader sees the old file or the whole new one:

- the temporary name is random (``.<name>.<random>.tmp``) and created with ``O_CREAT |
  O_EXCL | O_NOFOLLOW``: nothing another user planted in the directory is opened, followed
  or written (the fixed ``<name>.tmp`` of before was a planted symlink away from
  overwriting any file of the user's), and two writers of one file each write their own
  (the last rename wins; each file is whole);
- a failure or an interrupt anywhere removes every temporary file not renamed yet (their
  creation and the renames run in :func:`dlo.journal.atomic`, so a Ctrl-C lands before or
  after one, never inside), and a failed write is one :class:`CheckpointWriteError` naming
  the file and the reason (a read-only directory, a full disk, ``ulimit -f``);
- the files of one save (a sharded checkpoint and its index) are renamed together at its
  end: an interrupted save leaves the folder as it was, not new shards beside old ones.

A kill (SIGKILL, the OOM killer) can still leave a temporary file, never a half-written
target; no reader opens it (no ``*.safetensors`` name).

Every file's bytes are synced to the disk (``fdatasync``) before it is renamed or linked
into place, and then dropped from the page cache (``POSIX_FADV_DONTNEED``):
:func:`sync_and_drop`. The disk tier reads the files dlo writes (an encoded checkpoint, a
saved checkpoint's shards) around the page cache (``O_DIRECT``, see [Note: reads around the
page cache] in :mod:`dlo.io.direct`), and Linux writes a range's dirty pages back before an
``O_DIRECT`` read of it: the first forwards after an enable that wrote Wan2.1-14B's 19.5 GB
encoded file read it at 0.95 GB/s against 1.34 GB/s from the raw checkpoint, likely
contending with its writeback (H100, 8 GiB budget, 2026-12-07), while the page cache held the 19.5 GB beside
the host budget (a read of the new file right after, such as an enable's of the blocks
its budget keeps, now comes from the disk). Synced before the rename, a crash leaves the old file or the whole new
one, never the new name over bytes not on the disk yet. A filesystem that cannot sync
(``EINVAL``, ``ENOTSUP``) writes unsynced (logged at debug); an I/O error of the sync
(``EIO``, ``ENOSPC``) fails the write as any other. The directory is not synced: a crash
may lose the rename itself (the old file, or none), never leave a wrong one.

[Note: own files]
dlo's encoded checkpoint (:mod:`dlo.codec.offline`) is an optional cache whose fingerprint
of the weights it encodes (sizes, times, inodes, header checksums) anyone who can read the
checkpoint can copy. A file that another user could have written beside the checkpoint (in
``/tmp``, a team directory) would choose the weights dlo streams, so such a file is read only
if it is this process's user's own (:func:`open_own`): a regular file owned by the effective
uid that no other user can write, checked on the descriptor every byte is then read through
(a rename over the path after the check changes nothing). dlo writes those files with mode
``0644`` less the umask, so its own pass. The node-shared memfd passes the same check, with
no group or other permission at all (:mod:`dlo.host.region`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from dlo.io.header_checks import CheckpointError
from dlo.journal import atomic

FILE_MODE = 0o666
"""The mode of a written checkpoint file, less the umask (what ``open(path, "wb")`` gives)."""
OWN_FILE_MODE = 0o644
"""The mode of a file read only when it is the user's own (see [Note: own files]): the
umask can take permissions away, never let the group or others write it."""
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
"""The mode bits that let a user other than the owner write a file."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_EFFECTIVE_IDS = os.access in os.supports_effective_ids

logger = logging.getLogger(__name__)


class CheckpointWriteError(CheckpointError):
    """A file dlo could not write (a read-only directory, a full disk, ``ulimit -f``); the
    message names the file and the reason. Nothing partial is left: the target is as
    before (see [Note: writing files])."""


def not_own(st: os.stat_result, forbidden: int = OTHERS_WRITE) -> str:
    """Why a file of status ``st`` is not this process's user's own (see [Note: own files]):
    not a regular file, another owner, or a mode with a ``forbidden`` bit; "" when it is."""
    why = []
    if not stat.S_ISREG(st.st_mode):
        why.append("not a regular file")
    if st.st_uid != os.geteuid():
        why.append(f"owner uid {st.st_uid} against this process's {os.geteuid()}")
    if st.st_mode & forbidden:
        who = "write" if forbidden == OTHERS_WRITE else "open"
        why.append(f"mode {stat.S_IMODE(st.st_mode):o} lets other users {who} it")
    return ", ".join(why)


def open_own(path: Path) -> int:
    """A read-only descriptor of ``path``, a file of this process's user that no other user
    can write (see [Note: own files]); symlinks are not followed.

    Raises:
        CheckpointError: another file, naming it, its owner and its mode.
        FileNotFoundError: there is no such file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: a symbolic link: refused") from None
        if isinstance(e, FileNotFoundError):
            raise
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from e
    why = not_own(os.fstat(fd))
    if why:
        os.close(fd)
        raise CheckpointError(
            f"{path} is not this user's own ({why}): refused, since whoever can write it "
            "chooses the weights read from it"
        )
    return fd


def check_writable_dir(path: str | os.PathLike[str], field: str) -> None:
    """Refuse, before any work, a folder to write into that cannot take files: ``path`` (or
    the nearest existing folder above it, where it would be created) is not a directory, or
    this process cannot create files in it.

    Raises:
        CheckpointWriteError: naming ``field``, the path and the reason.
    """
    p = Path(path)  # relative stays relative: the folders above the cwd may be closed to us
    there = next((a for a in (p, *p.parents) if os.path.lexists(a)), Path("."))
    if not os.path.isdir(there):
        where = "" if there == p else f": {there}"
        raise CheckpointWriteError(f"{field}={str(p)!r}{where} exists and is not a directory")
    why = access_denied(there, os.W_OK | os.X_OK)
    if why:
        raise CheckpointWriteError(f"{field}={str(p)!r}: {why}")


def access_denied(folder: Path, mode: int) -> str:
    """Why this process (its effective uid, which opens the files) may not use ``folder``
    as ``mode`` asks (``os.R_OK | os.X_OK``: read; with ``os.W_OK``: write in it), naming
    the uid, the folder's mode and owner; "" when it may."""
    if os.access(folder, mode, effective_ids=_EFFECTIVE_IDS):
        return ""
    try:
        st = folder.stat()
        about = f"mode {stat.S_IMODE(st.st_mode):03o}, owner uid {st.st_uid}"
    except OSError as e:
        about = e.strerror or str(e)
    verb = "write in" if mode & os.W_OK else "read"
    return f"this process (uid {os.geteuid()}) cannot {verb} {folder} ({about})"


class Staged:
    """New files written beside their targets, renamed over them together by :meth:`commit`
    (see [Note: writing files]); use through :func:`staged`."""

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []
        """``(temporary file, target)`` of every file written and not renamed yet."""

    def write(
        self, path: Path, chunks: Iterable[bytes | memoryview], mode: int = FILE_MODE
    ) -> None:
        """Write ``chunks`` to a new private temporary file beside ``path``, with ``mode``
        (less the umask)."""
        try:
            with atomic():  # the file exists only once its removal is recorded
                tmp, fd = _create(path, mode)
                self._pending.append((tmp, path))
            with open(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                sync_and_drop(f.fileno(), path)
        except OSError as e:
            raise CheckpointWriteError(f"cannot write {path}: {e.strerror or e}") from e

    def commit(self) -> None:
        """Rename every file written over its target, in the order written."""
        with atomic():
            while self._pending:
                tmp, path = self._pending[0]
                try:
                    os.replace(tmp, path)
                except OSError as e:
                    raise CheckpointWriteError(f"cannot write {path}: {e.strerror or e}") from e
                self._pending.pop(0)

    def discard(self) -> None:
        """Remove every temporary file not renamed yet."""
        with atomic():
            while self._pending:
                tmp, _ = self._pending.pop()
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


@contextlib.contextmanager
def staged() -> Iterator[Staged]:
    """Files written in the block are renamed over their targets at its end, all of them;
    if it raises (an interrupt included) none is, and their temporary files are removed.

    Raises:
        CheckpointWriteError: a file could not be written, naming it and the reason.

    Example:
        >>> with staged() as files:
        ...     files.write(Path("out/model.safetensors"), [header, data])
    """
    files = Staged()
    try:
        yield files
        files.commit()
    finally:
        files.discard()  # nothing left after a commit


def sync_and_drop(fd: int, path: Path) -> None:
    """Sync written file ``fd`` (to be named ``path``) to the disk and drop its pages from
    the page cache, before it is renamed or linked into place (see [Note: writing files]);
    a filesystem that cannot sync is logged at debug and left unsynced.

    Raises:
        OSError: the sync failed (``EIO``, ``ENOSPC``): the bytes may not be on the disk.
    """
    try:
        getattr(os, "fdatasync", os.fsync)(fd)
    except OSError as e:
        if e.errno not in _NO_SYNC:
            raise
        logger.debug("dlo: %s cannot be synced (%s): written unsynced", path, e.strerror or e)
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):  # advice: dirty pages stay cached, no more
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


_NO_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}
"""What ``fdatasync`` answers on a filesystem that does not sync (a pipe's, some FUSE ones)."""


def _create(path: Path, mode: int) -> tuple[Path, int]:
    for name in _temporary_names(path):
        tmp = path.with_name(name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        with contextlib.suppress(FileExistsError):
            return tmp, os.open(tmp, flags, mode)
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(path))


def _temporary_names(path: Path) -> Iterator[str]:
    """Hidden names beside ``path`` to try for a file renamed over it later (100 of them)."""
    for _ in range(100):
        yield f".{path.name}.{secrets.token_hex(6)}.tmp"


def anonymous_file(directory: Path, mode: int) -> int | None:
    """A new file in ``directory`` with no name yet (``O_TMPFILE``: nothing is left behind
    however the process ends), open to read and write, with ``mode`` (less the umask); None
    where the platform or the filesystem has no such files."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return None
    try:
        return os.open(directory, flag | os.O_RDWR | _CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None
        raise


class NotLinkable(OSError):
    """An anonymous file cannot be given a name in that folder (see :func:`link_into_place`)."""


_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EACCES, errno.ENOENT, errno.EOPNOTSUPP)


def link_into_place(fd: int, path: Path) -> None:
    """Give :func:`anonymous_file` ``fd`` the name ``path`` (``linkat`` through
    ``/proc/self/fd``): straight where no file is there, else under a temporary name beside
    it, renamed over it at once.

    Raises:
        NotLinkable: the folder or the platform gives anonymous files no name.
    """
    src = f"/proc/self/fd/{fd}"
    dfd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:

        def link(name: str) -> None:
            try:
                os.link(src, name, dst_dir_fd=dfd, follow_symlinks=True)  # linkat: follows
            except FileExistsError:
                raise
            except OSError as e:
                if e.errno in _NO_LINK:
                    raise NotLinkable(e.errno, e.strerror, str(path)) from e
                raise

        with atomic():
            try:
                link(path.name)
                return
            except FileExistsError:
                pass
            for tmp in _temporary_names(path):
                try:
                    link(tmp)
                    break
                except FileExistsError:
                    continue
            else:
                raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(path))
            try:
                os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
    finally:
        os.close(dfd)


@contextlib.contextmanager
def locked_dir(directory: Path) -> Iterator[None]:
    """An exclusive lock on ``directory`` (``flock`` on its descriptor: nothing is created
    in it), held by one process of the node at a time (a node's: ``flock`` does not reach
    across the nodes of a network filesystem)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # a filesystem without flock (NFS directories, some Lustre)
            logger.warning(
                "dlo: %s cannot be locked (%s): processes sharing it may each write its files",
                directory,
                e.strerror or e,
            )
        yield
    finally:
        os.close(fd)  # releases the lock
