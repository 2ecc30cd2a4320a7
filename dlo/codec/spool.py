"""Writing an encoded checkpoint one block at a time, where it is encoded (a model larger
than the host's memory): see [Note: encoded blocks on disk] in :mod:`dlo.codec.on_disk`."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from dlo.codec.format import EncodedLayout
from dlo.codec.offline import METADATA_KEY, Origin, _entry, _record
from dlo.io.buffers import bytes_of
from dlo.io.checksums import METADATA_KEY as CHECKSUMS_KEY
from dlo.io.checksums import PIECE_NBYTES, digests, metadata_value
from dlo.io.files import (
    OWN_FILE_MODE,
    CheckpointWriteError,
    NotLinkable,
    anonymous_file,
    link_into_place,
    staged,
    sync_and_drop,
)
from dlo.io.writer import header_bytes
from dlo.plan.layout import BlockLayout

logger = logging.getLogger(__name__)


class EncodedSpool:
    """An encoded checkpoint written one block at a time (a model larger than the host's
    memory), holding one block at a time. Where the folder's filesystem has anonymous files
    (``O_TMPFILE``), the blocks' encoded bytes go straight into the new file as they come,
    after ``reserve_nbytes`` kept for the header (:func:`spool_reserve`), and :meth:`finish`
    writes the header into that space, syncs the file (:func:`sync_and_drop`) and links it
    into place: the disk holds the new file once. Elsewhere, or where the header outgrew its
    space, they go to an anonymous temporary file, and :meth:`finish` writes the header and
    copies them after it through a private file synced and renamed into place (see [Note:
    writing files] in :mod:`dlo.io.files`): the disk holds them twice for a while. Nothing
    is left behind however the process ends."""

    def __init__(self, path: Path, reserve_nbytes: int = 0) -> None:
        self.path = path
        fd = anonymous_file(path.parent, OWN_FILE_MODE) if reserve_nbytes > 0 else None
        self._reserve = -(-reserve_nbytes // 8) * 8 if fd is not None else 0
        # never named until finish: nothing is left behind, however the process ends
        self._data = (
            open(fd, "w+b")  # noqa: SIM115 (closed by finish/close)
            if fd is not None
            else tempfile.TemporaryFile(dir=path.parent)  # noqa: SIM115
        )
        self._data.seek(self._reserve)
        self._names: list[tuple[str, int]] = []
        self._sums: dict[str, list[str]] = {}
        self._entries: dict[str, Any] = {}

    def add(
        self, layout: BlockLayout, origin: Origin, enc: EncodedLayout, data: torch.Tensor
    ) -> None:
        """Block ``layout``'s encoded bytes ``data`` (its piece table ``enc``)."""
        assert data.numel() == enc.nbytes
        self.add_entry(layout.name, _entry(layout, origin, enc), data)

    def add_entry(self, name: str, entry: dict[str, Any], data: torch.Tensor) -> None:
        """Block ``name``'s entry of the record and its encoded bytes ``data`` (copied from
        another encoded checkpoint: :meth:`EncodedFiles.copy_into`)."""
        buf = bytes_of(data)
        assert name not in self._entries
        self._sums[name] = digests(buf)
        self._data.write(buf)
        self._names.append((name, len(buf)))
        self._entries[name] = entry

    def finish(self, bitstream: str) -> Path:
        """Write the file (see the class doc); the spool is closed."""
        metadata = {
            "format": "pt",
            METADATA_KEY: _record(bitstream, self._entries),
            CHECKSUMS_KEY: metadata_value(self._sums),
        }
        tensors = [(n, torch.uint8, [k]) for n, k in self._names]
        head = header_bytes(tensors, metadata)
        try:
            if self._reserve and len(head) <= self._reserve:
                self._data.seek(0)
                self._data.write(header_bytes(tensors, metadata, self._reserve))
                self._data.flush()
                sync_and_drop(self._data.fileno(), self.path)
                try:
                    link_into_place(self._data.fileno(), self.path)
                    return self.path
                except NotLinkable as e:  # the folder names no anonymous file
                    why = f"it cannot be linked into place ({e.strerror or e})"
            elif self._reserve:
                why = f"its header outgrew the {self._reserve} bytes kept for it"
            if self._reserve:
                logger.warning("dlo: %s is copied once more: %s", self.path, why)

            def chunks() -> Iterator[bytes]:
                yield head
                self._data.seek(self._reserve)
                while chunk := self._data.read(_COPY_NBYTES):
                    yield chunk

            with staged() as files:
                files.write(self.path, chunks(), OWN_FILE_MODE)
        except OSError as e:
            raise CheckpointWriteError(f"cannot write {self.path}: {e.strerror or e}") from e
        finally:
            self.close()
        return self.path

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a buffered tail a full disk refused: discarded
            self._data.close()


def spool_reserve(layouts: Sequence[BlockLayout], num_old: int) -> int:
    """Bytes an :class:`EncodedSpool` keeps for its header: ``layouts``' entries and
    ``num_old`` entries copied from the file it replaces, each bounded generously (names,
    fingerprints, piece tables, checksums)."""
    per_block = [
        16384 + 96 * -(-b.shard_nbytes // PIECE_NBYTES) + 256 * (len(b.tensors) + b.num_chunks)
        for b in layouts
    ]
    total = 65536 + sum(per_block) + 65536 * num_old
    return total if total <= MAX_RESERVE else 0  # beyond: written through the copy path


_COPY_NBYTES = 8 << 20

MAX_RESERVE = 100_000_000
"""The largest header the safetensors library reads."""
