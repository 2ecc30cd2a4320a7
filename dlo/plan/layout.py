"""Byte layouts of blocks, their chunk/shard decomposition, and the manifest digest. Pure.

[Note: block layout]
Every tensor a block owns (parameters and buffers, persistent or not) gets a byte range in
one flat, byte-addressed buffer: tensors are placed in a deterministic order (parameters
then buffers, each in ``named_*`` order), every start aligned to :data:`ALIGN` bytes. A
tensor keeps its dtype and its strides: its range covers its *extent* (the elements from its
first to its last addressed element), so a transposed weight or a channels_last kernel is
rebuilt as a strided view of the same shape and strides. Overlapping tensors (stride 0 with
size > 1, as made by ``expand``) cannot be stored without losing aliasing and are refused.

[Note: chunks and shards]
The padded block is cut into ``num_chunks`` chunks of equal size ``chunk_nbytes``, a
multiple of ``group_size * ALIGN``; each chunk is cut into ``group_size`` equal slices and
rank r owns slice r of every chunk ("chunk-major"). Rank r's host shard is the
concatenation of its slices, so every AllGather input (one slice) has the same size on every
rank, and the gather of chunk k writes straight into the chunk's range of the device slot,
with rank r's input being its own range of that slot. ``group_size == 1`` is the degenerate
case: one slice per chunk, the shard is the whole padded block. The layout does not change
with the group size; only the padding does.

All sizes and offsets are Python ints (exact; the manifest is checked to fit int64), so
layouts past 2**31 elements are computed exactly.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dlo.plan.subclasses import Wrapped, flatten, is_wrapper

ALIGN = 256
"""Byte alignment of every tensor inside a block and of every slice."""


INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor of a block lives in the block's flat buffer."""

    name: str
    """Dotted name inside the block (``"attn.qkv.weight"``)."""
    kind: str
    """``"param"`` or ``"buffer"``."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    """Byte offset of the tensor's first element in the block."""
    extent_numel: int
    """Elements covered from the first to the last addressed element."""

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def span_nbytes(self) -> int:
        return self.extent_numel * self.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.span_nbytes


@dataclass(frozen=True)
class BlockLayout:
    """One block's flat layout and its chunk/slice decomposition for a group size."""

    name: str
    tensors: tuple[TensorSpec, ...]
    nbytes: int
    """Payload bytes (end of the last tensor), before padding."""
    group_size: int
    chunk_nbytes: int
    """Bytes of one chunk; a multiple of ``group_size * ALIGN`` (0 for an empty block)."""
    num_chunks: int

    @property
    def padded_nbytes(self) -> int:
        return self.chunk_nbytes * self.num_chunks

    @property
    def slice_nbytes(self) -> int:
        """Bytes of one rank's slice of one chunk (the size of every AllGather input)."""
        return self.chunk_nbytes // self.group_size

    @property
    def shard_nbytes(self) -> int:
        """Bytes of one rank's host shard of this block."""
        return self.slice_nbytes * self.num_chunks

    def chunk_range(self, k: int) -> tuple[int, int]:
        start = k * self.chunk_nbytes
        return start, start + self.chunk_nbytes

    def slice_range(self, k: int, rank: int) -> tuple[int, int]:
        """Byte range, in the block, of ``rank``'s slice of chunk ``k``."""
        start = k * self.chunk_nbytes + rank * self.slice_nbytes
        return start, start + self.slice_nbytes

    def shard_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """``(block_start, block_end, shard_offset)`` of each of ``rank``'s slices."""
        return [(*self.slice_range(k, rank), k * self.slice_nbytes) for k in range(self.num_chunks)]


@dataclass(frozen=True)
class Manifest:
    """The ordered layouts of every block dlo manages, and their digest."""

    blocks: tuple[BlockLayout, ...]
    digest: str
    """sha256 of a canonical description of the blocks: equal on every rank for the same
    model and settings, different as soon as any name, shape, stride, dtype, offset, order,
    group size or chunking differs."""

    @property
    def max_padded_nbytes(self) -> int:
        return max((b.padded_nbytes for b in self.blocks), default=0)

    @property
    def total_shard_nbytes(self) -> int:
        return sum(b.shard_nbytes for b in self.blocks)

    @property
    def total_nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)


