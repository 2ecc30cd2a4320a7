"""Encoded checkpoints: blocks encoded once, offline, and read from a file into the host copy.

[Note: encoded checkpoint]
Encoding at enable costs time (FLUX.1-dev: 22 s against 4 s) and, until every size is
known, host memory for the encoded pieces. A block whose tensors all come from one
checkpoint (loaded by :func:`dlo.load_pipeline`: aliasing its mapping,
:func:`~dlo.io.sources.mapped_source`, or read from it into private memory, cast on load or
copied, :func:`~dlo.io.sources.derived_source`, for the enable of its own load only: a write
through ``.data`` leaves private memory without a trace) is instead read, encoded, from
:data:`ENCODED_FILE` in the directory of its tensors' files (named in
:mod:`dlo.io.checkpoint`, whose directory scans skip it), straight into its bytes of the
host region. ``dlo save-checkpoint --codec`` writes that file, and so
does ``backend.save_encoded()`` after any enable that encoded blocks of a checkpoint (a
pipeline folder's component directory, say). The file is safetensors: one uint8 tensor per
block, named by the block's path, and under ``__metadata__["dlo.encoded"]`` a JSON record
``{"version": 2, "bitstream": B, "blocks": {path: {"layout": D, "sources": [[name, F], ...],
"pieces": [[raw_offset, raw_nbytes, offset, nbytes, stored], ...]}}}``, D the digest of the
block's layout (its tensors, dtypes and offsets, group size 1 and the chunk size the pieces
follow) and F each source tensor's fingerprint (its file's size, modification time, change
time and inode and the tensor's place in it, with its dlo checksums where it has them, and
for a tensor read as another dtype than stored that dtype; a tensor the checkpoint does not
hold, such as a non-persistent buffer, has no name and the digest of its bytes). The change
time is what no user can set: a file rewritten in place with its size and modification time
kept (``cp --preserve=timestamps``, archives with fixed times) has a new one, while a
diffusers folder's files carry no dlo checksums to tell otherwise.

The file is read only if it is this user's own (:func:`~dlo.io.files.open_own`: owned by
the effective uid, writable by no other user, checked on the descriptor it is read through;
dlo writes it with mode ``0644`` less the umask): the fingerprints are readable by anyone
who can read the checkpoint, so a file another user planted beside it (in ``/tmp``, a team
directory) would otherwise choose the weights dlo streams. Another user's file is ignored
like a stale one, with one warning naming its owner and mode, and the blocks are encoded.

An entry serves a block only when the bitstream, the layout digest and every source name
and fingerprint match the block as it is now, and its piece table passes
:func:`~dlo.codec.format.check_layout`; otherwise the block is encoded at enable and the
log says why: a stale file never serves other bytes, and never fails an enable. The encoded
bytes carry dlo's checksums and are always read verified, since nvCOMP's decoder does not
check its input (a corrupted byte faulted the device in the probe): a mismatch fails the
enable, which rolls back. Group size 1 only (rank-local and node-shared stacks): an
AllGather rank's slices depend on the group size and its rank, and are encoded at enable.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dlo.codec.format import EncodedLayout, Piece, check_layout
from dlo.errors import OffloadError
from dlo.io.buffers import bytes_of, flat_uint8
from dlo.io.checkpoint import ENCODED_FILE, Checkpoint
from dlo.io.files import OWN_FILE_MODE
from dlo.io.header_checks import CheckpointError, loads_json
from dlo.io.sources import derived_source, mapped_source
from dlo.io.writer import write_file
from dlo.plan.layout import BlockLayout, build_manifest
from dlo.platform.env import cpu_share

logger = logging.getLogger(__name__)

METADATA_KEY = "dlo.encoded"
VERSION = 2
"""2: fingerprints carry the change time (files of version 1 are encoded again, once)."""

Reader = Callable[[torch.Tensor], None]
"""Reads one block's encoded bytes (verified) into its bytes of the host region."""


