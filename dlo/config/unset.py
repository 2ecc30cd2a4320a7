"""Offload settings left unset, resolved for the device at enable.

``OffloadConfig`` leaves ``resident_layers`` and ``num_slots`` unset (None) by default; enable
resolves them here before anything else (see [Note: automatic by default] in
:mod:`dlo.plan.policy`). Pure: nothing here reads a device or a process group.
"""

from __future__ import annotations

from typing import Any

from dlo.config.offload import OffloadConfig

UNSET_FIELDS = ("resident_layers", "num_slots")
"""The fields whose default is "unset": the device decides."""

STREAMING_VALUES: dict[str, Any] = {"resident_layers": 0, "num_slots": 2}
"""Every block streamed through two slots: the unset fields on a CPU device (and the values
the legacy flags and the releases before the automatic defaults used)."""


def device_values(device_type: str) -> dict[str, Any]:
    """What the unset fields become on a ``device_type`` device: ``"auto"`` on a GPU (the
    policy decides), :data:`STREAMING_VALUES` on a CPU device (the host is the device)."""
    if device_type == "cpu":
        return dict(STREAMING_VALUES)
    return {n: "auto" for n in UNSET_FIELDS}


def unset_fields(cfg: OffloadConfig) -> frozenset[str]:
    """The fields of :data:`UNSET_FIELDS` that ``cfg`` leaves unset, for a layer config (a
    per-component ``resident_layers`` counts as set)."""
    if cfg.mode != "layer":
        return frozenset()
    dit = cfg.resident_layers_for("dit")
    return frozenset(
        n for n in UNSET_FIELDS if (dit if n == "resident_layers" else cfg.num_slots) is None
    )


def for_device(cfg: OffloadConfig, device_type: str) -> OffloadConfig:
    """``cfg`` with its unset fields resolved for ``device_type`` (:func:`device_values`).
    ``resident_layers`` is 0 where the config selects no DiT (resident blocks are DiT blocks).
    Values given, ``"auto"`` included, are kept."""
    return _filled(cfg, device_values(device_type))


def given_only(cfg: OffloadConfig) -> OffloadConfig:
    """``cfg`` with its unset fields at :data:`STREAMING_VALUES`: what the user asked for
    explicitly (automatic only where the user said so)."""
    return _filled(cfg, STREAMING_VALUES)


def _filled(cfg: OffloadConfig, values: dict[str, Any]) -> OffloadConfig:
    if cfg.mode != "layer":
        return cfg
    fills = {n: values[n] for n in UNSET_FIELDS if getattr(cfg, n) is None}
    if "resident_layers" in fills and cfg.components is not None and "dit" not in cfg.components:
        fills["resident_layers"] = 0
    return cfg.replace(**fills) if fills else cfg
