"""What a pipeline or model declares to dlo: the discovery protocols, :class:`OffloadPlan`,
the declaration attribute names, and dotted-path checks and lookup.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)


DECLARATION_ATTRS = ("_dit_modules", "_encoder_modules", "_vae_modules", "_resident_modules")


BLOCKS_ATTRS = "_layerwise_offload_blocks_attrs"


BLOCKS_ATTR_DEPRECATED = "_layerwise_offload_blocks_attr"


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
    """Encoder path -> ordered block container attrs (``()`` streams none). An encoder not
    listed streams only when its own ``_no_split_modules`` (or ``_repeated_blocks``) finds its
    blocks and ``OffloadConfig.components`` names ``"encoder"``, or the policy streams it
    ([Note: encoders kept or streamed])."""
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
