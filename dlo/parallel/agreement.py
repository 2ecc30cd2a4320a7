"""Startup agreement: one exchange that tells every rank whether every rank is ready.

[Note: startup agreement]
A collective whose size or order differs between ranks corrupts one rank and hangs or
crashes another. So before dlo issues its first weight collective, each rank prepares
everything locally (layouts, manifest, host shards, pinning, slots), catching its own
failure instead of raising, and then publishes one small record: whether it succeeded (and
why not), the digest of its manifest, the ranks of its weight groups, the blocks it could
not pin, its :data:`AGREED_SETTINGS` (each stack's resolved resident count among them) and
a content fingerprint of every block it gathers or shares (:class:`BlockPrint`). Every rank
reads every record and applies the same pure :func:`decide`, so every rank reaches the same
verdict and either all proceed or all roll back locally and raise the same error. No weight
collective is issued before the verdict.

The manifest digest covers names, shapes, dtypes and layout, not values: two copies of one
architecture with different weights (another seed, a stale copy on one node, a fine-tuned
or LoRA-fused copy) have equal manifests, and an AllGather (or a node's shared copy) would
silently mix them into every rank's blocks. So the ranks that exchange a block's bytes (its
weight group; for a node-shared block, the group's ranks with this rank's host name) must
also agree on its fingerprint (:func:`weights_verdict`; what a fingerprint covers and what
it can miss is [Note: weight fingerprints] in :mod:`dlo.host.fingerprint`). Ranks that never
exchange a block (other weight groups, rank-local stacks) are not compared. A mismatch is a
:class:`WeightsDifferError` on every rank, naming each rank's source of the first block
that differs.

The exchange goes through the default process group's key-value store (a TCPStore under
torchrun) rather than a collective: waiting on keys has a timeout and tells exactly which
ranks never arrived, so a rank that never calls enable produces an error naming it instead
of a hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlo.errors import OffloadError
from dlo.parallel.store import share


class WeightsDifferError(OffloadError, ValueError):
    """Ranks that exchange a block's bytes hold different weights for it (see [Note: startup
    agreement]). An :class:`~dlo.OffloadError` raised by the vote, and a ``ValueError``: the
    job's input is wrong (one rank loaded other files), not the runtime."""


@dataclass(frozen=True)
class BlockPrint:
    """One rank's content fingerprint of a block it gathers or shares (see
    :mod:`dlo.host.fingerprint`)."""

    block: str
    peers: tuple[int, ...]
    """The ranks that exchange this block's bytes with this rank: its weight group."""
    node: bool
    """Node-shared: only the ``peers`` with this rank's host name share its bytes."""
    digest: str
    source: str
    """Where this rank's bytes of the block come from, for the error: its files, or an
    in-memory model, and how they were fingerprinted."""


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
    token: str = ""
    """A random name for this rank's node-shared host copy (the first sharer's names the
    file; see [Note: node-shared host copy])."""
    symmetric_slots: bool = False
    """This rank's slots are in symmetric memory (it can take part in the copy-engine
    gather)."""
    settings: tuple[tuple[str, Any], ...] = ()
    """This rank's values of the :data:`AGREED_SETTINGS` (see :func:`settings_of`)."""
    weights: tuple[BlockPrint, ...] = ()
    """The fingerprint of every block this rank gathers or shares, in manifest order."""


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
    "transfer",
    "codec",
)
"""Config fields that shape dlo's collectives or the verdict itself: ranks that differ in one
would issue different collectives (a symmetric buffer of another size, a gather engine the
peer does not join, a lock-step check the peer does not run, resident blocks gathered at
enable by one rank and streamed by the other) or reach different verdicts. The manifest
digest does not cover ``resident_layers`` (a resident block is laid out like a streamed one),
so it is compared here as the resolved count of every stack; nor a stack's ``transfer`` where
the group size is 1 either way (rank-local and node-shared lay a block out alike, but one
rank packing a node's shared copy with a peer that streams privately, or with another list of
shared blocks, would fill it wrong), compared as every stack's resolved transfer; and each
stack's codec (an encoded block's layout is this process's own; ranks must agree on it)."""


