"""The historical boolean offload flags (see [Note: config precedence] in
:mod:`dlo.config.offload`): their defaults, their checks, the config fields they select, and
whether a compact config given with them agrees.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dlo.config.fields import COMPONENTS, _check_bool, _check_int

# legacy flag -> default value (see [Note: config precedence])
LEGACY_FLAG_DEFAULTS: dict[str, Any] = {
    "enable_cpu_offload": False,
    "enable_layerwise_offload": False,
    "enable_distributed_layerwise_offload": False,
    "dlo_use_allgather": True,
    "dlo_resident_layers": 0,
    "dlo_num_slots": 2,
    "dlo_chunk_mb": 64,
    "pin_cpu_memory": True,
}


_LEGACY_DLO_TUNING = ("dlo_use_allgather", "dlo_resident_layers", "dlo_num_slots", "dlo_chunk_mb")


def legacy_kwargs(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~dlo.config.offload.OffloadConfig` fields the legacy ``flags`` select.

    Raises:
        ValueError / TypeError: unknown flag, wrong type, or DLO tuning without DLO.
    """
    unknown = sorted(set(flags) - set(LEGACY_FLAG_DEFAULTS))
    if unknown:
        raise ValueError(
            f"unknown legacy offload flags {unknown}; known: {sorted(LEGACY_FLAG_DEFAULTS)}"
        )
    f = {**LEGACY_FLAG_DEFAULTS, **flags}
    _check_types(f)
    if not f["enable_distributed_layerwise_offload"]:
        for name in _LEGACY_DLO_TUNING:
            if f[name] != LEGACY_FLAG_DEFAULTS[name]:
                raise ValueError(
                    f"{name}={f[name]!r} requires enable_distributed_layerwise_offload=True"
                )
    # the flags keep their historical meaning: every block streamed raw through 2 slots
    # unless the DLO tuning says otherwise (the automatic defaults are the compact config's)
    common = dict(
        pin_memory=f["pin_cpu_memory"],
        resident_layers=f["dlo_resident_layers"],
        num_slots=f["dlo_num_slots"],
        codec="none",
    )
    if f["enable_distributed_layerwise_offload"]:
        return dict(
            mode="layer",
            transfer="allgather" if f["dlo_use_allgather"] else "rank-local",
            chunk_mb=f["dlo_chunk_mb"],
            **common,
        )
    if f["enable_layerwise_offload"]:
        return dict(mode="layer", transfer="rank-local", **common)
    if f["enable_cpu_offload"]:
        return dict(mode="module", **common)
    return dict(mode="none", **common)


def _check_types(flags: Mapping[str, Any]) -> None:
    minimums = {"dlo_resident_layers": 0, "dlo_num_slots": 1, "dlo_chunk_mb": 1}
    for name, value in flags.items():
        if name in minimums:
            _check_int(name, value, minimum=minimums[name])
        else:
            _check_bool(name, value)


def seed_strategy(cfg: Any) -> str:
    """The historical strategy name a config amounts to (used to compare with legacy flags)."""
    if cfg.mode != "layer":
        return cfg.mode
    kinds = cfg.components or COMPONENTS
    resident = cfg.resident_layers_for("dit")
    if any(cfg.transfer_for(k) != "rank-local" for k in kinds) or resident not in (None, 0):
        return "distributed_layerwise"
    return "layerwise"


def check_legacy_agrees(
    cfg: Any, legacy: Mapping[str, Any], from_legacy: Callable[[], Any]
) -> None:
    """A compact config given together with legacy flags: they must select the same strategy
    and transfer, and leave every legacy DLO tuning at its default (``from_legacy()``
    builds the config the legacy flags alone select; called once the checks passed)."""
    _check_types(legacy)
    for name in _LEGACY_DLO_TUNING:
        if name in legacy and legacy[name] != LEGACY_FLAG_DEFAULTS[name]:
            raise ValueError(
                f"legacy tuning {name}={legacy[name]!r} conflicts with the compact config; "
                "set the compact field instead"
            )
    if "pin_cpu_memory" in legacy and legacy["pin_cpu_memory"] != cfg.pin_memory:
        raise ValueError(
            f"legacy pin_cpu_memory={legacy['pin_cpu_memory']!r} conflicts with "
            f"pin_memory={cfg.pin_memory!r}"
        )
    enabled = [
        k
        for k in (
            "enable_distributed_layerwise_offload",
            "enable_layerwise_offload",
            "enable_cpu_offload",
        )
        if legacy.get(k)
    ]
    if not enabled:
        return  # legacy keys at their defaults select nothing to conflict with
    legacy_cfg = from_legacy()
    legacy_strategy = seed_strategy(legacy_cfg)
    resident = cfg.resident_layers_for("dit")
    compact = (
        f"compact config (mode={cfg.mode!r}, transfer={cfg.transfer_for('dit')!r}, "
        f"resident_layers={'unset' if resident is None else repr(resident)})"
    )
    if legacy_strategy != seed_strategy(cfg):
        raise ValueError(
            f"{compact} selects {seed_strategy(cfg)!r} but legacy flag {enabled[0]}=True selects "
            f"{legacy_strategy!r}"
        )
    if cfg.mode == "layer" and legacy_cfg.transfer != cfg.transfer_for("dit"):
        # the same strategy with another transfer: name the transfers, not one strategy twice
        raise ValueError(
            f"{compact} has transfer={cfg.transfer_for('dit')!r} but legacy flag "
            f"{enabled[0]}=True (with dlo_use_allgather={legacy.get('dlo_use_allgather', True)!r})"
            f" selects transfer={legacy_cfg.transfer!r}"
        )