@dataclass(frozen=True)
class Origin:
    """Where a block's bytes come from: the checkpoint its tensors alias, and each layout
    tensor's source ``[name, fingerprint]`` (a tensor the checkpoint does not hold, such as a
    non-persistent buffer computed at construction, by the digest of its bytes)."""

    checkpoint: Checkpoint
    names: tuple[str, ...]
    """The checkpoint tensors the block's tensors alias."""
    sources: tuple[tuple[str, str], ...]

    @property
    def directory(self) -> Path | None:
        """The one directory of the files holding the tensors (None: several)."""
        dirs = {self.checkpoint.entries[n].file.parent for n in self.names}
        return dirs.pop() if len(dirs) == 1 else None


def origin_of(tensors: Sequence[torch.Tensor]) -> Origin | None:
    """Where ``tensors`` (a block's, in layout order) come from: None unless some alias a
    checkpoint or were read from it into private memory (cast on load, or copied), all of
    them the same one. The others are hashed (small, as a rule: buffers computed at
    construction); a tensor read as another dtype than stored is named by its file's
    fingerprint and that dtype (the cast is exact and deterministic)."""
    found: list[tuple[Checkpoint, str, str] | None] = []
    for t in tensors:
        m = mapped_source(t)
        d = derived_source(t) if m is None else None
        found.append((m[0], m[1], "") if m is not None else (d[0], d[1], _cast(d)) if d else None)
    ckpts = {id(f[0]): f[0] for f in found if f is not None}
    if len(ckpts) != 1:
        return None
    (ckpt,) = ckpts.values()
    sources = tuple(
        (f[1], fingerprint(ckpt, f[1]) + f[2])
        if f is not None
        else ("", "bytes:" + hashlib.sha256(bytes_of(flat_uint8(t))).hexdigest())
        for f, t in zip(found, tensors)
    )
    return Origin(ckpt, tuple(f[1] for f in found if f is not None), sources)


def _cast(derived: tuple[Checkpoint, str, torch.dtype]) -> str:
    """The fingerprint suffix of a tensor read as ``dtype`` (none where that is the stored
    dtype: a copy holds the file's bytes)."""
    ckpt, name, dtype = derived
    return "" if ckpt.entries[name].dtype == dtype else f":as:{dtype}"


def fingerprint(checkpoint: Checkpoint, name: str) -> str:
    """What identifies tensor ``name``'s bytes in ``checkpoint`` (see the note): its file's
    size, modification and change times and inode and the tensor's place in it, and its dlo
    checksums where it has them (a tool that rewrites the data but copies the header's
    checksums over, or sets the old modification time back, still changes the change
    time)."""
    e = checkpoint.entries[name]
    st = e.file.stat()
    where = (
        f"file:{e.file.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:"
        f"{e.start}:{e.nbytes}"
    )
    if e.checksums is None:
        return where
    piece, sums = e.checksums
    return f"{where}:sha256:{piece}:" + hashlib.sha256("".join(sums).encode()).hexdigest()


def _sources(origin: Origin) -> list[list[str]]:
    return [list(s) for s in origin.sources]


def _entry(layout: BlockLayout, origin: Origin, enc: EncodedLayout) -> dict[str, Any]:
    """A block's entry in the file's record (see the note)."""
    return {
        "layout": build_manifest([layout]).digest,
        "sources": _sources(origin),
        "pieces": [[p.raw_offset, p.raw_nbytes, p.offset, p.nbytes, p.stored] for p in enc.pieces],
    }


def _record(bitstream: str, entries: dict[str, Any]) -> str:
    return json.dumps(
        {"version": VERSION, "bitstream": bitstream, "blocks": entries}, separators=(",", ":")
    )


