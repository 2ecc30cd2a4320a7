"""Block stacks: which block containers of each component stream, and the checks that no
block is claimed twice or nested.

Blocks of a DiT come from ``_offload_plan.block_attrs[dit_path]``, else the DiT's
``_layerwise_offload_blocks_attrs`` (set on the instance or its class), else the deprecated
singular ``_layerwise_offload_blocks_attr`` (``FutureWarning``), else the adapter registry
(the nearest registered class in the DiT class's MRO), else the containers of the classes
the model says repeat (``_repeated_blocks``, ``_no_split_modules``), else a structural
guess that warns once per class (:mod:`dlo.plan.repeated`). Encoder blocks come from
``_offload_plan.encoder_block_attrs[encoder_path]``, else the same chain from the
encoder's own declaration on (a ``transformers`` text encoder's ``_no_split_modules``),
without the structural guess.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
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
from dlo.plan.discovery import _Components, _declaration, _Problems, warn_once
from dlo.plan.repeated import candidate_containers, describe, find_containers, is_block


# ----------------------------------------------------------------------------- blocks
@dataclass
class _Stack:
    component: str
    component_path: str
    container_path: str
    blocks: list[tuple[str, nn.Module]]
    source: str = "declared"
    """Where the container came from: ``"declared"``, ``"adapter"``, ``"_repeated_blocks"``,
    ``"_no_split_modules"`` or ``"structure"``."""
    optional: bool = False
    """An encoder stack the policy may keep whole on the device instead (see
    :attr:`dlo.plan.topology.BlockStack.optional`)."""


def _block_attrs(
    kind: str, path: str, comp: nn.Module, declared: tuple[str, ...] | None
) -> tuple[tuple[str, ...], str]:
    """The block containers of component ``comp`` and their source (see the module
    docstring for the order); ``((), "")`` when nothing finds one."""
    if declared is not None:
        return declared, "declared"
    cls = type(comp)
    attrs = _declaration(comp, BLOCKS_ATTRS)
    if attrs is not None:
        return attrs, "declared"
    single = getattr(comp, BLOCKS_ATTR_DEPRECATED, None)
    if single is not None:
        return _deprecated_attr(cls, single), "declared"
    adapter = model_adapter(cls)
    if adapter is not None:
        return adapter.block_attrs, "adapter"
    # a structural guess only for DiTs: an encoder streams when declared or when it names
    # its repeated classes (every transformers model does)
    found = find_containers(comp, structural=kind == "DiT")
    if found is None:
        return (), ""
    if found.source == "structure":
        warn_once(
            f"dlo: {kind} {path!r} ({cls.__name__}) declares no blocks, and no ModuleList "
            f"holds only classes its _repeated_blocks / _no_split_modules name; streaming the "
            f"ModuleLists found by structure: {describe(found.attrs, comp)}. To make it a "
            "declaration: "
            f"{cls.__name__}.{BLOCKS_ATTRS} = {list(found.attrs)!r}"
        )
    return found.attrs, found.source


def _deprecated_attr(cls: type, single: object) -> tuple[str, ...]:
    if not isinstance(single, str):
        raise TypeError(
            f"{cls.__name__}.{BLOCKS_ATTR_DEPRECATED} must be a str, got {single!r} "
            f"({type(single).__name__})"
        )
    warnings.warn(
        f"{cls.__name__}.{BLOCKS_ATTR_DEPRECATED} is deprecated; declare "
        f"{BLOCKS_ATTRS} = [{single!r}] instead",
        FutureWarning,
        stacklevel=6,  # the caller of resolve_offload_plan
    )
    return (_check_path(f"{cls.__name__}.{BLOCKS_ATTR_DEPRECATED}", single),)


def _container_stack(
    kind: str, comp_path: str, comp: nn.Module, attr: str, source: str, problems: _Problems
) -> _Stack | None:
    where = f"{kind} {comp_path!r} ({type(comp).__name__}) block container {attr!r}"
    try:
        container = get_by_path(comp, attr)
    except AttributeError as e:
        problems.report(f"{where} does not resolve: {e}. {_offer(kind, comp_path, comp)}")
        return None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        problems.report(
            f"{where} must be an nn.ModuleList or nn.Sequential, got "
            f"{type(container).__name__}. {_offer(kind, comp_path, comp)}"
        )
        return None
    container_path = _join(comp_path, attr)
    # _modules, not named_children(): the latter hides a block listed twice
    blocks = [(_join(container_path, name), child) for name, child in container._modules.items()]
    if not blocks:
        problems.report(f"{where} is empty: nothing to stream")
        return None
    for block_path, child in blocks:
        if not is_block(child):
            problems.report(
                f"{where}: {block_path!r} is a {type(child).__name__}, not an executable block "
                f"(a container given as a block?). {_offer(kind, comp_path, comp)}"
            )
            return None
    return _Stack(kind, comp_path, container_path, blocks, source)


def _offer(kind: str, path: str, comp: nn.Module) -> str:
    """What to declare instead: the containers ``comp`` has, as a declaration that works."""
    found = candidate_containers(comp)
    if not found:
        return f"{type(comp).__name__} has no nn.ModuleList or nn.Sequential of blocks"
    first = found[0].split(" ", 1)[0]
    field_name = "block_attrs" if kind == "dit" else "encoder_block_attrs"
    return (
        f"Its block containers: {', '.join(found)}; declare one, e.g. "
        f"{_plan_declaration(field_name, path, first)}"
    )


def _plan_declaration(field_name: str, path: str, attr_repr: str) -> str:
    if path == "":  # a bare model: the plan goes on the model itself
        return (
            f"model._offload_plan = dlo.OffloadPlan({field_name}={{'': [{attr_repr}]}}) or "
            f"model.{BLOCKS_ATTRS} = [{attr_repr}]"
        )
    return f"pipe._offload_plan = dlo.OffloadPlan({field_name}={{{path!r}: [{attr_repr}]}})"


def _component_stacks(
    kind: str,
    path: str,
    comp: nn.Module,
    attrs: tuple[str, ...],
    source: str,
    problems: _Problems,
) -> list[_Stack]:
    stacks = [_container_stack(kind, path, comp, attr, source, problems) for attr in attrs]
    return [s for s in stacks if s is not None]


def _no_blocks(kind: str, path: str, comp: nn.Module) -> str:
    cls = type(comp).__name__
    field_name = "block_attrs" if kind == "dit" else "encoder_block_attrs"
    structure = ", and ModuleLists of two or more blocks of one class" if kind == "dit" else ""
    return (
        f"{kind} {path!r} ({cls}) has no blocks dlo can find: it looked for "
        f"OffloadPlan.{field_name}[{path!r}], {cls}.{BLOCKS_ATTRS}, a dlo adapter for {cls}, "
        f"ModuleLists of the classes in {cls}._repeated_blocks / _no_split_modules"
        f"{structure}. {_offer(kind, path, comp)}"
    )


def _dit_stacks(
    found: _Components, plan: OffloadPlan, on_demand: set[int], problems: _Problems
) -> list[_Stack]:
    dit_paths = {p for p, _ in found.dits}
    for key in plan.block_attrs:
        if key not in dit_paths:
            problems.report(
                f"OffloadPlan.block_attrs key {key!r} is not a discovered DiT "
                f"(the DiTs: {sorted(dit_paths)})"
            )
    for key in plan.resident_dit_paths or ():
        if key not in dit_paths:
            problems.report(f"OffloadPlan.resident_dit_paths entry {key!r} is not a discovered DiT")
    stacks: list[_Stack] = []
    for path, dit in found.dits:
        attrs, source = _block_attrs("DiT", path, dit, plan.block_attrs.get(path))
        if not attrs:
            problems.report(_no_blocks("dit", path, dit))
            continue
        if id(dit) in on_demand:
            problems.report(f"DiT {path!r} is on-demand (pipeline-managed); it cannot stream")
            continue
        stacks += _component_stacks("dit", path, dit, attrs, source, problems)
    return stacks


def _encoder_stacks(
    found: _Components,
    plan: OffloadPlan,
    on_demand: set[int],
    problems: _Problems,
    *,
    selected: bool,
    optional: bool = False,
) -> list[_Stack]:
    """Encoder stacks: declared ones, and (only when ``components`` names ``"encoder"``,
    ``selected``) those found from the encoder's own ``_no_split_modules``. A found stack is
    not streamed by default: it would change what an existing ``components=None`` setup
    streams (slot size, checks an FSDP-wrapped or quantized encoder does not pass). With
    ``optional`` (the policy decides residency, ``components`` unset) a found stack of plain
    tensors is returned marked optional: the policy streams it only where the DiT needs its
    device memory ([Note: encoders kept or streamed] in :mod:`dlo.plan.encoder_choice`)."""
    encoders = dict(found.encoders)
    for field_name in ("encoder_block_attrs", "encoder_dlo_weight_replication"):
        for key in getattr(plan, field_name):
            if key not in encoders:
                problems.report(
                    f"OffloadPlan.{field_name} entry {key!r} is not a discovered encoder "
                    f"(the encoders: {sorted(encoders)})"
                )
    stacks: list[_Stack] = []
    for path, encoder in found.encoders:
        if id(encoder) in on_demand:
            if path in plan.encoder_block_attrs:
                problems.report(
                    f"encoder {path!r} is on-demand (pipeline-managed); it cannot stream"
                )
            continue
        declared = plan.encoder_block_attrs.get(path)
        if declared == ():  # an explicit opt-out
            continue
        attrs, source = _block_attrs("encoder", path, encoder, declared)
        if not attrs:
            _warn_unstreamed_encoder(path, encoder)
            continue
        if source != "declared" and not selected:
            found_stacks = (
                _component_stacks("encoder", path, encoder, attrs, source, problems)
                if optional
                else []
            )
            if found_stacks and all(_plain(s) for s in found_stacks):
                stacks += [dataclasses.replace(s, optional=True) for s in found_stacks]
                continue
            warn_once(
                f"dlo: encoder {path!r} ({type(encoder).__name__}) has blocks dlo can stream "
                f"({describe(attrs, encoder)}, from its {source}); it is kept whole on the "
                "device: pass components=('dit', 'encoder') (dlo run: --components dit,encoder) "
                "to stream it"
            )
            continue
        stacks += _component_stacks("encoder", path, encoder, attrs, source, problems)
    return stacks


def _plain(stack: _Stack) -> bool:
    """Every tensor of the stack's blocks is a plain tensor (no DTensor, no quantized
    subclass): an encoder the policy may stream without changing what enable checks."""
    return all(
        type(t) in (torch.Tensor, nn.Parameter)
        for _, block in stack.blocks
        for t in (*block.parameters(), *block.buffers())
    )


def _warn_unstreamed_encoder(path: str, encoder: nn.Module) -> None:
    """An encoder with no block stack streams nothing: say so once per class."""
    warn_once(
        f"dlo: {_no_blocks('encoder', path, encoder)}; mode='layer' streams none of it "
        "(it stays where it is, or on the device with the other resident modules)"
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
