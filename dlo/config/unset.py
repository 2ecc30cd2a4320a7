"""Offload settings left unset, resolved for the device at enable.

Pure: nothing here reads a device or a process group.

[Note: automatic by default]
``OffloadConfig()`` leaves ``resident_layers`` and ``num_slots`` unset (None), and enable
resolves them for the device before anything else (:func:`for_device`): on a GPU both are
``"auto"``, so a user who sets nothing gets the policy of :mod:`dlo.plan.policy`, and where the whole DiT fits the
free device memory less the activation headroom every block is resident and nothing streams
(a FLUX.1-dev folder on one 80 GB GPU streamed every block under the old defaults, 2.4x
slower than ``resident_layers="auto"``, H100, 2026-12-05). A value given, ``"auto"``
included, is kept as given. A CPU device has no memory apart from the host, so there the
unset values are 0 resident blocks and 2 slots: the CPU lane streams every block, as the GPU
path it tests, with no probe at enable. A ``device_budget_gb`` makes an unset
``resident_layers`` ``"auto"`` on every device (the budget sizes the resident blocks); an
explicit count, 0 included, is kept under a budget too, which then only checks that it fits
and caps the allocator (before 2026-12-06 a budget turned an explicit 0 into ``"auto"``).

Ranks whose stacks exchange nothing at enable (every stack rank-local) and that leave only
unset fields to the policy decide alone, from their own measurements, with no store exchange
(:func:`dlo.backends.auto.policy_world`): such a job asked for no collective, so one rank's
failure at enable must not reach the others, and a rank's resident blocks are its own
business. An explicit ``"auto"``, a budget or an exchanging stack keeps the group-wide
decision ([Note: one set of numbers]). Ranks of one job must still ask alike: a rank-local
rank with an explicit ``"auto"`` waits in the request exchange for a peer that left the field
unset (and so decides alone) until ``collective_timeout_s``, as one with ``"auto"`` against
one with 0 always has.
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
    """``cfg`` with its unset fields resolved for ``device_type`` (:func:`device_values`);
    with a ``device_budget_gb`` an unset ``resident_layers`` is ``"auto"`` on any device (the
    budget sizes it). ``resident_layers`` is 0 where the config selects no DiT (resident
    blocks are DiT blocks). Values given, ``"auto"`` included, are kept."""
    values = device_values(device_type)
    if cfg.device_budget_gb is not None:
        values["resident_layers"] = "auto"
    return _filled(cfg, values)


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
