"""Offload settings left unset, resolved for the device at enable.

Pure: nothing here reads a device or a process group.

[Note: automatic by default]
``OffloadConfig()`` leaves ``resident_layers``, ``num_slots`` and ``codec`` unset (None), and
enable resolves them for the device before anything else (:func:`for_device`): on a GPU all
three are ``"auto"``, so a user who sets nothing gets the policy of :mod:`dlo.plan.policy`:
where the whole DiT fits the free device memory less the activation headroom every block is
resident and nothing streams (a FLUX.1-dev folder on one 80 GB GPU streamed every block
under the old defaults, 2.4x slower than ``resident_layers="auto"``, H100, 2026-12-05), and
a re-planned DiT ring whose forwards wait on their copies has its codec turned on between
forwards ([Note: codec turned on by measurement] in :mod:`dlo.runtime.late_codec`; at enable
too where ``block_compute_ms`` is given; never where the platform has no codec, nvCOMP not
installed). A value given, ``"auto"`` and ``"none"`` included, is kept as given: an explicit
``codec="none"`` never encodes. A CPU device has no memory apart from the host, so there the
unset values are 0 resident blocks, 2 slots and no codec: the CPU lane streams every block
raw, as the GPU path it tests, with no probe at enable. A ``device_budget_gb`` makes an
unset ``resident_layers`` ``"auto"`` on every device (the budget sizes the resident blocks);
an explicit count, 0 included, is kept under a budget too, which then only checks that it
fits and caps the allocator (before 2026-12-06 a budget turned an explicit 0 into
``"auto"``). Until 2026-12-07 the codec was ``"none"`` unless given.

Ranks whose stacks exchange nothing at enable (every stack rank-local) and that leave only
unset fields to the policy decide alone, from their own measurements, with no store exchange
(:func:`dlo.backends.auto.policy_world`): such a job asked for no collective, so one rank's
failure at enable must not reach the others, and a rank's resident blocks are its own
business, as is its codec (chosen at enable from its own numbers, or turned on by
measurement from its own forwards). An explicit ``"auto"``, a budget or an exchanging stack
keeps the group-wide decision ([Note: one set of numbers]). Ranks of one job must still ask
alike: a rank-local rank with an explicit ``"auto"`` waits in the request exchange for a
peer that left the field unset (and so decides alone) until ``collective_timeout_s``, as one
with ``"auto"`` against one with 0 always has.
"""

from __future__ import annotations

from typing import Any

from dlo.config.fields import COMPONENTS
from dlo.config.offload import OffloadConfig

UNSET_FIELDS = ("resident_layers", "num_slots", "codec")
"""The fields whose default is "unset": the device decides."""

STREAMING_VALUES: dict[str, Any] = {"resident_layers": 0, "num_slots": 2, "codec": "none"}
"""Every block streamed raw through two slots: the unset fields on a CPU device (and the
values the legacy flags and the releases before the automatic defaults used)."""


def device_values(device_type: str) -> dict[str, Any]:
    """What the unset fields become on a ``device_type`` device: ``"auto"`` on a GPU (the
    policy decides), :data:`STREAMING_VALUES` on a CPU device (the host is the device)."""
    if device_type == "cpu":
        return dict(STREAMING_VALUES)
    return {n: "auto" for n in UNSET_FIELDS}


def unset_fields(cfg: OffloadConfig) -> frozenset[str]:
    """The fields of :data:`UNSET_FIELDS` that ``cfg`` leaves unset, for a layer config (a
    per-component ``resident_layers`` or ``codec`` counts as set)."""
    if cfg.mode != "layer":
        return frozenset()
    given = {
        "resident_layers": cfg.resident_layers_for("dit"),
        "num_slots": cfg.num_slots,
        "codec": cfg.codec if not any(o.codec for o in cfg.layer_options.values()) else "set",
    }
    return frozenset(n for n in UNSET_FIELDS if given[n] is None)


def for_device(cfg: OffloadConfig, device_type: str) -> OffloadConfig:
    """``cfg`` with its unset fields resolved for ``device_type`` (:func:`device_values`);
    with a ``device_budget_gb`` an unset ``resident_layers`` is ``"auto"`` on any device (the
    budget sizes it). ``resident_layers`` is 0 where the config selects no DiT (resident
    blocks are DiT blocks). An unset codec is ``"auto"`` at enable only where the policy runs
    anyway or has ``block_compute_ms`` to decide with; elsewhere enable's answer could only be
    ``"none"``, and a config whose other fields are all given must not run the policy for it
    (it would probe, and decide the transfer of a stack the user set: a node-shared stack
    with a host budget was made rank-local instead of refused); the late codec still follows
    it (:func:`codec_by_measurement`). Values given, ``"auto"`` included, are kept."""
    values = device_values(device_type)
    if cfg.device_budget_gb is not None:
        values["resident_layers"] = "auto"
    if (
        values["codec"] == "auto"
        and cfg.block_compute_ms is None
        and not is_automatic(_filled(cfg, {**values, "codec": "none"}))  # only the codec is
    ):
        values["codec"] = "none"
    return _filled(cfg, values)


def codec_by_measurement(requested: OffloadConfig, device_type: str) -> bool:
    """Whether a DiT's codec may be turned on by measurement between forwards ([Note: codec
    turned on by measurement] in :mod:`dlo.runtime.late_codec`): asked as ``"auto"``, or left
    unset on a GPU; never an explicit other value, nor unset on a CPU device."""
    codec = requested.codec_for("dit")
    return codec == "auto" or (codec is None and device_values(device_type)["codec"] == "auto")


def is_automatic(cfg: OffloadConfig) -> bool:
    """Whether ``cfg`` (its unset fields resolved) leaves anything for the policy to decide."""
    return (
        any(cfg.transfer_for(k) == "auto" for k in COMPONENTS)
        or cfg.resident_layers_for("dit") == "auto"
        or cfg.num_slots == "auto"
        or cfg.device_budget_gb is not None
        or any(cfg.codec_for(k) == "auto" for k in COMPONENTS)
    )


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
