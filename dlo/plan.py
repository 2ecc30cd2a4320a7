"""Topology: which modules of a pipeline are components, and which blocks stream.

:func:`resolve_offload_plan` is the single topology entry point. Every backend calls it once
when ``enable()`` starts and consumes the :class:`ResolvedOffloadPlan` it returns (components,
block stacks, resident heads, transfers and weight groups); backends never re-read model
declarations.

[Note: the resolver is pure]
It moves no tensor, installs no hook, writes no attribute on any module or pipeline, reads no
process group and never looks at tensor data, so it works on models whose parameters live on
the ``meta`` device and CPU-only CI can test every decision. Multi-rank facts come from
:class:`~dlo.config.ParallelConfig`. Modules are compared by identity (``is``/``id``), never
by path, so aliases cannot hide a block claimed twice. Calling it twice on the same inputs
returns equal plans.

Discovery, in order of preference:

1. The pipeline class declares :class:`SupportsComponentDiscovery` lists (``_dit_modules``,
   ``_encoder_modules``, ``_vae_modules``, ``_resident_modules``; dotted paths; missing lists
   are empty).
2. The pipeline is a bare ``nn.Module`` that declares its own blocks, or whose class is in
   the adapter registry (:mod:`dlo.adapters`): one DiT at path ``""``.
3. The pipeline class is in the adapter registry: its component attribute names, keeping
   those that hold an ``nn.Module`` (optional components are ``None``), without a warning.
4. A scan of well-known attribute names, which warns once per pipeline class.

Blocks of a DiT come from ``_offload_plan.block_attrs[dit_path]``, else the DiT class's
``_layerwise_offload_blocks_attrs``, else the deprecated singular
``_layerwise_offload_blocks_attr`` (``FutureWarning``), else the adapter registry (the
nearest registered class in the DiT class's MRO). Encoder blocks stream only when
``_offload_plan.encoder_block_attrs`` declares them.

[Note: explicit vs compatibility topology]
``OffloadConfig.components`` given (mode ``"layer"``) is the explicit topology: every
declaration problem (a path that does not resolve, a DiT without blocks, an empty container,
an encoder that is not replicated but asked to AllGather, ...) raises ``ValueError``.
``components=None`` is the compatibility topology: the same problems are recorded in
``ResolvedOffloadPlan.warnings``, logged once, and the offending item is skipped. Some
problems are errors in both: a block claimed by two stacks, a block nested in another, a
resident module overlapping a streamed block, more resident layers than a DiT has blocks.
Malformed declarations (a ``str`` where a list of paths is expected, a non-``str`` path) are
``TypeError`` in both: they are bugs in the model code, not mismatches with a checkpoint.
"""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from dlo.adapters import model_adapter, pipeline_adapter
from dlo.config import COMPONENTS, TRANSFERS, OffloadConfig, ParallelConfig

logger = logging.getLogger(__name__)

DIT_SCAN_NAMES = (
    "transformer",
    "transformer_2",
    "dit",
    "sr_dit",
    "language_model",
    "transformer_blocks",
    "model",
)
ENCODER_SCAN_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")
VAE_SCAN_NAMES = ("vae", "audio_vae")
DECLARATION_ATTRS = ("_dit_modules", "_encoder_modules", "_vae_modules", "_resident_modules")
BLOCKS_ATTRS = "_layerwise_offload_blocks_attrs"
BLOCKS_ATTR_DEPRECATED = "_layerwise_offload_blocks_attr"

# pipeline classes already told about the fallback scan, and compat messages already logged
_warned_scan_classes: set[type] = set()
_logged_messages: set[str] = set()


