"""Block stacks: which block containers of each component stream, and the checks that no
block is claimed twice or nested.

Blocks of a DiT come from ``_offload_plan.block_attrs[dit_path]``, else the DiT class's
``_layerwise_offload_blocks_attrs``, else the deprecated singular
``_layerwise_offload_blocks_attr`` (``FutureWarning``), else the adapter registry (the
nearest registered class in the DiT class's MRO). Encoder blocks stream only when
``_offload_plan.encoder_block_attrs`` declares them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from dlo.plan.adapters import model_adapter
from dlo.plan.declarations import (
    BLOCKS_ATTR_DEPRECATED,
    BLOCKS_ATTRS,
    OffloadPlan,
    _check_path,
    _join,
    get_by_path,
)
from dlo.plan.discovery import _class_declaration, _Components, _Problems, warn_once


# ----------------------------------------------------------------------------- blocks
@dataclass
class _Stack:
    component: str
    component_path: str
    container_path: str
    blocks: list[tuple[str, nn.Module]]


def _dit_block_attrs(path: str, dit: nn.Module, plan: OffloadPlan) -> tuple[str, ...]:
    if path in plan.block_attrs:
        return plan.block_attrs[path]
    cls = type(dit)
    attrs = _class_declaration(cls, BLOCKS_ATTRS)
    if attrs is not None:
        return attrs
    single = getattr(cls, BLOCKS_ATTR_DEPRECATED, None)
    if single is None:
        adapter = model_adapter(cls)
        return adapter.block_attrs if adapter is not None else ()
    if not isinstance(single, str):
        raise TypeError(
            f"{cls.__name__}.{BLOCKS_ATTR_DEPRECATED} must be a str, got {single!r} "
            f"({type(single).__name__})"
        )
    warnings.warn(
        f"{cls.__name__}.{BLOCKS_ATTR_DEPRECATED} is deprecated; declare "
        f"{BLOCKS_ATTRS} = [{single!r}] instead",
        FutureWarning,
        stacklevel=5,  # the caller of resolve_offload_plan
    )
    return (_check_path(f"{cls.__name__}.{BLOCKS_ATTR_DEPRECATED}", single),)


def _is_block(module: object) -> bool:
    # containers (and other modules without a forward) never run, so hooks on them never fire
    return (
        isinstance(module, nn.Module)
        and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is not nn.Module.forward
    )


def _container_stack(
    kind: str, comp_path: str, comp: nn.Module, attr: str, problems: _Problems
) -> _Stack | None:
    where = f"{kind} {comp_path!r} ({type(comp).__name__}) block container {attr!r}"
    try:
        container = get_by_path(comp, attr)
    except AttributeError as e:
        problems.report(f"{where} does not resolve: {e}")
        return None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        problems.report(
            f"{where} must be an nn.ModuleList or nn.Sequential, got {type(container).__name__}"
        )
        return None
    container_path = _join(comp_path, attr)
    # _modules, not named_children(): the latter hides a block listed twice
    blocks = [(_join(container_path, name), child) for name, child in container._modules.items()]
    if not blocks:
        problems.report(f"{where} is empty: nothing to stream")
        return None
    for block_path, child in blocks:
        if not _is_block(child):
            problems.report(
                f"{where}: {block_path!r} is a {type(child).__name__}, not an executable block "
                "(a container given as a block? declare the inner container instead)"
            )
            return None
    return _Stack(kind, comp_path, container_path, blocks)


def _component_stacks(
    kind: str, path: str, comp: nn.Module, attrs: tuple[str, ...], problems: _Problems
) -> list[_Stack]:
    stacks = [_container_stack(kind, path, comp, attr, problems) for attr in attrs]
    return [s for s in stacks if s is not None]


def _dit_stacks(
    found: _Components, plan: OffloadPlan, on_demand: set[int], problems: _Problems
) -> list[_Stack]:
    dit_paths = {p for p, _ in found.dits}
    for key in plan.block_attrs:
        if key not in dit_paths:
            problems.report(f"OffloadPlan.block_attrs key {key!r} is not a discovered DiT")
    for key in plan.resident_dit_paths or ():
        if key not in dit_paths:
            problems.report(f"OffloadPlan.resident_dit_paths entry {key!r} is not a discovered DiT")
    stacks: list[_Stack] = []
    for path, dit in found.dits:
        attrs = _dit_block_attrs(path, dit, plan)
        if not attrs:
            problems.report(
                f"DiT {path!r} ({type(dit).__name__}) declares no blocks: set "
                f"{BLOCKS_ATTRS} on its class or OffloadPlan.block_attrs[{path!r}]"
            )
            continue
        if id(dit) in on_demand:
            problems.report(f"DiT {path!r} is on-demand (pipeline-managed); it cannot stream")
            continue
        stacks += _component_stacks("dit", path, dit, attrs, problems)
    return stacks


def _encoder_stacks(
    found: _Components, plan: OffloadPlan, on_demand: set[int], problems: _Problems
) -> list[_Stack]:
    encoders = dict(found.encoders)
    for field_name in ("encoder_block_attrs", "encoder_dlo_weight_replication"):
        for key in getattr(plan, field_name):
            if key not in encoders:
                problems.report(
                    f"OffloadPlan.{field_name} entry {key!r} is not a discovered encoder"
                )
    stacks: list[_Stack] = []
    for path, encoder in found.encoders:
        attrs = plan.encoder_block_attrs.get(path, ())
        if not attrs and id(encoder) not in on_demand:
            _warn_unstreamed_encoder(path, encoder)
        if attrs and id(encoder) in on_demand:
            problems.report(f"encoder {path!r} is on-demand (pipeline-managed); it cannot stream")
            continue
        stacks += _component_stacks("encoder", path, encoder, attrs, problems)
    return stacks


def _warn_unstreamed_encoder(path: str, encoder: nn.Module) -> None:
    """A declared encoder with no block stack streams nothing: say so once per class."""
    warn_once(
        f"dlo: encoder {path!r} ({type(encoder).__name__}) declares no block stack, so "
        "mode='layer' streams none of it (it stays where it is); to stream it, set "
        f"OffloadPlan(encoder_block_attrs={{{path!r}: [<its block container, e.g. "
        "'encoder.layers'>]}) as the pipeline's _offload_plan"
    )


def _strict_descendants(module: nn.Module) -> Iterator[nn.Module]:
    it = module.modules()
    next(it)  # the module itself
    return it


def _check_block_overlap(stacks: list[_Stack]) -> dict[int, str]:
    """Raise on a block claimed twice or nested in another; return id -> path of every block."""
    owner: dict[int, str] = {}
    for stack in stacks:
        for path, block in stack.blocks:
            if id(block) in owner:
                raise ValueError(
                    f"block {path!r} is the same module as block {owner[id(block)]!r}: "
                    "a block can be claimed by only one stack"
                )
            owner[id(block)] = path
    for stack in stacks:
        for path, block in stack.blocks:
            for inner in _strict_descendants(block):
                if id(inner) in owner:
                    raise ValueError(
                        f"block {owner[id(inner)]!r} is nested inside block {path!r}; "
                        "selected blocks must be disjoint"
                    )
    return owner


def _check_resident_modules(
    found: _Components, stacks: list[_Stack], owner: dict[int, str]
) -> None:
    inside = {id(m): path for s in stacks for path, b in s.blocks for m in _strict_descendants(b)}
    for path, module in found.resident:
        if id(module) in owner:
            raise ValueError(
                f"resident module {path!r} is the streamed block {owner[id(module)]!r}"
            )
        if id(module) in inside:
            raise ValueError(
                f"resident module {path!r} is inside the streamed block {inside[id(module)]!r}"
            )
        for m in _strict_descendants(module):
            if id(m) in owner:
                raise ValueError(
                    f"resident module {path!r} contains the streamed block {owner[id(m)]!r}"
                )
