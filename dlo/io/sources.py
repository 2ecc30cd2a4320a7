"""Which checkpoint tensor a model tensor's bytes come from, as :func:`dlo.io.materialize.materialize`
gave them: the tensors that alias the checkpoint mapping (packed from the file, served by the
mapped backing) and the block tensors read from it into private memory (cast on load, or
copied), which an encoded checkpoint can still describe (see [Note: encoded checkpoint] in
:mod:`dlo.codec.offline`). Keyed by ``id`` (tensors compare elementwise), weakly.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from dlo.io.checkpoint import Checkpoint
from dlo.platform.env import copied_on_write


@dataclass(frozen=True)
class _Mapping:
    """A tensor whose bytes alias a checkpoint mapping, as it was when mapped."""

    ref: weakref.ref[torch.Tensor]
    checkpoint: Checkpoint
    name: str
    data_ptr: int
    version: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    file_backed: bool
    """The tensor is the file's mapping (False: unaligned data, a placeholder nothing reads,
    see :func:`_file_served`)."""

    def still_aliases(self, t: torch.Tensor) -> bool:
        """Whether ``t`` still holds the file's bytes: the same object on the same memory,
        of the same dtype and shape, not written in place since (a disable gives a block
        private memory again, ``.to()`` new memory, ``load_state_dict`` an in-place copy)."""
        return (
            self.ref() is t
            and t.data_ptr() == self.data_ptr
            and t._version == self.version
            and t.dtype == self.dtype
            and tuple(t.shape) == self.shape
            # a write through ``t.data`` (PEFT's fuse_lora) leaves the version as it was:
            # the private mapping's pages it wrote are copies now, and the page table says so
            # (None: the page table cannot be read; then pack from memory, which is right
            # either way)
            and not (
                self.file_backed
                and copied_on_write(t.data_ptr(), t.numel() * t.element_size()) is not False
            )
        )


# id(tensor) -> its _Mapping: tensors whose bytes alias a checkpoint mapping, so that the
# backend packs them from the file (pack_block). Keyed by id because tensors compare
# elementwise.
_MAPPED: dict[int, _Mapping] = {}

# id(tensor) -> its _Mapping (file_backed False): block tensors read from a checkpoint into
# private memory (cast to another dtype, or a copy requested): not packable from the file,
# but an encoded checkpoint can still describe them (see [Note: encoded checkpoint])
_DERIVED: dict[int, _Mapping] = {}


def _register(
    table: dict[int, _Mapping], t: torch.Tensor, checkpoint: Checkpoint, name: str, backed: bool
) -> None:
    ref = weakref.ref(t, functools.partial(_forget, table, id(t)))
    shape = tuple(t.shape)
    table[id(t)] = _Mapping(ref, checkpoint, name, t.data_ptr(), t._version, t.dtype, shape, backed)


def _forget(table: dict[int, _Mapping], key: int, _ref: object) -> None:
    table.pop(key, None)


def _current(table: dict[int, _Mapping], t: torch.Tensor) -> _Mapping | None:
    item = table.get(id(t))
    return item if item is not None and item.still_aliases(t) else None


def register_mapping(t: torch.Tensor, checkpoint: Checkpoint, name: str) -> None:
    _register(_MAPPED, t, checkpoint, name, checkpoint.is_aligned(name))


def unregister_mapping(t: torch.Tensor) -> None:
    _MAPPED.pop(id(t), None)


def register_derived(t: torch.Tensor, checkpoint: Checkpoint, name: str) -> None:
    _register(_DERIVED, t, checkpoint, name, False)


def forget_derived(t: torch.Tensor) -> None:
    _DERIVED.pop(id(t), None)


def derived_source(t: torch.Tensor) -> tuple[Checkpoint, str, torch.dtype] | None:
    """``(checkpoint, name, dtype)`` when ``t`` still holds what :func:`materialize` read
    from the checkpoint's tensor ``name`` into private memory, as ``dtype`` (unchanged
    since: same object, memory, version, dtype and shape), else None."""
    item = _current(_DERIVED, t)
    return None if item is None else (item.checkpoint, item.name, item.dtype)


def mapped_source(t: torch.Tensor) -> tuple[Checkpoint, str] | None:
    """``(checkpoint, name)`` when ``t`` still aliases the checkpoint mapping
    :func:`materialize` gave it (its bytes can be read from the file), else None."""
    item = _current(_MAPPED, t)
    return None if item is None else (item.checkpoint, item.name)