# ----------------------------------------------------------------------------- protocols
@runtime_checkable
class SupportsComponentDiscovery(Protocol):
    """A pipeline that declares its components as dotted paths from itself.

    Example:
        >>> class MyPipeline:
        ...     _dit_modules = ["transformer"]
        ...     _encoder_modules = ["text_encoder"]
        ...     _vae_modules = ["vae"]
        ...     _resident_modules = ["transformer.time_embed"]
        >>> isinstance(MyPipeline(), SupportsComponentDiscovery)
        True
    """

    _dit_modules: ClassVar[list[str]]
    _encoder_modules: ClassVar[list[str]]
    _vae_modules: ClassVar[list[str]]
    _resident_modules: ClassVar[list[str]]


@runtime_checkable
class SupportsModelOffload(Protocol):
    """A split model that performs model-level offload itself (e.g. phases of one forward).

    The model-level backend checks this protocol explicitly and delegates to it.
    """

    def enable_model_offload(self, *, device: torch.device, pin_memory: bool) -> None: ...

    def disable_model_offload(self) -> None: ...


# ----------------------------------------------------------------------------- declarations
def _check_path(where: str, path: Any, *, allow_root: bool = False) -> str:
    if not isinstance(path, str):
        raise TypeError(f"{where} must be a dotted path str, got {path!r} ({type(path).__name__})")
    if path == "" and allow_root:
        return path
    if any(not part for part in path.split(".")):
        raise ValueError(f"{where}={path!r} is not a dotted path (empty segment)")
    return path


def _path_tuple(where: str, value: Any, *, allow_root: bool = False) -> tuple[str, ...]:
    """A list/tuple/set of paths as a tuple (sets sorted, so the result is deterministic)."""
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=str)
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{where} must be a list or tuple of str, got {value!r} ({type(value).__name__})"
        )
    return tuple(
        _check_path(f"{where}[{i}]", p, allow_root=allow_root) for i, p in enumerate(value)
    )


