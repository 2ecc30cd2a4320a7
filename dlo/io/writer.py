"""Writing safetensors checkpoints, one tensor at a time, with content checksums; every file
through a private temporary file renamed into place (see [Note: writing files] in
:mod:`dlo.io.files`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from dlo.io.buffers import bytes_of, flat_uint8
from dlo.io.checkpoint import DTYPE_NAMES
from dlo.io.checksums import METADATA_KEY, digests, metadata_value
from dlo.io.files import FILE_MODE, CheckpointWriteError, Staged, staged
from dlo.platform.progress import progress_bar


def write_file(
    path: Path,
    tensors: list[tuple[str, torch.Tensor]],
    checksums: bool,
    metadata: dict[str, str] | None = None,
    mode: int = FILE_MODE,
) -> None:
    """One safetensors file of ``tensors`` (with ``metadata`` in its header), with ``mode``
    less the umask; a reader sees the old file or the whole new one.

    Raises:
        CheckpointWriteError: it could not be written; ``path`` is as before.
    """
    with staged() as files:
        _write(files, path, tensors, checksums, metadata, mode)


def _write(
    files: Staged,
    path: Path,
    tensors: list[tuple[str, torch.Tensor]],
    checksums: bool,
    metadata: dict[str, str] | None = None,
    mode: int = FILE_MODE,
    advance: Callable[[int], object] | None = None,
) -> None:
    # ``advance(nbytes)``: a tensor hashed, or written (the checkpoint's progress)
    # largest itemsize first: every data offset is aligned to its dtype (as safetensors does)
    tensors = sorted(tensors, key=lambda nt: (-nt[1].element_size(), nt[0]))
    metadata = {"format": "pt", **(metadata or {})}
    if checksums:  # hashed before the header is written (see [Note: checkpoint checksums])
        hashed: dict[str, list[str]] = {}
        for name, t in tensors:
            hashed[name] = digests(bytes_of(flat_uint8(t)))
            if advance is not None:
                advance(t.numel() * t.element_size())
        metadata[METADATA_KEY] = metadata_value(hashed)
    raw = header_bytes([(n, t.dtype, list(t.shape)) for n, t in tensors], metadata)

    def chunks() -> Iterator[bytes | memoryview]:
        yield raw
        for _name, t in tensors:
            if t.numel():
                yield bytes_of(flat_uint8(t))
                if advance is not None:  # the consumer asks for the next once this is written
                    advance(t.numel() * t.element_size())

    files.write(path, chunks(), mode)


def header_bytes(
    tensors: Sequence[tuple[str, torch.dtype, list[int]]],
    metadata: dict[str, str],
    total_nbytes: int | None = None,
) -> bytes:
    """A safetensors file's first bytes, its header's length then its header, for
    ``(name, dtype, shape)`` stored one after the other in that order (the header padded to
    8 bytes, as safetensors pads it; to ``total_nbytes`` in all where given, a multiple of 8 that
    holds it: the space a file kept for it before its tensors)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * _itemsize(dtype)
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    n = total_nbytes
    raw += b" " * (-len(raw) % 8 if n is None else n - 8 - len(raw))
    assert n is None or (n % 8 == 0 and len(raw) == n - 8), "header too long"
    return struct.pack("<Q", len(raw)) + raw


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def save_checkpoint(
    module: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    max_shard_nbytes: int = 4 << 30,
    basename: str = "model",
    checksums: bool = True,
) -> Path:
    """Write ``module``'s state dict as safetensors, one tensor at a time (no second copy).

    Tied tensors are written once, under their first name; non-persistent buffers are not
    written. With more than ``max_shard_nbytes`` of tensors the checkpoint is sharded
    (``{basename}-00001-of-0000N.safetensors`` and ``{basename}.safetensors.index.json``).
    With ``checksums`` every file's header carries a SHA-256 per 4 MiB of every tensor, checked
    by readers that ask for it (``verify_checksum``, see [Note: checkpoint checksums]).

    Every file goes through a private temporary file, and all of them are renamed into
    place at the end (see [Note: writing files] in :mod:`dlo.io.files`): a failed or
    interrupted save leaves ``out_dir``'s files as they were and no temporary file.

    Returns:
        The path to pass to :class:`Checkpoint` (the file, or the index).
    Raises:
        CheckpointWriteError: a file could not be written (a read-only directory, a full
            disk), naming it and the reason.

    Example:
        >>> save_checkpoint(build_pipeline("tiny"), "/tmp/tiny")
        PosixPath('/tmp/tiny/model.safetensors')
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointWriteError(f"cannot create {out}: {e.strerror or e}") from e
    seen: set[int] = set()
    items: list[tuple[str, torch.Tensor]] = []
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        items.append((name, t))
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and used + nbytes > max_shard_nbytes:
            shards.append([])
            used = 0
        shards[-1].append((name, t))
        used += nbytes
    passes = 2 if checksums else 1  # every byte hashed, then written
    bar = progress_bar(
        total=passes * sum(t.numel() * t.element_size() for _, t in items),
        desc="dlo: checkpoint checksums + write" if checksums else "dlo: checkpoint write",
        unit="B",
        unit_scale=True,
    )
    with staged() as files, contextlib.closing(bar):
        if len(shards) == 1:
            path = out / f"{basename}.safetensors"
            _write(files, path, shards[0], checksums, advance=bar.update)
            return path
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = f"{basename}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write(files, out / fname, shard, checksums, advance=bar.update)
            weight_map.update((n, fname) for n, _ in shard)
        index = out / f"{basename}.safetensors.index.json"
        total = sum(t.numel() * t.element_size() for _, t in items)
        raw = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        files.write(index, [raw.encode()])
        return index
