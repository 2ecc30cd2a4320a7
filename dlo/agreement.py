"""Startup agreement: one exchange that tells every rank whether every rank is ready.

[Note: startup agreement]
A collective whose size or order differs between ranks corrupts one rank and hangs or
crashes another. So before dlo issues its first weight collective, each rank prepares
everything locally (layouts, manifest, host shards, pinning, slots), catching its own
failure instead of raising, and then publishes one small record: whether it succeeded (and
why not), the digest of its manifest, the ranks of its weight groups, the blocks it could
not pin and its :data:`AGREED_SETTINGS` (each stack's resolved resident count among them). Every rank reads every record and applies the same pure :func:`decide`, so every
rank reaches the same verdict and either all proceed or all roll back locally and raise the
same error. No weight collective is issued before the verdict.

The exchange goes through the default process group's key-value store (a TCPStore under
torchrun) rather than a collective: waiting on keys has a timeout and tells exactly which
ranks never arrived, so a rank that never calls enable produces an error naming it instead
of a hang.
"""

from __future__ import annotations

import datetime
import itertools
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dlo.errors import OffloadError


@dataclass
class RankReport:
    """What one rank says at the agreement."""

    rank: int
    ok: bool
    error: str = ""
    digest: str = ""
    groups: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """Every group of every weight axis in use (the whole layout, not just this rank's)."""
    unpinned_blocks: tuple[str, ...] = ()
    host: str = ""
    symmetric_slots: bool = False
    """This rank's slots are in symmetric memory (it can take part in the copy-engine
    gather)."""
    settings: tuple[tuple[str, Any], ...] = ()
    """This rank's values of the :data:`AGREED_SETTINGS` (see :func:`settings_of`)."""


AGREED_SETTINGS = (
    "num_slots",
    "chunk_mb",
    "pin_memory",
    "pin_failure_policy",
    "verify_block_sequence",
    "nccl_max_ctas",
    "gather_engine",
    "gather_sync",
    "host_backing",
    "resident_layers",
)
"""Config fields that shape dlo's collectives or the verdict itself: ranks that differ in one
would issue different collectives (a symmetric buffer of another size, a gather engine the
peer does not join, a lock-step check the peer does not run, resident blocks gathered at
enable by one rank and streamed by the other) or reach different verdicts. The manifest
digest does not cover ``resident_layers`` (a resident block is laid out like a streamed one),
so it is compared here as the resolved count of every stack."""


def settings_of(config: Any, stacks: Sequence[Any] = ()) -> tuple[tuple[str, Any], ...]:
    """``(field, value)`` for each of :data:`AGREED_SETTINGS` of ``config`` (resolved).

    ``resident_layers`` is not the config field (which may be ``"auto"`` or set per
    component) but the resolved count of each of ``stacks`` (objects with ``container_path``
    and ``num_resident``, such as the plan's), as ``"path=count, ..."``.
    """
    resident = ", ".join(f"{s.container_path}={s.num_resident}" for s in stacks)
    return tuple(
        (name, resident if name == "resident_layers" else getattr(config, name))
        for name in AGREED_SETTINGS
    )


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str
    fallback_blocks: tuple[str, ...] = ()
    """Blocks every rank keeps pageable (``whole_block_fallback``)."""
    copy_gather: bool = False
    """Every rank uses the copy-engine gather (see :func:`gather_engine_verdict`)."""


def gather_engine_verdict(reports: list[RankReport], gather_engine: str) -> str | None:
    """Whether the job can use the copy-engine gather: ``"copy"``, ``"nccl"``, or an error
    message when ``gather_engine="copy"`` was asked for and cannot be had (pure)."""
    if gather_engine == "nccl" or len(reports) < 2:
        return "nccl"
    hosts = {r.host for r in reports}
    missing = [r.rank for r in reports if not r.symmetric_slots]
    if len(hosts) == 1 and not missing:
        return "copy"
    if gather_engine == "auto":
        return "nccl"
    where = (
        f"ranks span hosts {dict(sorted((r.rank, r.host) for r in reports))}"
        if len(hosts) > 1
        else f"rank(s) {missing} have no symmetric-memory slots"
    )
    return (
        f"gather_engine='copy' needs every rank on one node with symmetric-memory slots: "
        f"{where} (use gather_engine='auto' or 'nccl')"
    )