def settings_of(config: Any, stacks: Sequence[Any] = ()) -> tuple[tuple[str, Any], ...]:
    """``(field, value)`` for each of :data:`AGREED_SETTINGS` of ``config`` (resolved).

    ``resident_layers`` and ``transfer`` are not the config fields (which may be ``"auto"``
    or set per component) but the resolved values of each of ``stacks`` (objects with
    ``container_path``, ``num_resident``, ``transfer`` and ``share_axis``, such as the
    plan's), as ``"path=count, ..."`` and ``"path=transfer, ..."`` (node-shared with its
    axis).
    """
    resolved = {
        "resident_layers": ", ".join(f"{s.container_path}={s.num_resident}" for s in stacks),
        "transfer": ", ".join(
            f"{s.container_path}={s.transfer}"
            + (f"@{s.share_axis}" if s.transfer == "node-shared" else "")
            for s in stacks
        ),
        "codec": ", ".join(f"{s.container_path}={getattr(s, 'codec', 'none')}" for s in stacks),
    }
    return tuple(
        (name, resolved[name] if name in resolved else getattr(config, name))
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
    error: type[OffloadError] = OffloadError
    """What a refusal raises (:class:`WeightsDifferError` for different weights)."""


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


def pin_verdict(
    unpinned_by_rank: Sequence[tuple[int, Sequence[str]]], pin_failure_policy: str
) -> tuple[tuple[str, ...], str]:
    """Blocks every rank keeps pageable (the union, for equal timing) and, under
    ``pin_failure_policy="fail"``, the refusal when there are any ("" when none)."""
    unpinned = tuple(sorted({b for _, blocks in unpinned_by_rank for b in blocks}))
    if not unpinned or pin_failure_policy != "fail":
        return unpinned, ""
    ranks = [r for r, blocks in unpinned_by_rank if blocks]
    return unpinned, (
        f"pinning failed or exceeded pin_budget_gb on rank(s) {ranks} for blocks "
        f"{list(unpinned[:8])}{'...' if len(unpinned) > 8 else ''} (pin_failure_policy='fail';"
        " set 'whole_block_fallback' to keep them pageable)"
    )


def weights_verdict(reports: Sequence[RankReport]) -> str:
    """The refusal when ranks that exchange a block's bytes report different fingerprints
    for it ("" when every such set agrees): the first block that differs in manifest order,
    each rank of its set with its source, and how many blocks differ (pure).

    A block's set is the reporting rank's ``peers`` (narrowed to its host name for a
    node-shared block); each set is compared once, from its lowest rank.
    """
    host = {r.rank: r.host for r in reports}
    prints = {r.rank: {p.block: p for p in r.weights} for r in reports}
    differ: list[tuple[int, str, tuple[int, ...]]] = []
    for r in reports:
        for i, p in enumerate(r.weights):
            peers = tuple(
                q for q in p.peers if q in prints and (not p.node or host[q] == host[r.rank])
            )
            if not peers or r.rank != min(peers):
                continue
            seen = {prints[q][p.block].digest if p.block in prints[q] else "" for q in peers}
            if len(seen) > 1:
                differ.append((i, p.block, peers))
    if not differ:
        return ""
    _, block, ranks = min(differ)
    by_digest: dict[str, list[int]] = {}
    for q in ranks:
        by_digest.setdefault(prints[q][block].digest if block in prints[q] else "", []).append(q)
    others = len({b for _, b, _ in differ}) - 1
    detail = "; ".join(
        f"rank {q}: "
        + (prints[q][block].source if block in prints[q] else "no fingerprint for this block")
        for q in ranks
    )
    return (
        "ranks that exchange a block's bytes hold different weights for it (same "
        f"architecture, different contents): block {block!r} differs between ranks "
        f"{' and '.join(str(g) for g in sorted(by_digest.values()))}"
        f"{f' (and {others} more blocks)' if others else ''}; {detail}. Every rank of a "
        "weight group must load the same weights: streamed together, a stale or different "
        "copy would mix into every rank's blocks"
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
    mixed = weights_verdict(reports)
    if mixed:
        return Verdict(False, mixed, error=WeightsDifferError)
    unpinned, refused = pin_verdict(
        [(r.rank, r.unpinned_blocks) for r in reports], pin_failure_policy
    )
    if refused:
        return Verdict(False, refused)
    engine = gather_engine_verdict(reports, gather_engine)
    if engine not in ("copy", "nccl"):
        return Verdict(False, str(engine))
    return Verdict(True, "", tuple(unpinned), copy_gather=engine == "copy")


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
        types=(RankReport, BlockPrint),
    )