def write_encoded(
    path: Path,
    bitstream: str,
    blocks: Sequence[tuple[BlockLayout, Origin, EncodedLayout, torch.Tensor]],
) -> Path:
    """Write ``blocks`` (``(layout, origin, piece table, encoded bytes)``) as an encoded
    checkpoint at ``path`` (see the note), with dlo's checksums."""
    write_file(
        path,
        [(layout.name, data) for layout, _, _, data in blocks],
        checksums=True,
        metadata={
            METADATA_KEY: _record(bitstream, {b.name: _entry(b, o, e) for b, o, e, _ in blocks})
        },
        mode=OWN_FILE_MODE,  # read back only if no other user can write it
    )
    return path


class _EncodedFile:
    """One encoded checkpoint, opened for reading (see the note)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # one header read: the record and the entries it describes come from the same file,
        # this user's own, read through the descriptor that was checked (see the note)
        self.checkpoint = Checkpoint(path, verify_checksum=True, own_files=True)
        record = self.checkpoint.metadata[path].get(METADATA_KEY)
        try:
            value = loads_json(record) if isinstance(record, str) else None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: {METADATA_KEY!r} is not JSON: {e}") from None
        if (
            not isinstance(value, dict)
            or value.get("version") != VERSION
            or not isinstance(value.get("bitstream"), str)
            or not isinstance(value.get("blocks"), dict)
        ):
            raise CheckpointError(
                f"{path}: no {METADATA_KEY!r} record of version {VERSION} in its header"
            )
        self.bitstream: str = value["bitstream"]
        self.blocks: dict[str, Any] = value["blocks"]

    def match(self, layout: BlockLayout, origin: Origin, bitstream: str) -> EncodedLayout | str:
        """The piece table serving ``layout``'s block, or why there is none."""
        if self.bitstream != bitstream:
            return f"it holds bitstream {self.bitstream!r}; this process decodes {bitstream!r}"
        rec = self.blocks.get(layout.name)
        if not isinstance(rec, dict):
            return "it has no entry for the block"
        if rec.get("layout") != build_manifest([layout]).digest:
            return "the block's layout is another (chunk_mb, a dtype or a shape changed)"
        if rec.get("sources") != _sources(origin):
            return "the block's tensors in the checkpoint changed since it was written"
        try:
            enc = EncodedLayout(
                layout.name, bitstream, layout.shard_nbytes, tuple(_piece(p) for p in rec["pieces"])
            )
            check_layout(enc, layout.shard_nbytes, layout.slice_nbytes)
        except (KeyError, TypeError, ValueError, OffloadError) as e:
            return f"its piece table is malformed ({e})"
        entry = self.checkpoint.entries.get(layout.name)
        if entry is None or entry.dtype != torch.uint8 or entry.nbytes != enc.nbytes:
            return f"its tensor {layout.name!r} does not hold the {enc.nbytes} encoded bytes"
        return enc

    def read(self, pool: ThreadPoolExecutor, name: str, dst: torch.Tensor) -> None:
        """Block ``name``'s encoded bytes into ``dst``, verified, in ranges of whole checksum
        pieces read on ``pool``'s threads (hashlib releases the GIL: one thread hashes
        about 2 GB/s)."""
        entry = self.checkpoint.entries[name]
        assert entry.checksums is not None  # opened with verify_checksum
        step = entry.checksums[0] * _PIECES_PER_READ
        out = bytes_of(dst)
        reads = [
            pool.submit(self.checkpoint.read_into, name, at, out[at : at + step])
            for at in range(0, len(out), step)
        ]
        try:
            for r in reads:
                r.result()
        except BaseException:
            for r in reads:  # no read keeps writing into the region behind the rollback
                r.cancel()
            wait(reads)
            raise


_PIECES_PER_READ = 4
"""Checksum pieces (4 MiB each) per read of an encoded block: ranges of whole pieces, so
each is hashed once."""


def _piece(p: Any) -> Piece:
    ro, rn, o, n, stored = p
    if not all(type(v) is int for v in (ro, rn, o, n)) or type(stored) is not bool:
        raise TypeError(f"piece {p!r} is not [int, int, int, int, bool]")
    return Piece(ro, rn, o, n, stored)