def decide(
    reports: list[RankReport], *, pin_failure_policy: str, gather_engine: str = "nccl"
) -> Verdict:
    """The group-wide verdict (pure; every rank computes the same one)."""
    failed = [r for r in reports if not r.ok]
    if failed:
        detail = "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
        return Verdict(False, f"enable failed on rank(s) {[r.rank for r in failed]}: {detail}")
    settings = [dict(r.settings) for r in reports]
    differ = [name for name in AGREED_SETTINGS if len({s.get(name) for s in settings}) > 1]
    if differ:
        detail = "; ".join(
            f"{name}: "
            + ", ".join(f"rank {r.rank}={s.get(name)!r}" for r, s in zip(reports, settings))
            for name in differ
        )
        return Verdict(False, f"ranks enabled dlo with different settings ({detail})")
    digests = {r.digest for r in reports}
    if len(digests) > 1:
        by_digest: dict[str, list[int]] = {}
        for r in reports:
            by_digest.setdefault(r.digest, []).append(r.rank)
        groups = sorted(by_digest.values())
        return Verdict(
            False,
            "ranks built different block manifests (model weights' names, shapes, dtypes or "
            f"order differ): ranks grouped by manifest {groups}",
        )
    layouts = {r.groups for r in reports}
    if len(layouts) > 1:
        return Verdict(
            False,
            "ranks disagree on dlo's weight groups: "
            + "; ".join(f"rank {r.rank}: {list(r.groups)}" for r in reports),
        )
    unpinned = sorted({b for r in reports for b in r.unpinned_blocks})
    if unpinned:
        ranks = [r.rank for r in reports if r.unpinned_blocks]
        if pin_failure_policy == "fail":
            return Verdict(
                False,
                f"pinning failed or exceeded pin_budget_gb on rank(s) {ranks} for blocks "
                f"{unpinned[:8]}{'...' if len(unpinned) > 8 else ''} (pin_failure_policy='fail';"
                " set 'whole_block_fallback' to keep them pageable)",
            )
    engine = gather_engine_verdict(reports, gather_engine)
    if engine not in ("copy", "nccl"):
        return Verdict(False, str(engine))
    return Verdict(True, "", tuple(unpinned), copy_gather=engine == "copy")


_GENERATIONS: dict[str, itertools.count[int]] = {}


def exchange(
    report: RankReport, *, rank: int, world_size: int, timeout_s: float
) -> list[RankReport]:
    """Publish ``report`` and read every rank's (see [Note: startup agreement]).

    Raises:
        OffloadError: some ranks did not publish within ``timeout_s`` (named).
    """
    return share(
        report,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        topic="agreement",
        what="enable agreement",
    )


def share(
    obj: Any, *, rank: int, world_size: int, timeout_s: float, topic: str, what: str
) -> list[Any]:
    """Publish one picklable ``obj`` through the default store and read every rank's, in
    rank order. Every rank calls it the same number of times per ``topic``.

    Raises:
        OffloadError: some ranks did not publish within ``timeout_s`` (named, with ``what``).
    """
    if world_size == 1:
        return [obj]
    store = _default_store()
    generation = next(_GENERATIONS.setdefault(topic, itertools.count()))
    prefix = f"dlo/{topic}/{generation}"
    store.set(f"{prefix}/{rank}", pickle.dumps(obj))
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        missing = [r for r, k in enumerate(keys) if not _has_key(store, k)]
        raise OffloadError(
            f"{what} timed out after {timeout_s:g}s: rank(s) {missing} never "
            "reached enable (every rank of the job must call enable with the same model)",
            rank=rank,
        ) from e
    return [pickle.loads(store.get(k)) for k in keys]


def _default_store() -> Any:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise OffloadError("this torch exposes no default store for dlo's startup agreement")
    return get()


def _has_key(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False