def _path_mapping(where: str, value: Any) -> Mapping[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a mapping, got {value!r} ({type(value).__name__})")
    out: dict[str, tuple[str, ...]] = {}
    for key, attrs in value.items():
        _check_path(f"{where} key", key, allow_root=True)
        out[key] = _path_tuple(f"{where}[{key!r}]", attrs)
    return types.MappingProxyType(out)


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Offload topology a pipeline declares, set as ``pipeline._offload_plan``.

    Lists and dicts of lists are accepted and frozen (tuples, read-only mappings); sets are
    sorted. Paths are dotted; DiT and encoder paths are relative to the pipeline, block
    container attrs relative to their component.

    Raises:
        TypeError: a field of the wrong type (the message names the field).
        ValueError: a malformed dotted path.

    Example:
        >>> plan = OffloadPlan(block_attrs={"transformer": ["blocks", "single_blocks"]},
        ...                    encoder_block_attrs={"text_encoder": ["encoder.layers"]},
        ...                    encoder_dlo_weight_replication=["text_encoder"])
        >>> plan.block_attrs["transformer"]
        ('blocks', 'single_blocks')
    """

    block_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """DiT path -> ordered block container attrs (execution order). Takes precedence over the
    DiT class's ``_layerwise_offload_blocks_attrs``."""
    encoder_block_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Encoder path -> ordered block container attrs. Encoders stream only when listed here."""
    on_demand_component_paths: tuple[str, ...] = ()
    """Components whose residency the pipeline manages itself; dlo never moves them."""
    resident_dit_paths: tuple[str, ...] | None = None
    """DiTs allowed to keep resident leading blocks; None allows every DiT."""
    encoder_dlo_weight_replication: tuple[str, ...] = ()
    """Encoders whose weights are identical on every rank, so AllGather may rebuild them."""

    def __post_init__(self) -> None:
        freeze = object.__setattr__
        freeze(self, "block_attrs", _path_mapping("block_attrs", self.block_attrs))
        freeze(
            self,
            "encoder_block_attrs",
            _path_mapping("encoder_block_attrs", self.encoder_block_attrs),
        )
        for name in ("on_demand_component_paths", "encoder_dlo_weight_replication"):
            freeze(self, name, _path_tuple(name, getattr(self, name), allow_root=True))
        if self.resident_dit_paths is not None:
            paths = _path_tuple("resident_dit_paths", self.resident_dit_paths, allow_root=True)
            freeze(self, "resident_dit_paths", paths)


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True, kw_only=True)
class BlockStack:
    """One ring of streamed blocks: the children of one block container, in order.

    Example:
        >>> s = BlockStack(component="dit", component_path="transformer",
        ...                container_path="transformer.blocks",
        ...                block_paths=("transformer.blocks.0", "transformer.blocks.1"),
        ...                transfer="rank-local", num_resident=1, group_axis="local",
        ...                group_size=1)
        >>> s.streamed_block_paths
        ('transformer.blocks.1',)
    """

    component: str
    """``"dit"`` or ``"encoder"``."""
    component_path: str
    """Dotted path of the component from the pipeline (``""``: the pipeline is the DiT)."""
    container_path: str
    """Dotted path of the block container from the pipeline."""
    block_paths: tuple[str, ...]
    """Dotted path of each block from the pipeline, in execution order."""
    transfer: str
    """Effective transfer: ``"rank-local"``, ``"allgather"`` or ``"auto"``."""
    num_resident: int
    """How many leading blocks stay on the device (``0..len(block_paths)``)."""
    group_axis: str
    """Axis of the weight-collective group (``"local"`` for rank-local)."""
    group_size: int
    """Size of the weight-collective group (1 for rank-local and node-shared)."""
    share_axis: str = "local"
    """Node-shared only: the weight axis whose ranks on one node share the host copy."""
    share_size: int = 1
    """Node-shared only: size of that axis's group (the ranks on one node share)."""

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"component={self.component!r} is not one of {COMPONENTS}")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"transfer={self.transfer!r} is not one of {TRANSFERS}")
        object.__setattr__(self, "block_paths", tuple(self.block_paths))
        if not 0 <= self.num_resident <= len(self.block_paths):
            raise ValueError(
                f"num_resident={self.num_resident} is outside 0..{len(self.block_paths)} "
                f"for {self.container_path!r}"
            )
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.transfer == "node-shared" and self.group_size != 1:
            raise ValueError(
                f"a node-shared stack copies whole blocks (group_size 1), got {self.group_size}"
            )

    @property
    def resident_block_paths(self) -> tuple[str, ...]:
        return self.block_paths[: self.num_resident]

    @property
    def streamed_block_paths(self) -> tuple[str, ...]:
        return self.block_paths[self.num_resident :]


@dataclass(frozen=True, kw_only=True)
class ResolvedOffloadPlan:
    """The topology a backend executes; produced by :func:`resolve_offload_plan`."""

    mode: str
    """``OffloadConfig.mode``."""
    explicit: bool
    """``OffloadConfig.components`` was given (see [Note: explicit vs compatibility topology])."""
    dits: tuple[str, ...]
    """Dotted paths of the discovered DiTs."""
    encoders: tuple[str, ...]
    """Dotted paths of the discovered encoders."""
    vaes: tuple[str, ...]
    """Dotted paths of the discovered VAEs."""
    resident_modules: tuple[str, ...]
    """Declared ``_resident_modules`` that resolved (kept on the device)."""
    on_demand: tuple[str, ...]
    """``OffloadPlan.on_demand_component_paths`` that resolved (never moved by dlo)."""
    stacks: tuple[BlockStack, ...]
    """Block stacks to stream, DiTs first; empty unless mode is ``"layer"``."""
    warnings: tuple[str, ...]
    """Problems skipped under the compatibility topology (already logged by the resolver)."""

    @property
    def all_block_paths(self) -> tuple[str, ...]:
        return tuple(p for s in self.stacks for p in s.block_paths)

    @property
    def num_streamed_blocks(self) -> int:
        return sum(len(s.block_paths) - s.num_resident for s in self.stacks)

    @property
    def num_resident_blocks(self) -> int:
        return sum(s.num_resident for s in self.stacks)


