"""Content fingerprints of the blocks a rank gathers or shares, for the startup agreement.

[Note: weight fingerprints]
Ranks that exchange a block's bytes (an AllGather group rebuilds each block from every
rank's 1/G, packed from that rank's own copy; a node's sharers each pack some blocks of one
copy) must hold the same weights, which the manifest digest cannot tell (it covers names,
shapes, dtypes and layout). Each such rank fingerprints every block it exchanges before
the vote and before any block is packed, while it holds every block whole (the originals of
a gathered or node-shared block are released only after the agreement), so every rank
fingerprints the same logical bytes whatever share of them it packs later. A block's
fingerprint is a digest of its tensors', in layout order, each one of:

- *dlo checksums*: the tensor's bytes come from a checkpoint file that dlo's writer gave
  checksums (:mod:`dlo.io.checksums`): a digest of those (the piece size, the stored dtype
  and every piece's SHA-256). Nothing is read (the header held them): free, and it covers
  every byte as written. This holds for a tensor that still aliases the file, or that was
  read from it into memory (cast on load, or copied) and is unchanged since
  (:mod:`dlo.io.sources`); a tensor written since (a LoRA fused in place through
  ``.data``) is sampled from memory instead.
- *a sample*: otherwise, a digest of :data:`SAMPLE_WINDOWS` windows of
  :data:`SAMPLE_WINDOW_NBYTES` bytes evenly spaced over the tensor's bytes, the first
  starting at its first byte and the last ending at its last (a tensor of up to
  ``SAMPLE_WINDOWS * SAMPLE_WINDOW_NBYTES`` bytes is hashed whole), with its byte count.
  Read from memory (an in-memory model; a block's computed non-persistent buffers), or
  with ``pread`` from the file for a tensor served from one (never through the mapping,
  which would count in RSS), several tensors at a time. At most 32 KiB per tensor: about
  1000 tensors of a 28 GB model sample 32 MB.

A sample catches what changes most of a tensor's bytes: another seed, a stale or otherwise
different copy, a fine-tuned or LoRA-fused copy (a low-rank product touches every element).
It misses a change confined to bytes between its windows: a few elements, rows or columns
edited in place, a sparse update, a tensor of more than 32 KiB that differs only outside
the sampled 32 KiB. Checksums have no such gap, but they describe the file as written:
bytes corrupted on disk since are :func:`~dlo.io.checksums.read_verified`'s to catch
(``verify_checksum``). The two kinds never compare equal, so ranks must load a block the
same way: one rank's dlo checkpoint against another's in-memory model or a file without
dlo checksums (a different file) is refused even where the values happen to be equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dlo.host.packer import READERS
from dlo.host.shards import span_bytes
from dlo.io.checkpoint import DTYPE_NAMES, Checkpoint, TensorEntry
from dlo.io.sources import derived_source, mapped_source
from dlo.parallel.agreement import BlockPrint
from dlo.parallel.groups import group_of

SAMPLE_WINDOWS = 8
"""Windows sampled per tensor (the first at its first byte, the last ending at its last)."""

SAMPLE_WINDOW_NBYTES = 4096
"""Bytes per window: a tensor of up to ``SAMPLE_WINDOWS * SAMPLE_WINDOW_NBYTES`` (32 KiB)
bytes is hashed whole."""

_DIGEST_NBYTES = 16


def sample_windows(nbytes: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` byte ranges sampled of a tensor of ``nbytes`` (pure)."""
    if nbytes <= SAMPLE_WINDOWS * SAMPLE_WINDOW_NBYTES:
        return [(0, nbytes)] if nbytes else []
    last = nbytes - SAMPLE_WINDOW_NBYTES
    starts = [last * i // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)]
    return [(s, s + SAMPLE_WINDOW_NBYTES) for s in starts]


def _hasher(kind: bytes) -> Any:
    h = hashlib.blake2b(digest_size=_DIGEST_NBYTES)
    h.update(kind)
    return h


def _checksums_digest(entry: TensorEntry) -> bytes:
    assert entry.checksums is not None
    piece, sums = entry.checksums
    h = _hasher(b"checksums")
    h.update(f"{DTYPE_NAMES.get(entry.dtype, str(entry.dtype))}:{piece}:".encode())
    h.update(",".join(sums).encode())
    return bytes(h.digest())


def _file_sample(ckpt: Checkpoint, entry: TensorEntry) -> bytes:
    h = _hasher(b"sample")
    h.update(entry.nbytes.to_bytes(8, "little"))
    for lo, hi in sample_windows(entry.nbytes):
        buf = bytearray(hi - lo)
        ckpt.read_into(entry.name, lo, memoryview(buf))
        h.update(buf)
    return bytes(h.digest())


def _memory_sample(t: torch.Tensor) -> bytes:
    span = span_bytes(t)
    windows = sample_windows(span.numel())
    h = _hasher(b"sample")
    h.update(span.numel().to_bytes(8, "little"))
    if windows and span.device.type != "cpu":  # one copy to the host (setup, not hot path)
        span = torch.cat([span[lo:hi] for lo, hi in windows]).cpu()
        windows = [(0, span.numel())]
    for lo, hi in windows:
        h.update(span[lo:hi].contiguous().numpy().tobytes())
    return bytes(h.digest())


def tensor_print(t: torch.Tensor) -> tuple[str, bytes, str]:
    """``(kind, digest, file)`` of one tensor: ``"checksums"`` or ``"sample"`` (see [Note:
    weight fingerprints]) and the file its bytes come from ("" for memory of its own)."""
    mapped = mapped_source(t)
    if mapped is not None:
        ckpt, name = mapped
        entry = ckpt.entries[name]
        if entry.checksums is not None:
            return "checksums", _checksums_digest(entry), str(entry.file)
        return "sample", _file_sample(ckpt, entry), str(entry.file)
    derived = derived_source(t)
    if derived is not None:
        ckpt, name, _ = derived
        entry = ckpt.entries[name]
        if entry.checksums is not None:
            return "checksums", _checksums_digest(entry), str(entry.file)
        return "sample", _memory_sample(t), str(entry.file)
    return "sample", _memory_sample(t), ""


def block_print(
    name: str, tensors: Sequence[torch.Tensor], peers: Sequence[int], node: bool
) -> BlockPrint:
    """The fingerprint of block ``name`` (its tensors in layout order) for the agreement,
    with a description of its source for the error."""
    return _block_print(name, [tensor_print(t) for t in tensors], peers, node)


def _block_print(
    name: str, prints: Sequence[tuple[str, bytes, str]], peers: Sequence[int], node: bool
) -> BlockPrint:
    h = _hasher(b"block")
    files: list[str] = []
    for kind, digest, file in prints:
        h.update(kind.encode() + digest)
        if file and file not in files:
            files.append(file)
    in_memory = sum(not file for _, _, file in prints)
    how = {
        frozenset({"checksums"}): "dlo checksums",
        frozenset({"sample"}): "sampled",
    }.get(frozenset(k for k, _, _ in prints), "dlo checksums and sampled")
    source = ", ".join(files[:3]) + (f" (+{len(files) - 3} more files)" if len(files) > 3 else "")
    if not files:
        source = "in-memory model"
    elif in_memory:
        source += f" and {in_memory} in-memory tensor(s)"
    return BlockPrint(name, tuple(peers), node, h.hexdigest(), f"{source} ({how})")


def exchanged_prints(blocks: Iterable[Any], parallel: Any, rank: int) -> tuple[BlockPrint, ...]:
    """The fingerprints of ``blocks`` (objects with ``name``, ``tensors`` and ``stack``, in
    manifest order) whose bytes this rank exchanges: gathered (group size > 1, with the
    ranks of its weight group) or node-shared (with the ranks of its share group, those of
    this rank's host). Tensors are fingerprinted :data:`~dlo.host.packer.READERS` at a time
    (a sample read from a file on a cold disk is a few random reads per tensor)."""
    chosen = []
    for b in blocks:
        s = b.stack
        if s.group_size > 1:
            chosen.append((b, group_of(parallel, s.group_axis, rank), False))
        elif s.share_size > 1:
            chosen.append((b, group_of(parallel, s.share_axis, rank), True))
    if not chosen:
        return ()
    with ThreadPoolExecutor(max_workers=READERS) as pool:
        futures = [[_submit(pool, t) for t in b.tensors] for b, _, _ in chosen]
        return tuple(
            _block_print(b.name, [f.result() for f in fs], peers, node)
            for (b, peers, node), fs in zip(chosen, futures)
        )


def _submit(pool: ThreadPoolExecutor, t: torch.Tensor) -> Future[tuple[str, bytes, str]]:
    """:func:`tensor_print` of ``t`` on ``pool``; a device tensor's on this thread (a
    pool thread's first CUDA call would make a context on device 0)."""
    if t.device.type == "cpu":
        return pool.submit(tensor_print, t)
    done: Future[tuple[str, bytes, str]] = Future()
    done.set_result(tensor_print(t))
    return done