class Spool(Protocol):
    """Where :meth:`EncodedFiles.copy_into` copies entries (an
    :class:`~dlo.codec.spool.EncodedSpool`)."""

    path: Path

    def add_entry(self, name: str, entry: dict[str, Any], data: torch.Tensor) -> None: ...


class EncodedFiles:
    """The encoded checkpoints one enable reads: each opened once, closed by :meth:`close`."""

    def __init__(self) -> None:
        self._files: dict[Path, _EncodedFile | None] = {}
        self._misses: dict[tuple[Path, str], list[str]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def find(
        self, layout: BlockLayout, origin: Origin | None, bitstream: str
    ) -> tuple[EncodedLayout, Reader] | None:
        """The piece table and the reader of ``layout``'s block from the encoded
        checkpoint beside its tensors (see the note); None: it is encoded at enable."""
        found = self.entry(layout, origin, bitstream)
        if isinstance(found, str):
            return None
        enc, f = found
        if isinstance(enc, str):  # a stale entry: logged once per file and reason, at close
            self._misses.setdefault((f.path, enc), []).append(layout.name)
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(2, cpu_share()))
        return enc, functools.partial(f.read, self._pool, layout.name)

    def entry(
        self, layout: BlockLayout, origin: Origin | None, bitstream: str
    ) -> tuple[EncodedLayout | str, _EncodedFile] | str:
        """The piece table of ``layout``'s block and the encoded checkpoint beside its
        tensors holding it (see the note); where the file's entry does not serve the block,
        why, with the file; where there is no file to ask, why."""
        if layout.group_size != 1:
            return "its stack gathers (encoded checkpoints hold whole blocks)"
        if origin is None or origin.directory is None:
            return "its tensors do not all come from one checkpoint directory"
        path = origin.directory / ENCODED_FILE
        f = self._open(path)
        if f is None:
            return f"there is no readable {path}"
        return f.match(layout, origin, bitstream), f

    def num_entries(self, path: Path) -> int:
        """Blocks the encoded checkpoint at ``path`` holds (0: none readable there)."""
        f = self._open(path)
        return 0 if f is None else len(f.blocks)

    def copy_into(self, spool: Spool, skip: set[str]) -> None:
        """Every entry of the encoded checkpoint at ``spool.path`` not named in ``skip`` into
        ``spool``, its bytes read verified, one block at a time (the file a spool replaces
        keeps what it served)."""
        f = self._open(spool.path)
        if f is None:
            return
        pool = self._pool or ThreadPoolExecutor(max_workers=max(2, cpu_share()))
        self._pool = pool
        for name, entry in f.blocks.items():
            e = f.checkpoint.entries.get(name)
            if name in skip or e is None or e.dtype != torch.uint8:
                continue
            data = torch.empty(e.nbytes, dtype=torch.uint8)
            try:
                f.read(pool, name, data)
            except CheckpointError as err:
                raise CheckpointError(
                    f"{spool.path} is corrupted ({err}): delete it, and the next enable "
                    "writes it anew"
                ) from err
            spool.add_entry(name, entry, data)

    def forget(self, path: Path) -> None:
        """Read ``path`` again at its next use (it was rewritten)."""
        f = self._files.pop(path, None)
        if f is not None:
            f.checkpoint.close()

    def _open(self, path: Path) -> _EncodedFile | None:
        if path not in self._files:
            f = None
            if path.is_file() or path.is_symlink():
                try:
                    f = _EncodedFile(path)
                except CheckpointError as e:
                    logger.warning(
                        "dlo: %s is not read (%s): blocks are encoded at enable", path, e
                    )
            self._files[path] = f
        return self._files[path]

    def close(self) -> None:
        for (path, why), names in self._misses.items():
            logger.warning(
                "dlo: %s does not serve %d block(s) (%s), encoded at enable instead: %s",
                path,
                len(names),
                why,
                ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""),
            )
        self._misses.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for f in self._files.values():
            if f is not None:
                f.checkpoint.close()
        self._files.clear()