# ----------------------------------------------------------------------------- paths
def every_component(pipeline: Any, plan: ResolvedOffloadPlan) -> list[tuple[str, nn.Module]]:
    """Everything of ``pipeline`` a block's tensor could also be reachable from: the
    pipeline itself when it is a module, else every component the plan knows (for checks
    that a streamed or swapped tensor is not shared with a module dlo does not manage)."""
    if isinstance(pipeline, nn.Module):
        return [("", pipeline)]
    paths = dict.fromkeys(
        (*plan.dits, *plan.encoders, *plan.vaes, *plan.resident_modules, *plan.on_demand)
    )
    found = [(p, get_by_path(pipeline, p)) for p in paths]
    return [(p, m) for p, m in found if isinstance(m, nn.Module)]


def get_by_path(root: object, path: str) -> Any:
    """Follow a dotted attribute path from ``root`` (``"blocks.0"`` indexes a ModuleList).

    Args:
        root: the object to start from.
        path: dotted attribute path; ``""`` is ``root`` itself.

    Returns:
        The object at ``path``.

    Raises:
        AttributeError: a segment does not exist (names the full path and the missing part).
        TypeError / ValueError: ``path`` is not a str / has an empty segment.

    Example:
        >>> get_by_path(pipe, "transformer.blocks.0")  # doctest: +SKIP
    """
    _check_path("path", path, allow_root=True)
    obj = root
    if path == "":
        return obj
    parts = path.split(".")
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            parent = ".".join(parts[:i]) or "<root>"
            raise AttributeError(
                f"path {path!r} does not resolve on {type(root).__name__}: {parent!r} "
                f"({type(obj).__name__}) has no attribute {part!r}"
            ) from None
    return obj


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


# ----------------------------------------------------------------------------- problems
class _Problems:
    """Explicit topology raises; compatibility topology records, logs once and skips."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.messages: list[str] = []

    def report(self, message: str) -> None:
        if self.strict:
            raise ValueError(message)
        self.note(message)

    def note(self, message: str, *, log: bool = True) -> None:
        self.messages.append(message)
        if log and message not in _logged_messages:
            _logged_messages.add(message)
            logger.warning("%s", message)


def _owner(pipeline: object) -> str:
    return type(pipeline).__name__


def _resolve_module(
    pipeline: object, path: str, what: str, problems: _Problems
) -> nn.Module | None:
    try:
        obj = get_by_path(pipeline, path)
    except AttributeError as e:
        problems.report(f"{what} {path!r} of {_owner(pipeline)} does not resolve: {e}")
        return None
    if not isinstance(obj, nn.Module):
        problems.report(
            f"{what} {path!r} of {_owner(pipeline)} is not an nn.Module (got {type(obj).__name__})"
        )
        return None
    return obj


# ----------------------------------------------------------------------------- discovery
@dataclass
class _Components:
    dits: list[tuple[str, nn.Module]] = field(default_factory=list)
    encoders: list[tuple[str, nn.Module]] = field(default_factory=list)
    vaes: list[tuple[str, nn.Module]] = field(default_factory=list)
    resident: list[tuple[str, nn.Module]] = field(default_factory=list)


def _class_declaration(cls: type, name: str) -> tuple[str, ...] | None:
    value = getattr(cls, name, None)
    if value is None:
        return None
    return _path_tuple(f"{cls.__name__}.{name}", value, allow_root=True)


def resident_dit_paths_of(pipeline: object) -> tuple[str, ...] | None:
    """The DiTs ``pipeline``'s :class:`OffloadPlan` allows resident blocks (None: all)."""
    return _offload_plan_of(pipeline).resident_dit_paths


