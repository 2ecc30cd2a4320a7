"""Topology: which modules of a pipeline are components, and which blocks stream.

:func:`resolve_offload_plan` is the single topology entry point. Every backend calls it once
when ``enable()`` starts and consumes the :class:`ResolvedOffloadPlan` it returns (components,
block stacks, resident heads, transfers and weight groups); backends never re-read model
declarations.

[Note: the resolver is pure]
It moves no tensor, installs no hook, writes no attribute on any module or pipeline, reads no
process group and never looks at tensor data, so it works on models whose parameters live on
the ``meta`` device and CPU-only CI can test every decision. Multi-rank facts come from
:class:`~dlo.config.parallel.ParallelConfig`. Modules are compared by identity (``is``/``id``), never
by path, so aliases cannot hide a block claimed twice. Calling it twice on the same inputs
returns equal plans.

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
from dataclasses import dataclass
from typing import Any

from torch import nn

from dlo.config.fields import COMPONENTS, TRANSFERS
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.plan.declarations import OffloadPlan, get_by_path
from dlo.plan.discovery import (
    _Components,
    _discover,
    _offload_plan_of,
    _on_demand,
    _owner,
    _Problems,
)
from dlo.plan.stacks import (
    _check_block_overlap,
    _check_resident_modules,
    _dit_stacks,
    _encoder_stacks,
    _Stack,
)

logger = logging.getLogger(__name__)


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
    """Effective transfer: ``"rank-local"``, ``"allgather"``, ``"node-shared"`` or ``"auto"``."""
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
    codec: str = "none"
    """Codec of the stack's host blocks (see [Note: block codecs] in :mod:`dlo.codec.codecs`);
    ``"none"`` for an unset codec until enable resolves it for the device."""
    optional: bool = False
    """An encoder stack found from the encoder's own ``_no_split_modules`` while the policy
    decides residency (``components`` unset, ``resident_layers="auto"``): the policy keeps
    the encoder whole on the device unless the DiT needs its memory, and then streams it
    ([Note: encoders kept or streamed] in :mod:`dlo.plan.encoder_choice`)."""
    found_by: str = "declared"
    """How the container was found: ``"declared"`` (an ``OffloadPlan`` or the class's
    ``_layerwise_offload_blocks_attrs``), ``"adapter"`` (dlo's registry), the model's own
    ``"_repeated_blocks"`` or ``"_no_split_modules"``, or ``"structure"`` (a guess that
    warned; see :mod:`dlo.plan.repeated`)."""

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
    def streamed_components(self) -> tuple[str, ...]:
        """The components that own a stack, in stack order, each once."""
        return tuple(dict.fromkeys(s.component_path for s in self.stacks))

    @property
    def gathers(self) -> bool:
        """Some stack rebuilds its blocks with a collective (group size > 1)."""
        return any(s.group_size > 1 for s in self.stacks)

    @property
    def exchanges(self) -> bool:
        """Some stack's ranks talk at startup: it gathers, or shares a node's host copy."""
        return self.gathers or any(s.share_size > 1 for s in self.stacks)

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


# ----------------------------------------------------------------------------- policy
def _resident_counts(
    stacks: list[_Stack], config: OffloadConfig, plan: OffloadPlan, problems: _Problems
) -> list[int]:
    """Resident leading blocks per stack, counted over each DiT's stacks in container order."""
    requested = config.resident_layers_for("dit")
    # "auto" is decided at enable from measured memory (dlo.backends.auto), and unset (None)
    # resolved for the device there ([Note: automatic by default]); none until then
    wanted = 0 if requested in ("auto", None) else int(requested)
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


def transfer_groups(transfer: str, weight_axis: str, weight_size: int) -> dict[str, Any]:
    """A stack's weight group and share group for ``transfer`` on the weight axis
    ``(weight_axis, weight_size)``: AllGather (and a transfer still ``"auto"``) gathers on
    the axis; node-shared copies whole blocks (group of one) and shares the host copy among
    the axis's ranks on one node; rank-local uses neither."""
    local = {"share_axis": "local", "share_size": 1}
    if transfer == "node-shared":
        return {
            "group_axis": "local",
            "group_size": 1,
            "share_axis": weight_axis,
            "share_size": weight_size,
        }
    if transfer == "rank-local":
        return {"group_axis": "local", "group_size": 1, **local}
    return {"group_axis": weight_axis, "group_size": weight_size, **local}


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
        # an unset codec (None) is resolved for the device at enable ([Note: automatic by
        # default] in dlo.config.unset): none until then, as the resident count
        codec = config.codec_for(stack.component) if config.mode == "layer" else None
        built = BlockStack(
            component=stack.component,
            component_path=stack.component_path,
            container_path=stack.container_path,
            block_paths=tuple(p for p, _ in stack.blocks),
            transfer=transfer,
            num_resident=num_resident,
            codec=codec or "none",
            optional=stack.optional,
            found_by=stack.source,
            **transfer_groups(transfer, axis, size),
        )
        out.append(built)
        logger.debug(
            "stack %r: %d blocks (%d resident), transfer=%s, group=(%s, %d)",
            stack.container_path,
            len(stack.blocks),
            num_resident,
            transfer,
            built.group_axis,
            built.group_size,
        )
    return tuple(out)


def policy_chooses_encoders(config: OffloadConfig) -> bool:
    """The policy decides which found encoders stream: ``components`` is unset and the DiT's
    residency is automatic (``config`` resolved for the device: the defaults on a GPU, or a
    ``device_budget_gb``)."""
    return (
        config.mode == "layer"
        and config.components is None
        and config.resident_layers_for("dit") == "auto"
    )


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
        encoder_stacks = _encoder_stacks(
            found,
            plan,
            on_demand_ids,
            problems,
            selected=explicit,
            optional=policy_chooses_encoders(config),
        )
        if explicit and not encoder_stacks:
            raise ValueError(
                f"components selects 'encoder' but no encoder of {_owner(pipeline)} has a "
                "block stack (OffloadPlan.encoder_block_attrs, or the classes its "
                "_no_split_modules names)"
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
