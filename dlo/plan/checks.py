"""Checks on the modules a plan selected, before anything is mutated.

Everything here reads module structure and tensor metadata only; it raises a clear error
for every case of FAULTS.md section A that dlo refuses: meta tensors (listing every name),
tensor subclasses other than traceable wrappers (DTensor and friends), inference tensors, parameters shared
between two blocks or between a block and a non-block module (by object, or distinct tensors
sharing one storage), and modules managed by another offloader.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dlo.errors import OffloadError
from dlo.hooks.foreign import find_foreign_offloaders
from dlo.plan.declarations import get_by_path
from dlo.plan.layout import module_tensor_entries, module_wrappers
from dlo.plan.subclasses import Wrapped, leaf_tensors
from dlo.plan.topology import ResolvedOffloadPlan

_PLAIN = (torch.Tensor, nn.Parameter)


def block_entries(
    name: str, module: nn.Module, *, rank: int = 0
) -> list[tuple[str, str, torch.Tensor]]:
    """:func:`~dlo.plan.layout.module_tensor_entries` of block ``name``.

    Raises:
        OffloadError: a tensor subclass whose inner tensors dlo cannot read (naming it).
    """
    with _naming_block(name, rank):
        return module_tensor_entries(module)


def _wrappers(name: str, module: nn.Module, *, rank: int) -> list[Wrapped]:
    with _naming_block(name, rank):
        return module_wrappers(module)


@contextlib.contextmanager
def _naming_block(name: str, rank: int) -> Iterator[None]:
    """A wrapper whose inner tensors cannot be read (``TypeError``) as block ``name``'s
    :class:`OffloadError`."""
    try:
        yield
    except TypeError as e:
        raise OffloadError(str(e), rank=rank, block=name) from e


def check_blocks(
    blocks: Sequence[tuple[str, nn.Module]],
    components: Sequence[tuple[str, nn.Module]],
    *,
    rank: int = 0,
    wrappers: bool = True,
) -> None:
    """Refuse blocks dlo cannot stream; ``components`` are the modules that own them.
    ``wrappers=False`` refuses wrapper subclasses too (see [Note: tensor subclasses]).

    Raises:
        OffloadError: naming every offending tensor or module.
    """
    foreign = [
        (f"{name}.{sub}" if sub else name, mech)
        for name, mod in blocks
        for sub, mech in find_foreign_offloaders(mod)
    ]
    if foreign:
        listed = ", ".join(f"{p} ({m})" for p, m in foreign)
        raise OffloadError(
            f"blocks already managed by another mechanism: {listed}; remove it first "
            "(dlo owns streamed blocks alone)",
            rank=rank,
        )
    if not wrappers:
        found = [
            f"{b}.{w.name} ({type(w.tensor).__name__})"
            for b, m in blocks
            for w in _wrappers(b, m, rank=rank)
        ]
        if found:
            raise OffloadError(
                "model-level swap moves plain tensors only; these are tensor subclasses: "
                + ", ".join(found)
                + " (mode='layer' streams them as stored)",
                rank=rank,
            )
    meta: list[str] = []
    subclass: list[str] = []
    inference: list[str] = []
    owner: dict[int, str] = {}
    storage_owner: dict[tuple[torch.device, int], str] = {}
    for bname, mod in blocks:
        for w in _wrappers(bname, mod, rank=rank):  # the block's, like its inner tensors
            owner.setdefault(id(w.tensor), f"{bname}.{w.name}")
        for tname, _kind, t in block_entries(bname, mod, rank=rank):
            full = f"{bname}.{tname}"
            if t.is_meta:
                meta.append(full)
            plain = type(t) in _PLAIN and type(t.data) is torch.Tensor
            if not plain:
                subclass.append(f"{full} ({type(t).__name__})")
            elif t.is_inference():
                inference.append(full)
            other = owner.get(id(t))
            if other is not None:
                raise OffloadError(
                    f"tensor shared between blocks: {other} and {full}; dlo streams each "
                    "block's tensors on their own (untie them or keep these blocks resident)",
                    rank=rank,
                )
            owner[id(t)] = full
            key = _storage_key(t) if plain else None
            if key is not None:
                other = storage_owner.setdefault(key, full)
                if other != full:
                    raise OffloadError(
                        f"{other} and {full} are distinct tensors sharing one storage (views "
                        "of one tensor, e.g. of a fused qkv): dlo keeps a copy of each tensor, "
                        "so they would no longer alias after disable; make them separate "
                        "tensors (.clone()) or keep this module out of the streamed blocks",
                        rank=rank,
                    )
    if meta:
        raise OffloadError(
            f"{len(meta)} tensors are on the meta device (model not materialized): "
            + ", ".join(meta),
            rank=rank,
        )
    if subclass:
        raise OffloadError(
            "these tensor subclasses cannot be streamed (dlo streams plain tensors and "
            "traceable wrapper subclasses, such as torchao's, through their inner tensors; "
            "a DTensor belongs to FSDP2 or tensor parallelism): " + ", ".join(subclass),
            rank=rank,
        )
    if inference:
        raise OffloadError(
            f"{len(inference)} tensors are inference tensors (created under "
            "torch.inference_mode()), which dlo cannot rebind to its device slots: "
            + ", ".join(inference)
            + "; build or load the model outside inference_mode",
            rank=rank,
        )
    # every module reachable from the components, by identity (an alias path to a block is
    # still the block), that is not a block or inside one: none may hold a block's tensor
    inside = {id(m) for _, b in blocks for m in b.modules()}
    for cname, comp in components:
        for mname, mod in comp.named_modules(remove_duplicate=False):
            if id(mod) in inside:
                continue
            own = itertools.chain(mod._parameters.items(), mod._buffers.items())
            for tname, t in own:
                if t is None:
                    continue
                where = ".".join(p for p in (cname, mname, tname) if p)
                try:  # a wrapper: its inner tensors too (see [Note: tensor subclasses])
                    leaves = leaf_tensors(t)
                except TypeError as e:
                    raise OffloadError(f"non-block {where}: {e}", rank=rank) from e
                other = next((o for x in (t, *leaves) if (o := owner.get(id(x)))), None)
                if other is not None:
                    raise OffloadError(
                        f"tensor shared between block tensor {other} and non-block {where}; "
                        "dlo cannot keep one copy in both places (untie them or keep the "
                        "block resident)",
                        rank=rank,
                    )
                keys = [_storage_key(x) for x in leaves if type(x) in _PLAIN]
                other = next((o for k in keys if k and (o := storage_owner.get(k))), None)
                if other is not None:
                    raise OffloadError(
                        f"block tensor {other} and non-block {where} share one storage (one "
                        "is a view of the other): dlo keeps a copy of the block tensor, so "
                        "they would no longer alias; make them separate tensors (.clone()) or "
                        "keep the block resident",
                        rank=rank,
                    )


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int] | None:
    """Storage identity of ``t``; None where there is nothing to alias (meta, 0 bytes)."""
    if t.is_meta:
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        return None
    return (t.device, storage.data_ptr())


def named_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` under every name it has (tied ones too)."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from ((n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None)


def non_block_tensors(
    component: nn.Module, block_tensor_ids: set[int]
) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers of ``component`` that belong to no selected block."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, t in named_tensors(component):
        if id(t) in seen or any(id(x) in block_tensor_ids for x in leaf_tensors(t)):
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def non_block_state(
    pipeline: Any, plan: ResolvedOffloadPlan, block_tensor_ids: set[int]
) -> list[tuple[str, torch.Tensor]]:
    """The tensors the layerwise backend places on the device: those of every component
    (streamed or not: the layerwise contract is that encoders, VAEs and non-block modules
    are device resident unless streamed) and declared resident module that belong to no
    selected block, each once. On-demand components (the pipeline manages them) are left
    where they are."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    paths = (
        *plan.streamed_components,
        *plan.dits,
        *plan.encoders,
        *plan.vaes,
        *plan.resident_modules,
    )
    on_demand = {id(get_by_path(pipeline, p)) for p in plan.on_demand}
    for path in dict.fromkeys(paths):
        module = get_by_path(pipeline, path)
        if id(module) in on_demand:
            continue
        for name, t in non_block_tensors(module, block_tensor_ids):
            if id(t) not in seen:
                seen.add(id(t))
                out.append((name, t))
    return out