def _offload_plan_of(pipeline: object) -> OffloadPlan:
    plan = getattr(pipeline, "_offload_plan", None)
    if plan is None:
        return OffloadPlan()
    if not isinstance(plan, OffloadPlan):
        raise TypeError(
            f"{_owner(pipeline)}._offload_plan must be a dlo.OffloadPlan, got {type(plan).__name__}"
        )
    return plan


def _declares_blocks(module: object, plan: OffloadPlan) -> bool:
    if not isinstance(module, nn.Module):
        return False
    cls = type(module)
    return (
        "" in plan.block_attrs
        or getattr(cls, BLOCKS_ATTRS, None) is not None
        or getattr(cls, BLOCKS_ATTR_DEPRECATED, None) is not None
        or model_adapter(cls) is not None
    )


def _scan(pipeline: object, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if isinstance(getattr(pipeline, n, None), nn.Module)]


def _discovery_paths(
    pipeline: object, plan: OffloadPlan
) -> tuple[list[str], list[str], list[str], list[str]] | None:
    """Declared paths of DiTs, encoders, VAEs and resident modules; None: nothing declared."""
    cls = type(pipeline)
    declared = {name: _class_declaration(cls, name) for name in DECLARATION_ATTRS}
    self_dit = [""] if _declares_blocks(pipeline, plan) else []
    if any(v is not None for v in declared.values()):
        dits, encoders, vaes, resident = (list(v or ()) for v in declared.values())
        if declared["_dit_modules"] is None:
            dits = self_dit
        return dits, encoders, vaes, resident
    if self_dit:
        return self_dit, [], [], []
    adapter = pipeline_adapter(cls)
    if adapter is not None:
        return (
            _scan(pipeline, adapter.dits),
            _scan(pipeline, adapter.encoders),
            _scan(pipeline, adapter.vaes),
            [],
        )
    return None


def _scan_paths(
    pipeline: object, problems: _Problems
) -> tuple[list[str], list[str], list[str], list[str]]:
    """Well-known attribute names holding modules; warns once per pipeline class."""
    cls = type(pipeline)
    if cls not in _warned_scan_classes:
        _warned_scan_classes.add(cls)
        logger.warning(
            "%s declares no components; falling back to a scan of well-known attribute names. "
            "Declare _dit_modules/_encoder_modules/_vae_modules (dlo.SupportsComponentDiscovery).",
            cls.__name__,
        )
    # recorded on every call (equal plans), logged once per class (above)
    problems.note(
        f"{cls.__name__} declares no components; found them by scanning well-known names",
        log=False,
    )
    return (
        _scan(pipeline, DIT_SCAN_NAMES),
        _scan(pipeline, ENCODER_SCAN_NAMES),
        _scan(pipeline, VAE_SCAN_NAMES),
        [],
    )


def _discover(pipeline: object, plan: OffloadPlan, problems: _Problems) -> _Components:
    declared = _discovery_paths(pipeline, plan)
    all_paths = _scan_paths(pipeline, problems) if declared is None else declared
    dit_paths, encoder_paths, vae_paths, resident_paths = all_paths
    found = _Components()
    seen: dict[int, str] = {}
    kinds = (
        ("DiT", dit_paths, found.dits),
        ("encoder", encoder_paths, found.encoders),
        ("VAE", vae_paths, found.vaes),
    )
    for what, paths, out in kinds:
        for path in paths:
            module = _resolve_module(pipeline, path, what, problems)
            if module is None:
                continue
            if id(module) in seen and declared is None:
                logger.debug("scan: %s %r aliases %s; kept once", what, path, seen[id(module)])
                continue
            if id(module) in seen:
                problems.report(
                    f"{what} {path!r} of {_owner(pipeline)} is the same module as "
                    f"{seen[id(module)]}; it is kept once"
                )
                continue
            seen[id(module)] = f"{what} {path!r}"
            out.append((path, module))
    for path in resident_paths:
        module = _resolve_module(pipeline, path, "resident module", problems)
        if module is not None:
            found.resident.append((path, module))
    return found


