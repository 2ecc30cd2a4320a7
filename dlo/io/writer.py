"""Writing safetensors checkpoints, one tensor at a time, with content checksums."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from dlo.io.checkpoint import DTYPE_NAMES, bytes_of, flat_uint8
from dlo.io.checksums import METADATA_KEY, digests, metadata_value


def write_file(
    path: Path,
    tensors: list[tuple[str, torch.Tensor]],
    checksums: bool,
    metadata: dict[str, str] | None = None,
) -> None:
    """One safetensors file of ``tensors`` (with ``metadata`` in its header), written to a
    temporary name and renamed, so a reader sees the old file or the whole new one."""
    # largest itemsize first: every data offset is aligned to its dtype (as safetensors does)
    tensors = sorted(tensors, key=lambda nt: (-nt[1].element_size(), nt[0]))
    metadata = {"format": "pt", **(metadata or {})}
    if checksums:  # hashed before the header is written (see [Note: checkpoint checksums])
        metadata[METADATA_KEY] = metadata_value(
            {name: digests(bytes_of(flat_uint8(t))) for name, t in tensors}
        )
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _name, t in tensors:
            if t.numel():
                f.write(bytes_of(flat_uint8(t)))
    os.replace(tmp, path)


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

    Returns:
        The path to pass to :class:`Checkpoint` (the file, or the index).

    Example:
        >>> save_checkpoint(build_pipeline("tiny"), "/tmp/tiny")
        PosixPath('/tmp/tiny/model.safetensors')
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
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
    if len(shards) == 1:
        path = out / f"{basename}.safetensors"
        write_file(path, shards[0], checksums)
        return path
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"{basename}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(out / fname, shard, checksums)
        weight_map.update((n, fname) for n, _ in shard)
    index = out / f"{basename}.safetensors.index.json"
    total = sum(t.numel() * t.element_size() for _, t in items)
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index
