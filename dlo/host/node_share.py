"""Node-shared host copy: the ranks of a weight group on one node hold one copy of its blocks.

[Note: node-shared host copy]
With AllGather each rank holds 1/G of every block, but every forward also moves (G-1)/G of
the bytes between GPUs; at 16384 tokens on power-limited H200s that peer traffic lowers the
SM clock of the compute it overlaps (docs/benchmarks.md, fourth GPU session: the GEMMs and
attention 4.5% slower). Rank-local moves no peer bytes, but each rank holds the whole model.
``transfer="node-shared"`` keeps the rank-local transport (whole blocks over each rank's own
host-to-device link, group size 1, no collective) with one host copy per node:

1. after the startup agreement, which carries every rank's host name and a random token, the
   *sharers* are the ranks of this rank's weight group (the AllGather group's axis, never
   TP) with this rank's host name; the first sharer creates an anonymous shared-memory file
   (``memfd_create("dlo-<token>")``, mode 0600) and one store exchange carries its
   ``/proc/<pid>/fd/<n>`` to the others. No directory holds it: no other user can plant or
   pre-empt a name (the named ``/dev/shm/dlo-<token>`` of before could be planted as a
   symlink or a file open to all), and nothing survives a kill of any subset of ranks at any
   moment, since the memory goes with the last process holding it;
2. each sharer checks the offer (a ``/proc`` path whose link names dlo's memfd: a writer of
   the store could offer another file) and maps it (owner and mode checked on the open
   descriptor; sized with ``posix_fallocate``, so a full memory fails here, not with SIGBUS
   at a write), writes its token into its slot of the header page, page-locks its streamed
   blocks with its own registration (each rank charged 1/L of a block against
   ``pin_budget_gb``), and packs the blocks at positions ``k % L == its index``; with a
   codec each sharer encoded those blocks before step 1 and one exchange carried every piece
   table (checked before it sizes anything), so the copy is sized in encoded bytes and
   holds one encoded copy per node (``HostCodec.encode_shared`` in
   :mod:`dlo.backends.layer_codec`);
3. one store exchange carries every rank's outcome and unpinned blocks: a failure anywhere is
   the same error on every rank, each rolling back locally (unregister, unmap, close);
   blocks left pageable anywhere are kept pageable everywhere (``pin_failure_policy``);
4. every sharer checks that the header holds every sharer's token, and a second exchange
   shares the verdicts: ranks with one host name that do not map one memory (containers on
   different machines with one host name, other PID namespaces) fail on every rank instead
   of each streaming a copy others filled only in part;
5. the first sharer closes its descriptor (every sharer has the memory mapped); only then
   are the original tensors released.

Trust is the same as AllGather's: the sharers' weights must be equal, since each packs only
some blocks of the one copy. The agreement compares each block's content fingerprint across
the sharers (the share group's ranks of one host name) before anything is packed, and a
mismatch fails every rank naming each one's source ([Note: weight fingerprints] in
:mod:`dlo.host.fingerprint`). A block's in-place write into its streamed tensors is
refused (the other sharers stream the same bytes; [Note: writes into streamed tensors]).
Pages live on the NUMA node of the rank that packed them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dlo import faults
from dlo.errors import OffloadError
from dlo.host.packer import pack_block
from dlo.host.region import HostRegion
from dlo.journal import Journal
from dlo.parallel.agreement import RankReport, pin_verdict
from dlo.parallel.store import share
from dlo.plan.layout import BlockLayout
from dlo.platform.device import Platform


@dataclass
class SharedBlock:
    """One block of the shared copy, as the caller holds it."""

    name: str
    layout: BlockLayout
    tensors: list[torch.Tensor]
    streamed: bool
    """Pinned (streamed every forward); a resident block crosses the link once."""
    nbytes: int | None = None
    """Its bytes in the shared copy (None: its raw shard, ``layout.shard_nbytes``)."""
    fill: Callable[[torch.Tensor], None] | None = None
    """Writes its bytes into its view of the copy (None: packs ``tensors``); called only on
    the sharer that packs it. With a codec the caller encoded it and exchanged the sizes
    before (see :mod:`dlo.backends.layer_host`)."""

    @property
    def copy_nbytes(self) -> int:
        return self.layout.shard_nbytes if self.nbytes is None else self.nbytes


def packer(position: int, count: int) -> int:
    """The index, among ``count`` sharers, of the one that packs (and, with a codec,
    encodes) the block at ``position`` of the shared copy: ``k % L`` (step 2)."""
    return position % count


def sharers(reports: Sequence[RankReport], group: Sequence[int], rank: int) -> list[int]:
    """The ranks of ``group`` on this rank's node (by host name, from every rank's
    ``reports``, indexed by rank), in group order."""
    host = reports[rank].host
    return [r for r in group if reports[r].host == host]


def share_host(
    blocks: Sequence[SharedBlock],
    *,
    tokens: Sequence[str],
    members: Sequence[int],
    rank: int,
    world_size: int,
    platform: Platform,
    pin: bool,
    budget_nbytes: int | None,
    pin_failure_policy: str,
    timeout_s: float,
    journal: Journal,
) -> tuple[HostRegion, tuple[str, ...]]:
    """Build this node's shared copy of ``blocks`` (steps 2-5 of the note); ``tokens`` are
    the ``members``' tokens (the sharers, in group order).

    Returns:
        The region (block ``i`` of ``blocks`` at index ``i``) and the blocks every rank keeps
        pageable (still pinned here: the caller unpins them).

    Raises:
        OffloadError: a rank failed (named, the same message on every rank), or pinning
            failed under ``pin_failure_policy="fail"``.
    """
    index, count = members.index(rank), len(members)
    region: HostRegion | None = None
    owner = _Descriptor()

    def offer() -> str:
        if index != 0:
            return ""
        # step 1: the first sharer creates the memory, named by nothing
        owner.fd = create_memfd(f"dlo-{tokens[0]}")
        journal.record("shared host memory", owner.close)
        return f"/proc/{os.getpid()}/fd/{owner.fd}"

    offers = share_step(
        offer,
        "",
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        topic="host-share-memory",
        what="node-shared host memory",
    )
    path = offers[members[0] if world_size > 1 else 0]  # alone: its own offer

    def fill() -> tuple[str, ...]:  # steps 2 and 3: map, mark, pin, pack
        nonlocal region
        check_offer(path, f"dlo-{tokens[0]}")
        region = HostRegion(
            [b.copy_nbytes for b in blocks],
            path=path,
            share_ranks=count,
            header_nbytes=count * _MARK_NBYTES,
        )
        journal.record("shared host region", region.close)
        _slot(region, index).copy_(_mark(tokens[index]))
        unpinned: tuple[str, ...] = ()
        if pin:
            report = region.pin(
                platform,
                budget_nbytes=budget_nbytes,
                blocks=[i for i, b in enumerate(blocks) if b.streamed],
            )
            unpinned = tuple(blocks[i].name for i in report.unpinned_blocks)
        for i, b in enumerate(blocks):
            if packer(i, count) == index:
                faults.check("host_fill")
                if b.fill is not None:
                    b.fill(region.view(i))
                else:
                    pack_block(region.view(i), b.layout, 0, b.tensors)
        return unpinned

    replies = share_step(
        fill,
        (),
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        topic="host-share",
        what="node-shared host copy",
    )
    assert region is not None
    one_file = all(torch.equal(_slot(region, i), _mark(t)) for i, t in enumerate(tokens))
    seen = share(
        one_file,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        topic="host-share-marks",
        what="node-shared host copy check",
    )
    if not all(seen):
        raise OffloadError(
            f"rank(s) {[r for r, ok in enumerate(seen) if not ok]} do not map the node-shared "
            "memory of the ranks of their host name (containers on different machines with "
            "one host name?): use transfer='allgather'",
            rank=rank,
        )
    owner.close()  # every sharer has it mapped (step 5): the mappings keep it
    fallback, refused = pin_verdict(list(enumerate(replies)), pin_failure_policy)
    if refused:
        raise OffloadError(refused, rank=rank)
    return region, fallback


_MARK_NBYTES = 64
"""One sharer's slot in the header: its token, zero-padded."""


