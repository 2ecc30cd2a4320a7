"""The lock-step check: ranks of an AllGather group must load the same blocks in the same
order (see [Note: lock-step check] in the class docstring).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from dlo.errors import OffloadError
from dlo.platform.device import Platform
from dlo.runtime.collectives import all_gather_into

logger = logging.getLogger(__name__)


class SequenceCheck:
    """Checks that every rank of a group gathers the same block at the same time.

    [Note: lock-step check]
    AllGather rebuilds a block from the slices of every rank, so every rank must load the
    same block sequence. Before the chunk gathers of a block, the group gathers each rank's
    block index and slot index (two int64 per rank, on the comm stream; the copy-engine
    gather pulls from the peers' copies of the same slot). On a host-ordered device (CPU,
    gloo) the result is compared at once. On CUDA the comparison must not stall the host:
    the gathered indices are copied to pinned host memory with an event, and checked at a
    later load once the event has completed (non-blocking ``query``), so a divergence is
    reported, naming the block and what every rank was loading, one or two blocks after it
    happened. When the diverging blocks also differ in size, the gathers themselves no
    longer match and only the collective timeout ends the run (see docs/design.md).
    """

    def __init__(
        self,
        platform: Platform,
        group: Any,
        group_rank: int,
        group_size: int,
        names: Sequence[str],
        *,
        depth: int = 64,
    ) -> None:
        self.platform = platform
        self.group = group
        self.group_rank = group_rank
        self.names = list(names)
        dev = platform.device
        self._mine = torch.zeros(2, dtype=torch.int64, device=dev)
        self._free: deque[tuple[torch.Tensor, torch.Tensor, Any]] = deque()
        self._pending: deque[
            tuple[torch.Tensor, torch.Tensor, Any, tuple[int, int], str | None]
        ] = deque()
        pin = platform.has_streams
        for _ in range(depth if pin else 1):
            gathered = torch.zeros(2 * group_size, dtype=torch.int64, device=dev)
            host = torch.zeros(2 * group_size, dtype=torch.int64, pin_memory=pin)
            self._free.append((gathered, host, platform.new_event()))

    def issue(self, index: int, stream: Any, *, slot: int = -1) -> None:
        """Gather ``(index, slot)`` from every rank on ``stream`` (the comm stream)."""
        self._gather((index, slot), stream, None)

    def agree(self, value: int, stream: Any, describe: str) -> None:
        """Gather ``value`` (an int64 digest) from every rank on ``stream`` and compare it
        like a block index; a rank that differs raises an ``OffloadError`` with
        ``describe`` (what this rank has; a string, so a pending check references no block)
        in it. Used once per learned execution order
        (see [Note: prefetch chain] in :mod:`dlo.runtime.chain`)."""
        self._gather((value, -2), stream, describe)

    def _gather(self, expected: tuple[int, int], stream: Any, describe: str | None) -> None:
        gathered, host, event = self.take()
        with self.platform.stream(stream):
            self._mine[0].fill_(expected[0])
            self._mine[1].fill_(expected[1])
            all_gather_into(gathered, self._mine, self.group)
            host.copy_(gathered, non_blocking=True)
            event.record(stream)
        self._pending.append((gathered, host, event, expected, describe))
        if not self.platform.has_streams:
            self.poll()

    def read(
        self, tags: torch.Tensor, stream: Any, index: int, *, slot: int, entry: Any = None
    ) -> None:
        """Compare against tags every rank already placed on this device (2 int64 per rank,
        ``(block, slot)``; the copy-engine gather's [Note: lock-step tags]): a copy to
        pinned host memory on ``stream``, checked like a gathered result. ``entry``: one
        :meth:`take` returned before the load enqueued anything (so a divergence found
        while taking it is raised before any barrier of this block is on a stream)."""
        gathered, host, event = entry if entry is not None else self.take()
        with self.platform.stream(stream):
            host.copy_(tags, non_blocking=True)
            event.record(stream)
        self._pending.append((gathered, host, event, (index, slot), None))

    def take(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """A free (device, pinned host, event) entry, checking finished ones first (and
        waiting for the oldest when all ``depth`` are in flight)."""
        self.poll()
        if not self._free:
            self.poll(block_host=True)
        return self._free.popleft()

    def poll(self, *, block_host: bool = False) -> None:
        """Check every completed gather (the oldest one waits if ``block_host``)."""
        while self._pending:
            gathered, host, event, (index, slot), describe = self._pending[0]
            if block_host:
                event.synchronize()
                block_host = False
            elif not event.query():
                return
            self._pending.popleft()
            self._free.append((gathered, host, event))
            flat = host.tolist()
            seen = list(zip(flat[0::2], flat[1::2]))
            if describe is not None and any(v != (index, slot) for v in seen):
                differ = [r for r, v in enumerate(seen) if v != (index, slot)]
                raise OffloadError(
                    "ranks of an AllGather group ran a component's blocks in different orders "
                    f"on its first forward (ranks {differ} differ from rank {self.group_rank}, "
                    f"which ran {describe}); they must run the same block sequence",
                    rank=self.group_rank,
                )
            if any(v != (index, slot) for v in seen):
                loading = ", ".join(
                    f"rank {r}: {self.names[v] if 0 <= v < len(self.names) else v} (slot {sl})"
                    for r, (v, sl) in enumerate(seen)
                )
                raise OffloadError(
                    "ranks of an AllGather group loaded different blocks or slots (they must "
                    f"run the same block sequence in lock step): {loading}",
                    rank=self.group_rank,
                    block=self.names[index],
                )
