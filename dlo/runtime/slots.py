"""Device slots: the preallocated device buffers streamed blocks are loaded into.

``num_slots`` buffers, each sized to the largest padded block of every ring, allocated once
at enable and shared by every ring of the pipeline; the steady state allocates nothing.
Each slot carries two events (see [Note: chunk pipeline] in :mod:`dlo.runtime.transport`):
``ready`` (its block is whole; recorded by the transport's writer stream, waited on by the
compute stream) and ``free`` (the last reader is done; recorded by the compute stream,
waited on by the copy stream before the next load).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dlo import faults
from dlo.platform.device import Platform
from dlo.runtime.ce_gather import FLAG_NBYTES, symmetric_empty


@dataclass(eq=False)
class Slot:
    index: int
    buffer: torch.Tensor
    ready: Any
    free: Any
    owner: Any = None
    """The block occupying the slot (loading, loaded or running), or None."""
    stamp: int = 0
    """When the owner was assigned or last ran (for least-recently-used eviction)."""
    used: bool = False
    """The owner ran since its load (its ``free`` event is the compute stream's, recorded at
    its exit; see [Note: kept after exit] in :mod:`dlo.runtime.ring`)."""


@dataclass(eq=False)
class SlotPool:
    platform: Platform
    slots: list[Slot] = field(default_factory=list)
    slot_nbytes: int = 0

    base: torch.Tensor | None = None
    """With ``symmetric``: the one symmetric-memory buffer every slot is a view of (and,
    after the slots, the copy-engine gather's barrier counters)."""

    @classmethod
    def allocate(
        cls, platform: Platform, num_slots: int, slot_nbytes: int, *, symmetric: bool = False
    ) -> SlotPool:
        """``symmetric``: carve the slots out of one symmetric-memory allocation, so peers
        can read them ([Note: copy-engine gather] in :mod:`dlo.runtime.ce_gather`)."""
        pool = cls(platform)
        pool.slot_nbytes = slot_nbytes
        try:
            if symmetric:
                faults.check("slot_allocation")
                slots_nbytes = num_slots * slot_nbytes
                pool.base = symmetric_empty(slots_nbytes + FLAG_NBYTES, platform.device)
                pool.base[slots_nbytes:].zero_()  # the barrier counters
            for i in range(num_slots):
                faults.check("slot_allocation")
                if pool.base is not None:
                    buf = pool.base[i * slot_nbytes : (i + 1) * slot_nbytes]
                else:
                    buf = torch.empty(slot_nbytes, dtype=torch.uint8, device=platform.device)
                pool.slots.append(Slot(i, buf, platform.new_event(), platform.new_event()))
        except BaseException:
            pool.release()
            raise
        return pool

    @property
    def nbytes(self) -> int:
        return self.slot_nbytes * len(self.slots)

    @property
    def symmetric_nbytes(self) -> int:
        """Device bytes held outside torch's caching allocator (the symmetric buffer), which
        ``torch.cuda.max_memory_allocated`` does not count."""
        return int(self.base.nbytes) if self.base is not None else 0

    def release(self) -> None:
        """Drop every buffer (the caller synchronized the device first)."""
        for s in self.slots:
            s.owner = None
        self.slots.clear()
        self.base = None


def resize(pool: SlotPool, num_slots: int, slot_nbytes: int) -> None:
    """Give ``pool`` ``num_slots`` fresh slots of ``slot_nbytes`` (a re-plan: [Note: re-plan
    between forwards] in :mod:`dlo.plan.replan`). The caller released the old ones (and
    every view of them) first; not for symmetric pools."""
    assert pool.base is None and not pool.slots, "a released, ordinary pool"
    pool.slot_nbytes = slot_nbytes
    for i in range(num_slots):
        buf = torch.empty(slot_nbytes, dtype=torch.uint8, device=pool.platform.device)
        pool.slots.append(Slot(i, buf, pool.platform.new_event(), pool.platform.new_event()))