def _slot(region: HostRegion, index: int) -> torch.Tensor:
    """Sharer ``index``'s mark in the region's header."""
    return region.header()[index * _MARK_NBYTES : (index + 1) * _MARK_NBYTES]


def _mark(token: str) -> torch.Tensor:
    raw = token.encode()[:_MARK_NBYTES].ljust(_MARK_NBYTES, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def share_step(
    step: Callable[[], Any],
    empty: Any,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    topic: str,
    what: str,
    types: Sequence[type] = (),
) -> list[Any]:
    """Run this rank's part of a step of the node-shared copy and exchange the outcomes:
    a failure anywhere is one error on every rank (naming every failed rank; alone, the
    exception itself). Returns every rank's value of ``step`` (``empty`` where it failed),
    by rank; alone, ``[its own]``."""
    error, value = "", empty
    try:
        value = step()
    except Exception as e:
        if world_size == 1:
            raise
        error = f"{type(e).__name__}: {e}"
    replies = share(
        (error, value),
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        topic=topic,
        what=what,
        types=types,
    )
    _raise_failed([(r, e) for r, (e, _) in enumerate(replies) if e], rank)
    return [v for _, v in replies]


def _raise_failed(failed: Sequence[tuple[int, str]], rank: int) -> None:
    """One error on every rank naming every failed rank (``(rank, message)``, from an
    exchange of outcomes)."""
    if failed:
        raise OffloadError(
            f"the node-shared host copy failed on rank(s) {[r for r, _ in failed]}: "
            + "; ".join(f"rank {r}: {e}" for r, e in failed),
            rank=rank,
        )


class _Descriptor:
    """The first sharer's descriptor of the memory, closed once (a second close, by a
    rollback after step 5, must not close a descriptor number reused since)."""

    fd: int | None = None

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def create_memfd(name: str) -> int:
    """An anonymous shared-memory file (``memfd_create``), mode 0600: no directory holds
    it, so no one can plant or pre-empt it, and it is gone when the last process holding it
    (an open descriptor or a mapping) exits, however it exits."""
    make = getattr(os, "memfd_create", None)
    if make is None:
        raise OffloadError("transfer='node-shared' needs Linux's memfd_create")
    fd = int(make(name, getattr(os, "MFD_CLOEXEC", 1)))
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_offer(path: str, name: str) -> None:
    """Refuse an offered ``/proc/<pid>/fd/<n>`` that is not the first sharer's memory: it
    must name a memfd called ``name`` (a store writer could offer another process's file).
    Ownership and mode are checked again when it is opened (``HostRegion``)."""
    parts = path.split("/")
    if len(parts) != 5 or parts[:2] != ["", "proc"] or parts[3] != "fd":
        raise OffloadError(f"node-shared memory offered as {path!r}: not a /proc/PID/fd/N path")
    try:
        target = os.readlink(path)
    except OSError as e:
        raise OffloadError(
            f"node-shared memory {path}: {e.strerror} (the first sharer is not in this "
            "rank's process namespace, or exited)"
        ) from None
    if target != f"/memfd:{name} (deleted)":
        raise OffloadError(f"node-shared memory {path} is {target!r}, not dlo's memfd {name!r}")