def _on_demand(
    pipeline: object, plan: OffloadPlan, problems: _Problems
) -> list[tuple[str, nn.Module]]:
    out = []
    for path in plan.on_demand_component_paths:
        module = _resolve_module(pipeline, path, "on-demand component", problems)
        if module is not None:
            out.append((path, module))
    return out


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
        if attrs and id(encoder) in on_demand:
            problems.report(f"encoder {path!r} is on-demand (pipeline-managed); it cannot stream")
            continue
        stacks += _component_stacks("encoder", path, encoder, attrs, problems)
    return stacks


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


# ----------------------------------------------------------------------------- policy
def _resident_counts(
    stacks: list[_Stack], config: OffloadConfig, plan: OffloadPlan, problems: _Problems
) -> list[int]:
    """Resident leading blocks per stack, counted over each DiT's stacks in container order."""
    requested = config.resident_layers_for("dit")
    # "auto" is decided at enable from measured memory (dlo.backends.auto); none until then
    wanted = 0 if requested == "auto" else int(requested)
    counts = [0] * len(stacks)
    dit_paths = list(dict.fromkeys(s.component_path for s in stacks if s.component == "dit"))
    for dit_path in dit_paths:
        indices = [
            i for i, s in enumerate(stacks) if s.component == "dit" and s.component_path == dit_path
        ]
        num_blocks = sum(len(stacks[i].blocks) for i in indices)
        left = wanted
        if plan.resident_dit_paths is not None and dit_path not in plan.resident_dit_paths:
            if wanted:
                problems.report(
                    f"resident_layers={wanted} but DiT {dit_path!r} is not in "
                    f"OffloadPlan.resident_dit_paths={plan.resident_dit_paths}; it keeps none"
                )
            left = 0
        if left > num_blocks:
            raise ValueError(
                f"resident_layers={left} exceeds the {num_blocks} blocks of DiT {dit_path!r}"
            )
        for i in indices:
            counts[i] = min(left, len(stacks[i].blocks))
            left -= counts[i]
    return counts


def _transfer(stack: _Stack, config: OffloadConfig, plan: OffloadPlan, problems: _Problems) -> str:
    transfer = config.transfer_for(stack.component)
    if (
        stack.component == "encoder"
        and transfer != "rank-local"
        and stack.component_path not in plan.encoder_dlo_weight_replication
    ):
        problems.report(
            f"encoder {stack.component_path!r} uses transfer={transfer!r} but is not in "
            "OffloadPlan.encoder_dlo_weight_replication (its weights may differ across ranks); "
            "using 'rank-local'"
        )
        transfer = "rank-local"
    return transfer


def _finish(
    stacks: list[_Stack],
    config: OffloadConfig,
    par: ParallelConfig,
    plan: OffloadPlan,
    problems: _Problems,
) -> tuple[BlockStack, ...]:
    counts = _resident_counts(stacks, config, plan, problems)
    out = []
    for stack, num_resident in zip(stacks, counts):
        transfer = _transfer(stack, config, plan, problems)
        axis, size = ("local", 1)
        if transfer != "rank-local":
            axis, size = config.weight_group(par, stack.component)
        share_axis, share_size = ("local", 1)
        if transfer == "node-shared":  # whole blocks; the group shares the host copy
            (share_axis, share_size), (axis, size) = (axis, size), ("local", 1)
        out.append(
            BlockStack(
                component=stack.component,
                component_path=stack.component_path,
                container_path=stack.container_path,
                block_paths=tuple(p for p, _ in stack.blocks),
                transfer=transfer,
                num_resident=num_resident,
                group_axis=axis,
                group_size=size,
                share_axis=share_axis,
                share_size=share_size,
            )
        )
        logger.debug(
            "stack %r: %d blocks (%d resident), transfer=%s, group=(%s, %d)",
            stack.container_path,
            len(stack.blocks),
            num_resident,
            transfer,
            axis,
            size,
        )
    return tuple(out)


