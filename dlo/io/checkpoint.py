"""safetensors checkpoints: headers, sharded indexes, read-only mappings, a streaming writer.

[Note: safetensors format]
A ``.safetensors`` file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then
the data: every tensor contiguous and row-major at ``8 + n + begin``. A sharded checkpoint
is several such files and a ``*.safetensors.index.json`` whose ``weight_map`` names the file
of every tensor. dlo parses headers itself (no dependency at load time) and checks every
entry before anything is read: a known dtype, ``end - begin == numel * itemsize``, data
inside the file, no tensor in two files, and a ``weight_map`` that agrees with the headers.

[Note: mapped checkpoint tensors]
:meth:`Checkpoint.tensor` returns a CPU tensor aliasing a private (copy-on-write) mapping of
the file: no byte is read until it is touched, pages come from the page cache (shared by
every rank of a node), and a write by accident makes a private copy instead of changing the
file or crashing. Touched pages count in the process RSS (a touch maps a whole page-cache
folio, up to 2 MiB), so dlo itself never reads through the mapping: it reads the byte ranges
it needs with ``pread`` (:meth:`Checkpoint.read_into`), which leaves the pages in the shared
page cache and out of the process.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import stat
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dlo.io import checksums
from dlo.io.files import open_own
from dlo.io.header_checks import (
    CheckpointError,
    _check_disjoint,
    _DuplicateKey,
    _is_int,
    _unique_keys,
    loads_json,
)

logger = logging.getLogger(__name__)


MAX_HEADER_NBYTES = 100 << 20
"""Headers larger than this are refused (the limit the safetensors library uses)."""

ENCODED_FILE = "dlo-encoded.safetensors"
"""dlo's encoded checkpoint beside a checkpoint's files (:mod:`dlo.codec.offline`): a cache
of encoded blocks, never weights, so a directory's scan for its files skips it."""


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)


DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, as its header describes it."""

    name: str
    """Name in the model's state dict (after the source's prefix)."""
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the tensor's data in ``file``."""
    nbytes: int
    checksums: tuple[int, tuple[str, ...]] | None = None
    """``(piece_nbytes, digests)`` written with the data (see [Note: checkpoint checksums]
    in :mod:`dlo.io.checksums`), or None."""

    @property
    def end(self) -> int:
        return self.start + self.nbytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _load_header(p: Path, fd: int | None = None) -> tuple[dict[str, Any], int, int]:
    """The parsed header of ``p`` (read through ``fd`` where given), the offset of its data
    and the file's size."""
    try:
        st = p.stat() if fd is None else os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block in open, a device never end
            raise CheckpointError(f"{p}: not a regular file")
        size = st.st_size
        with open(p, "rb") if fd is None else os.fdopen(os.dup(fd), "rb") as f:
            f.seek(0)
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{p}: {size} bytes is too short for a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_NBYTES or 8 + n > size:
                raise CheckpointError(f"{p}: header length {n} does not fit the file ({size} B)")
            try:
                header = loads_json(f.read(n), object_pairs_hook=_unique_keys)
            except _DuplicateKey as e:
                raise CheckpointError(f"{p}: duplicate key {e} in the header") from None
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read: {e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{p}: header is not a JSON object")
    return header, 8 + n, size


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """Parse and check one ``.safetensors`` header (see [Note: safetensors format]).

    Returns:
        ``{name: TensorEntry}`` in header order; names are the file's own.
    Raises:
        CheckpointError: unreadable or inconsistent header, naming the file and the tensor.
    """
    return _read_file_header(Path(path))[0]


def _read_file_header(
    p: Path, fd: int | None = None
) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """:func:`read_header` (through ``fd`` where given) and the ``__metadata__`` of the
    same read."""
    header, base, size = _load_header(p, fd)
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not all(_is_int(v) for v in (*shape, begin, end)):
                raise TypeError("shape and data_offsets must be integers")
            shape_t = tuple(shape)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{p}: tensor {name!r}: malformed header entry {info!r}") from e
        if dtype_name not in DTYPES:
            raise CheckpointError(
                f"{p}: tensor {name!r}: dtype {dtype_name!r} is not one torch supports here"
            )
        dtype = DTYPES[dtype_name]
        expected = math.prod(shape_t) * _itemsize(dtype)
        if min(shape_t, default=0) < 0 or begin < 0 or end - begin != expected:
            raise CheckpointError(
                f"{p}: tensor {name!r}: data_offsets [{begin}, {end}] do not hold shape "
                f"{list(shape_t)} of {dtype_name} ({expected} bytes)"
            )
        if base + end > size:
            raise CheckpointError(f"{p}: tensor {name!r}: data past the end of the file")
        out[name] = TensorEntry(name, p, dtype, shape_t, base + begin, expected)
    _check_disjoint(p, out)
    meta = header.get("__metadata__")
    sums = checksums.parse(p, meta, {n: e.nbytes for n, e in out.items()})
    if sums:
        out = {n: replace(e, checksums=(sums[n][0], tuple(sums[n][1]))) for n, e in out.items()}
    return out, meta if isinstance(meta, dict) else {}


def _find_files(path: Path) -> tuple[list[Path], Path | None]:
    """The ``.safetensors`` files of a checkpoint path, and its index file if any."""
    if path.is_file():
        if path.name.endswith(".index.json"):
            return [], path
        return [path], None
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(
            f"checkpoint {path} has {len(indexes)} index files "
            f"({', '.join(i.name for i in indexes)}); pass the one to use"
        )
    if indexes:
        return [], indexes[0]
    files = sorted(f for f in path.glob("*.safetensors") if f.name != ENCODED_FILE)
    if not files:
        raise CheckpointError(f"checkpoint {path} holds no .safetensors weights file")
    return files, None


def _index_files(index: Path) -> tuple[list[Path], dict[str, str]]:
    try:
        weight_map = loads_json(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
    bad = sorted(k for k, v in weight_map.items() if not isinstance(v, str) or not v)
    if bad:
        raise CheckpointError(
            f"{index}: weight_map must give a file name for every tensor; not for "
            + ", ".join(f"{k!r} ({weight_map[k]!r})" for k in bad[:8])
        )
    names = sorted(set(weight_map.values()))
    outside = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts]
    if outside:  # diffusers refuses these too (it takes plain file names only)
        raise CheckpointError(
            f"{index}: weight_map names files outside {index.parent} "
            f"({', '.join(repr(n) for n in outside[:4])}): shards are named relative to "
            "the index's folder, inside it"
        )
    return [index.parent / n for n in names], weight_map


class Checkpoint:
    """Every tensor of one or more safetensors checkpoints, by state-dict name.

    Args:
        sources: a checkpoint path (a ``.safetensors`` file, a directory, or an
            ``*.safetensors.index.json``), or a mapping ``{prefix: path}`` whose tensors are
            named ``prefix + "." + name`` (a diffusers-style folder per component); the
            prefix ``""`` adds nothing.
        verify_checksum: check every byte read with :meth:`read_into` against the checksums
            dlo's writer stored with it (see [Note: checkpoint checksums]); every file must
            have them.
        own_files: read only files of this process's user that no other user can write
            (dlo's encoded checkpoint, see [Note: own files] in :mod:`dlo.io.files`),
            through the descriptor that was checked.

    Raises:
        CheckpointError: a bad file, a tensor in two files, an index that disagrees with
            the headers (see [Note: safetensors format]), or, with ``verify_checksum``, a
            file without checksums, or with ``own_files`` another user's file.

    Example:
        >>> ckpt = Checkpoint("out/model.safetensors.index.json")
        >>> ckpt.entries["transformer.blocks.0.attn.qkv.weight"].shape
        (15360, 5120)
    """

    def __init__(
        self,
        sources: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]],
        *,
        verify_checksum: bool = False,
        own_files: bool = False,
    ) -> None:
        if isinstance(sources, Mapping):
            items = [(str(k), Path(v)) for k, v in sources.items()]
        else:
            items = [("", Path(sources))]
        self.entries: dict[str, TensorEntry] = {}
        self.files: list[Path] = []
        self.metadata: dict[Path, dict[str, Any]] = {}
        """Each file's ``__metadata__``, from the header its entries were read from."""
        self._maps: dict[Path, mmap.mmap] = {}
        self._fds: dict[Path, int] = {}
        self._own: dict[Path, tuple[int, int]] | None = {} if own_files else None
        """With ``own_files``: each file's ``(st_dev, st_ino)``, checked where it reopens."""
        self._lock = threading.Lock()
        self._users = 0
        try:
            for prefix, path in items:
                for name, entry in self._read_source(path).items():
                    full = f"{prefix}.{name}" if prefix else name
                    other = self.entries.get(full)
                    if other is not None:
                        raise CheckpointError(
                            f"tensor {full!r} is stored twice: in {other.file} and in {entry.file}"
                        )
                    self.entries[full] = replace(entry, name=full)
            self.verify_checksum = verify_checksum
            unchecked = sorted({str(e.file) for e in self.entries.values() if e.checksums is None})
            if verify_checksum and unchecked:
                raise CheckpointError(
                    f"verify_checksum=True, but {', '.join(unchecked[:4])} "
                    f"{'has' if len(unchecked) == 1 else 'have'} no dlo checksums (files "
                    "written by dlo save-checkpoint have them); load without verify_checksum"
                )
        except BaseException:
            self.close()
            raise
        self.verified = checksums.Verified()
        self.read_nbytes = 0
        """Bytes read with :meth:`read_into` so far."""

    def _read_source(self, path: Path) -> dict[str, TensorEntry]:
        files, index = _find_files(path)
        weight_map: dict[str, str] | None = None
        if index is not None:
            files, weight_map = _index_files(index)
        out: dict[str, TensorEntry] = {}
        for f in files:
            self.files.append(f)
            fd = self._fd(f) if self._own is not None else None  # no other thread has it yet
            entries, self.metadata[f] = _read_file_header(f, fd)
            for name, entry in entries.items():
                if name in out:
                    raise CheckpointError(
                        f"tensor {name!r} is stored twice: in {out[name].file} and in {f}"
                    )
                out[name] = entry
        if weight_map is not None:
            assert index is not None
            wrong = sorted(
                n
                for n, fname in weight_map.items()
                if n not in out or out[n].file != index.parent / fname
            )
            unlisted = sorted(set(out) - set(weight_map))
            if wrong or unlisted:
                raise CheckpointError(
                    f"{index}: weight_map disagrees with the file headers: "
                    + "; ".join(
                        part
                        for part in (
                            f"not found where listed: {', '.join(wrong[:8])}" if wrong else "",
                            f"not listed: {', '.join(unlisted[:8])}" if unlisted else "",
                        )
                        if part
                    )
                )
        return out

    # ------------------------------------------------------------------ data
    def _fd(self, file: Path) -> int:
        """The descriptor ``file`` is read through, opened once (with ``own_files``:
        checked, and the file its header was read from); the caller holds the lock."""
        fd = self._fds.get(file)
        if fd is None:
            if self._own is None:
                fd = os.open(file, os.O_RDONLY)
            else:
                st = os.fstat(fd := open_own(file))
                if self._own.setdefault(file, (st.st_dev, st.st_ino)) != (st.st_dev, st.st_ino):
                    os.close(fd)
                    raise CheckpointError(f"{file}: replaced since its header was read")
            self._fds[file] = fd
        return fd

    def _map(self, file: Path) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(file)
            if m is None:
                m = self._maps[file] = mmap.mmap(self._fd(file), 0, access=mmap.ACCESS_COPY)
            return m

    def tensor(self, name: str) -> torch.Tensor:
        """A CPU tensor aliasing ``name``'s bytes in the file (see [Note: mapped checkpoint
        tensors]); contiguous, of the header's shape and dtype."""
        e = self.entries[name]
        m = self._map(e.file)
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        flat = torch.frombuffer(m, dtype=torch.uint8, count=e.nbytes, offset=e.start)
        if e.start % _itemsize(e.dtype):
            flat = flat.clone()  # misaligned for its dtype: a private, aligned copy
        return flat.view(e.dtype).view(e.shape)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Read ``len(out)`` bytes of ``name`` from byte ``offset`` of its data into ``out``,
        with ``pread``: nothing is mapped, so nothing counts in this process's RSS."""
        e = self.entries[name]
        assert offset >= 0 and offset + len(out) <= e.nbytes
        with self._lock:
            fd = self._fd(e.file)

        def pread(at: int, buf: memoryview) -> None:
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], e.start + at + done)
                if n <= 0:
                    raise CheckpointError(f"{e.file}: short read of {name!r} (file changed?)")
                done += n
            with self._lock:
                self.read_nbytes += done

        self.read_checked(name, offset, out, pread)

    def read_checked(
        self, name: str, offset: int, out: memoryview, pread: Callable[[int, memoryview], None]
    ) -> None:
        """``pread(at, buf)`` of ``name``'s data into ``out``, checked against the stored
        checksums where this checkpoint verifies them (see [Note: checkpoint checksums])."""
        e = self.entries[name]
        if self.verify_checksum:
            assert e.checksums is not None
            checksums.read_verified(
                pread, str(e.file), name, e.nbytes, e.checksums, offset, out, self.verified
            )
        else:
            pread(offset, out)

    def identity(self, file: Path) -> tuple[int, int, int]:
        """``(st_dev, st_ino, st_size)`` of ``file`` as this checkpoint reads (and maps) it."""
        with self._lock:
            st = os.fstat(self._fd(file))
        return st.st_dev, st.st_ino, st.st_size

    def is_aligned(self, name: str) -> bool:
        e = self.entries[name]
        return e.start % _itemsize(e.dtype) == 0

    def retain(self) -> None:
        """Keep the files open across :meth:`close` until the matching :meth:`release` (a
        backend that reads blocks from the file while the model runs)."""
        with self._lock:
            self._users += 1

    def release(self) -> None:
        """End one :meth:`retain`; the last one closes the files."""
        with self._lock:
            assert self._users > 0, "release without retain"
            self._users -= 1
            last = self._users == 0
        if last:
            self.close()

    def close(self) -> None:
        """Forget the mappings (each is unmapped once no tensor aliases it any more) and
        close the files read with :meth:`read_into`; deferred while a user :meth:`retain` s
        the checkpoint (a closed checkpoint reopens its files on the next read)."""
        with self._lock:
            if self._users:
                return
            self._maps.clear()
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)
