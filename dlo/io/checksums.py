"""Content checksums of a safetensors file's tensors: written by dlo's writer, checked on read.

[Note: checkpoint checksums]
Headers are checked before anything is read, but a flipped bit in a tensor's data would be
used silently. :func:`dlo.io.writer.save_checkpoint` therefore writes, in the header's
``__metadata__`` under :data:`METADATA_KEY`, a JSON string
``{"algorithm": "sha256", "piece_nbytes": P, "tensors": {name: [hex digest, ...]}}``: one
SHA-256 per piece of ``P`` bytes of every tensor's data (the last piece shorter), so a rank
that reads only its slices of a tensor (AllGather) checks only the pieces it reads, not the
whole tensor. With ``verify_checksum=True`` (:class:`~dlo.io.checkpoint.Checkpoint`,
``dlo.load_pipeline``, ``dlo run --verify-checksum``) every ``pread`` of tensor data goes
through :func:`read_verified`: each piece it touches is hashed once (a piece the read covers
only in part is read whole into a scratch buffer first, and the part copied from there, so
what the caller gets is what was checked), and a mismatch is a
:class:`~dlo.io.checkpoint.CheckpointError` naming the file, the tensor and the byte range:
the enable fails and rolls back instead of serving corrupted weights. A file without
checksums (written by another tool) is refused under ``verify_checksum=True``, naming it.
SHA-256 runs at about 2 GB/s per core (hashlib releases the GIL, so the fill's reading
threads hash in parallel); the check is opt-in.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dlo.io.header_checks import CheckpointError, _is_int, loads_json
from dlo.platform.env import cpu_share

METADATA_KEY = "dlo.checksums"
"""The ``__metadata__`` key of the checksums (its value is a JSON string, as safetensors
metadata values must be strings)."""

ALGORITHM = "sha256"

PIECE_NBYTES = 4 << 20
"""Bytes of tensor data per digest."""


def _digest(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def digests(data: memoryview, piece_nbytes: int | None = None) -> list[str]:
    """The digests of ``data``'s pieces of ``piece_nbytes`` (default :data:`PIECE_NBYTES`),
    hashed on several threads for large data."""
    piece_nbytes = piece_nbytes or PIECE_NBYTES
    pieces = [data[o : o + piece_nbytes] for o in range(0, len(data), piece_nbytes)]
    if len(pieces) < 4:
        return [_digest(p) for p in pieces]
    with ThreadPoolExecutor(max_workers=min(len(pieces), max(2, cpu_share()))) as pool:
        return list(pool.map(_digest, pieces))


def metadata_value(by_name: dict[str, list[str]], piece_nbytes: int | None = None) -> str:
    """The ``__metadata__`` value for ``{tensor name: digests}`` (of :func:`digests` with the
    same ``piece_nbytes``)."""
    return json.dumps(
        {"algorithm": ALGORITHM, "piece_nbytes": piece_nbytes or PIECE_NBYTES, "tensors": by_name},
        separators=(",", ":"),
    )


def parse(path: Path, metadata: object, nbytes: dict[str, int]) -> dict[str, tuple[int, list[str]]]:
    """The checksums a file's ``__metadata__`` holds: ``{tensor: (piece_nbytes, digests)}``
    (empty when it has none). ``nbytes``: the header's tensors and their data sizes.

    Raises:
        CheckpointError: the checksums are malformed or do not fit the tensors, naming the
            file (a file whose checksums cannot be read is never served unchecked).
    """
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        return {}
    try:
        value = loads_json(metadata[METADATA_KEY])
        algorithm, piece, tensors = value["algorithm"], value["piece_nbytes"], value["tensors"]
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed {METADATA_KEY!r} metadata: {e}") from None
    if algorithm != ALGORITHM or not _is_int(piece) or piece <= 0 or not isinstance(tensors, dict):
        raise CheckpointError(
            f"{path}: {METADATA_KEY!r}: algorithm {algorithm!r} (dlo writes {ALGORITHM!r}) "
            f"with piece_nbytes {piece!r}: not checksums dlo can check"
        )
    out: dict[str, tuple[int, list[str]]] = {}
    for name, n in nbytes.items():
        sums = tensors.get(name)
        want = -(-n // piece)
        if (
            not isinstance(sums, list)
            or len(sums) != want
            or not all(isinstance(d, str) and len(d) == 64 for d in sums)
        ):
            raise CheckpointError(
                f"{path}: {METADATA_KEY!r} has no valid checksums for tensor {name!r} "
                f"({want} digests of {piece}-byte pieces expected)"
            )
        out[name] = (piece, sums)
    extra = sorted(set(tensors) - set(nbytes))
    if extra:
        raise CheckpointError(
            f"{path}: {METADATA_KEY!r} lists tensors the file does not hold: {', '.join(extra[:8])}"
        )
    return out


class Verified:
    """The pieces already checked, per tensor (a piece is hashed once per checkpoint)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[tuple[str, int]] = set()

    def __contains__(self, key: tuple[str, int]) -> bool:
        with self._lock:
            return key in self._done

    def add(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._done.add(key)


def read_verified(
    pread: Callable[[int, memoryview], None],
    where: str,
    name: str,
    nbytes: int,
    checksums: tuple[int, Sequence[str]],
    offset: int,
    out: memoryview,
    verified: Verified,
) -> None:
    """Fill ``out`` with bytes ``offset..offset + len(out)`` of the ``nbytes`` of a tensor's
    data (``pread(offset, buffer)`` reads them), checking every piece touched that was not
    checked before (see [Note: checkpoint checksums]).

    Raises:
        CheckpointError: a piece's bytes do not match its digest, naming ``where`` (the
            file), the tensor and the piece's byte range.
    """
    piece, sums = checksums
    lo, hi = offset, offset + len(out)
    for k in range(lo // piece, (hi - 1) // piece + 1 if hi > lo else lo // piece):
        plo = k * piece
        end = min(plo + piece, nbytes)
        a, b = max(lo, plo), min(hi, end)
        key = (name, k)
        if key in verified:
            pread(a, out[a - lo : b - lo])
            continue
        whole = a == plo and b == end  # the read covers the piece: check it in place
        buf = out[a - lo : b - lo] if whole else memoryview(bytearray(end - plo))
        pread(plo if not whole else a, buf)
        if _digest(buf) != sums[k]:
            raise CheckpointError(
                f"{where}: tensor {name!r}: bytes {plo}..{end} do not match the checksum "
                "written with them (the data is corrupted); re-download or rewrite the file"
            )
        if not whole:
            out[a - lo : b - lo] = buf[a - plo : b - plo]
        verified.add(key)