def _layer_stacks(
    pipeline: object,
    found: _Components,
    config: OffloadConfig,
    par: ParallelConfig,
    plan: OffloadPlan,
    on_demand: list[tuple[str, nn.Module]],
    problems: _Problems,
) -> tuple[BlockStack, ...]:
    selected = config.components or COMPONENTS
    explicit = config.components is not None
    on_demand_ids = {id(m) for _, m in on_demand}
    if explicit and "dit" in selected and not found.dits:
        raise ValueError(f"components selects 'dit' but {_owner(pipeline)} has no DiT")
    stacks: list[_Stack] = []
    if "dit" in selected:
        stacks += _dit_stacks(found, plan, on_demand_ids, problems)
    if "encoder" in selected:
        encoder_stacks = _encoder_stacks(found, plan, on_demand_ids, problems)
        if explicit and not encoder_stacks:
            raise ValueError(
                f"components selects 'encoder' but no encoder of {_owner(pipeline)} declares "
                "a block stack in OffloadPlan.encoder_block_attrs"
            )
        stacks += encoder_stacks
    owner = _check_block_overlap(stacks)
    _check_resident_modules(found, stacks, owner)
    if not stacks:
        if explicit:
            raise ValueError(f"mode='layer' found no block to stream in {_owner(pipeline)}")
        problems.note(f"mode='layer' found no block to stream in {_owner(pipeline)}")
    return _finish(stacks, config, par, plan, problems)


# ----------------------------------------------------------------------------- entry point
def resolve_offload_plan(
    pipeline: object, config: OffloadConfig, parallel: ParallelConfig | None = None
) -> ResolvedOffloadPlan:
    """Resolve the offload topology of ``pipeline`` under ``config`` (pure).

    See [Note: the resolver is pure] and [Note: explicit vs compatibility topology].

    Args:
        pipeline: any object whose attributes hold the components, or a bare ``nn.Module``
            that declares its blocks (then it is the one DiT, at path ``""``).
        config: what to offload and how.
        parallel: the job's parallel layout (weight groups); None is ``ParallelConfig()``.

    Returns:
        The :class:`ResolvedOffloadPlan`: components, block stacks (mode ``"layer"`` only),
        resident heads, transfers, weight groups, and the compatibility warnings.

    Raises:
        ValueError: a declaration problem under the explicit topology, or a topology no
            configuration can serve (block claimed twice or nested, resident module
            overlapping a block, too many resident layers).
        TypeError: a malformed declaration (wrong type).

    Example:
        >>> plan = resolve_offload_plan(pipe, OffloadConfig(mode="layer"))  # doctest: +SKIP
        >>> plan.all_block_paths[:2]  # doctest: +SKIP
        ('transformer.blocks.0', 'transformer.blocks.1')
    """
    par = ParallelConfig() if parallel is None else parallel
    explicit = config.components is not None
    problems = _Problems(strict=explicit and config.mode == "layer")
    plan = _offload_plan_of(pipeline)
    found = _discover(pipeline, plan, problems)
    on_demand = _on_demand(pipeline, plan, problems)
    stacks: tuple[BlockStack, ...] = ()
    if config.mode == "layer":
        stacks = _layer_stacks(pipeline, found, config, par, plan, on_demand, problems)
    return ResolvedOffloadPlan(
        mode=config.mode,
        explicit=explicit,
        dits=tuple(p for p, _ in found.dits),
        encoders=tuple(p for p, _ in found.encoders),
        vaes=tuple(p for p, _ in found.vaes),
        resident_modules=tuple(p for p, _ in found.resident),
        on_demand=tuple(p for p, _ in on_demand),
        stacks=stacks,
        warnings=tuple(problems.messages),
    )
