"""Which modules of a pipeline are its components (DiTs, encoders, VAEs, resident modules).

Discovery, in order of preference:

1. The pipeline class declares :class:`SupportsComponentDiscovery` lists (``_dit_modules``,
   ``_encoder_modules``, ``_vae_modules``, ``_resident_modules``; dotted paths; missing lists
   are empty).
   Set on the instance, they win over the class's.
2. The pipeline is a bare ``nn.Module`` that declares its own blocks, whose class is in
   the adapter registry (:mod:`dlo.plan.adapters`), or that names the classes it repeats
   (``_repeated_blocks`` / ``_no_split_modules`` with a container of them,
   :mod:`dlo.plan.repeated`): one DiT at path ``""``.
3. The pipeline class is in the adapter registry: its component attribute names, keeping
   those that hold an ``nn.Module`` (optional components are ``None``), without a warning.
4. Any other diffusers ``DiffusionPipeline``: its registered components
   (``pipeline.components``) by the module that defines their class (diffusers
   transformers, UNets and ControlNets are DiTs, autoencoders VAEs, ``transformers``
   models encoders), without a warning.
5. A scan of well-known attribute names, which warns once per pipeline class.
6. A bare ``nn.Module`` where the scan finds no component is itself the one DiT (its
   blocks are then found by structure, or the error says what to declare).

A component is a module that is called: a container (``nn.ModuleList``, ``nn.ModuleDict``)
never runs, so no strategy can serve it (the scan skips them; a declared one is a problem,
naming the path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from dlo.plan.adapters import class_path, model_adapter, pipeline_adapter
from dlo.plan.declarations import (
    BLOCKS_ATTR_DEPRECATED,
    BLOCKS_ATTRS,
    DECLARATION_ATTRS,
    OffloadPlan,
    _path_tuple,
    get_by_path,
)
from dlo.plan.repeated import REPEATED_ATTRS, find_containers, is_container

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


# pipeline classes already told about the fallback scan, and compat messages already logged
_warned_scan_classes: set[type] = set()


_logged_messages: set[str] = set()


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
        if log:
            warn_once(message)


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process sees it."""
    if message not in _logged_messages:
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
    if what != "resident module" and is_container(obj):
        # only a declaration gets here (the scan skips containers), and no strategy can
        # serve it: an error under either topology
        raise ValueError(
            f"{what} {path!r} of {_owner(pipeline)} is a {type(obj).__name__}, a container "
            "that is never called: declare the module whose forward runs it as the component"
        )
    return obj


# ----------------------------------------------------------------------------- discovery
@dataclass
class _Components:
    dits: list[tuple[str, nn.Module]] = field(default_factory=list)
    encoders: list[tuple[str, nn.Module]] = field(default_factory=list)
    vaes: list[tuple[str, nn.Module]] = field(default_factory=list)
    resident: list[tuple[str, nn.Module]] = field(default_factory=list)


def _declaration(obj: object, name: str) -> tuple[str, ...] | None:
    """Declaration ``name`` of ``obj``: set on the instance, else on its class."""
    value = getattr(obj, name, None)
    if value is None:
        return None
    return _path_tuple(f"{type(obj).__name__}.{name}", value, allow_root=True)


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
    if (
        "" in plan.block_attrs
        or getattr(module, BLOCKS_ATTRS, None) is not None
        or getattr(module, BLOCKS_ATTR_DEPRECATED, None) is not None
        or model_adapter(type(module)) is not None
    ):
        return True
    found = find_containers(module)
    return found is not None and found.source in REPEATED_ATTRS


def _scan(pipeline: object, names: tuple[str, ...]) -> list[str]:
    """The names whose attribute holds a module that is not a container (see the module
    docstring)."""
    found = [(n, getattr(pipeline, n, None)) for n in names]
    return [n for n, m in found if isinstance(m, nn.Module) and not is_container(m)]


def _discovery_paths(
    pipeline: object, plan: OffloadPlan
) -> tuple[list[str], list[str], list[str], list[str]] | None:
    """Declared paths of DiTs, encoders, VAEs and resident modules; None: nothing declared."""
    cls = type(pipeline)
    declared = {name: _declaration(pipeline, name) for name in DECLARATION_ATTRS}
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
    return _diffusers_components(pipeline)


_DIFFUSION_PIPELINE = "diffusers.pipelines.pipeline_utils.DiffusionPipeline"


# the module prefixes that make a registered component a DiT, an encoder or a VAE (rule 4)
_KINDS = (
    ("dit", ("diffusers.models.transformers.", "diffusers.models.unets.")),
    ("dit", ("diffusers.models.controlnets.",)),
    ("vae", ("diffusers.models.autoencoders.",)),
    ("encoder", ("transformers.",)),
)


def _diffusers_components(
    pipeline: object,
) -> tuple[list[str], list[str], list[str], list[str]] | None:
    """Rule 4 of the module docstring; None when ``pipeline`` is no ``DiffusionPipeline``."""
    if not any(class_path(c) == _DIFFUSION_PIPELINE for c in type(pipeline).__mro__):
        return None
    components = getattr(pipeline, "components", None)
    if not isinstance(components, dict):
        return None
    out: dict[str, list[str]] = {"dit": [], "encoder": [], "vae": []}
    for name, module in components.items():
        if not isinstance(module, nn.Module) or is_container(module):
            continue
        where = type(module).__module__ + "."
        for kind, prefixes in _KINDS:
            if where.startswith(prefixes):
                out[kind].append(name)
                break
    return out["dit"], out["encoder"], out["vae"], []


def _scan_paths(
    pipeline: object, problems: _Problems
) -> tuple[list[str], list[str], list[str], list[str]]:
    """Well-known attribute names holding modules; warns once per pipeline class."""
    cls = type(pipeline)
    scanned: tuple[list[str], list[str], list[str], list[str]] = (
        _scan(pipeline, DIT_SCAN_NAMES),
        _scan(pipeline, ENCODER_SCAN_NAMES),
        _scan(pipeline, VAE_SCAN_NAMES),
        [],
    )
    if isinstance(pipeline, nn.Module) and not any(scanned):
        return [""], [], [], []  # a bare model: the one DiT (rule 5)
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
    return scanned


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