# ----------------------------------------------------------------------------- pure math
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def is_overlapping(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True when two different indices address the same element."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz > 1)
    reach = 1  # elements spanned by the dims seen so far (smaller strides)
    for st, sz in dims:
        if st < reach:
            return True
        reach = st * (sz - 1) + reach
    return False


def extent_numel(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from the first to the last addressed element (0 for an empty tensor)."""
    if any(sz == 0 for sz in shape):
        return 0
    return 1 + sum((sz - 1) * st for sz, st in zip(shape, stride))


def plan_block_layout(
    name: str,
    tensors: Iterable[tuple[str, str, Sequence[int], Sequence[int], torch.dtype]],
    *,
    group_size: int,
    chunk_nbytes: int,
) -> BlockLayout:
    """Lay out one block (see [Note: block layout] and [Note: chunks and shards]).

    Args:
        name: the block's dotted path (part of the digest).
        tensors: ``(name, kind, shape, stride, dtype)`` per tensor, in a deterministic order.
        group_size: ranks sharing the block (1 = rank-local).
        chunk_nbytes: target chunk size in bytes; chunks are equal-sized and at most about
            this large (rounded up to ``group_size * ALIGN``).
    Raises:
        ValueError: an overlapping tensor, a negative stride, or a bad group/chunk size.
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    if chunk_nbytes < 1:
        raise ValueError(f"chunk_nbytes={chunk_nbytes} must be >= 1")
    specs: list[TensorSpec] = []
    offset = 0
    for tname, kind, shape, stride, dtype in tensors:
        shape_t, stride_t = tuple(int(s) for s in shape), tuple(int(s) for s in stride)
        if any(s < 0 for s in stride_t):
            raise ValueError(f"{name}.{tname}: negative stride {stride_t}")
        if is_overlapping(shape_t, stride_t):
            raise ValueError(
                f"{name}.{tname}: overlapping tensor (shape {shape_t}, stride {stride_t}, e.g. "
                "from expand()); materialize it with .contiguous() before offloading"
            )
        offset = round_up(offset, ALIGN)
        spec = TensorSpec(
            tname, kind, shape_t, stride_t, dtype, offset, extent_numel(shape_t, stride_t)
        )
        specs.append(spec)
        offset = spec.end
    nbytes = offset
    chunk, num_chunks = chunking(nbytes, group_size=group_size, chunk_nbytes=chunk_nbytes)
    return BlockLayout(name, tuple(specs), nbytes, group_size, chunk, num_chunks)


def chunking(nbytes: int, *, group_size: int, chunk_nbytes: int) -> tuple[int, int]:
    """``(chunk_nbytes, num_chunks)`` of a block of ``nbytes`` payload bytes (see [Note:
    chunks and shards]): equal chunks of at most about ``chunk_nbytes``, each a multiple of
    ``group_size * ALIGN``; ``(0, 0)`` for an empty block."""
    if nbytes == 0:
        return 0, 0
    num_chunks = max(1, -(-nbytes // chunk_nbytes))
    return round_up(-(-nbytes // num_chunks), group_size * ALIGN), num_chunks


def module_tensor_entries(
    module: nn.Module,
) -> list[tuple[str, str, torch.Tensor]]:
    """``(name, kind, tensor)`` of every parameter and buffer a block owns, in layout order.

    Shared parameters appear once (under their first name); ``None`` buffers are skipped. A
    traceable wrapper subclass (a torchao quantized weight) appears as its plain inner
    tensors, ``<name>.<attribute>`` (see [Note: tensor subclasses]). Reads only metadata, so
    it works on the meta device.

    Raises:
        TypeError: a wrapper whose inner tensors dlo cannot read (naming it).
    """
    out: list[tuple[str, str, torch.Tensor]] = []
    for name, kind, t in _owned_tensors(module):
        if is_wrapper(t):
            out.extend((leaf, kind, x) for leaf, x in flatten(name, t).leaves())
        else:
            out.append((name, kind, t))
    return out


def module_wrappers(module: nn.Module) -> list[Wrapped]:
    """The wrapper-subclass tensors a block owns (see [Note: tensor subclasses]), each once."""
    return [flatten(name, t) for name, _, t in _owned_tensors(module) if is_wrapper(t)]


def _owned_tensors(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(name, kind, tensor)`` of a block's parameters, then its buffers: each tensor once
    (under its first name), ``None`` buffers skipped."""
    seen: set[int] = set()
    named = itertools.chain(
        ((n, "param", p) for n, p in module.named_parameters()),
        ((n, "buffer", b) for n, b in module.named_buffers() if b is not None),
    )
    for name, kind, t in named:
        if id(t) not in seen:
            seen.add(id(t))
            yield name, kind, t


def describe_entries(
    entries: Sequence[tuple[str, str, torch.Tensor]],
) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """The layout input of :func:`module_tensor_entries` (metadata only)."""
    return [(n, kind, tuple(t.shape), tuple(t.stride()), t.dtype) for n, kind, t in entries]


def describe_module(
    module: nn.Module,
) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """The layout input of a block module (metadata only)."""
    return describe_entries(module_tensor_entries(module))


def build_manifest(blocks: Sequence[BlockLayout]) -> Manifest:
    """Digest the ordered layouts (see :attr:`Manifest.digest`).

    Raises:
        ValueError: a size or offset past int64.
    """
    h = hashlib.sha256()
    for b in blocks:
        if b.padded_nbytes > INT64_MAX or b.nbytes > INT64_MAX:
            raise ValueError(f"block {b.name}: {b.padded_nbytes} bytes do not fit int64")
        h.update(f"B|{b.name}|{b.nbytes}|{b.group_size}|{b.chunk_nbytes}|{b.num_chunks}\n".encode())
        for t in b.tensors:
            h.update(
                f"T|{t.name}|{t.kind}|{t.shape}|{t.stride}|{t.dtype}|{t.offset}|"
                f"{t.extent_numel}\n".encode()
            )
    return Manifest(tuple(blocks), h.hexdigest())
