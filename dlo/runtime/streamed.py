"""A ring's blocks: what binds one streamed block to any slot (or its own buffer), and the
ring of a component's blocks in the order they run (see [Note: ring protocol] in
:mod:`dlo.runtime.ring`).

[Note: writes into streamed tensors]
A block may write one of its own tensors in place (a cache kept in a buffer, refreshed every
other step). The write lands in the slot, which the next load of any block overwrites, so it
would be lost and later steps would silently differ from the resident model. Each tensor's
version counter (bumped by every in-place write, not by dlo's ``.data`` rebinding) is read
at enter and at exit. A written tensor of a whole-block host shard (group size 1, host
region) is copied back into the shard at exit, synchronously (only when a write happened),
so every later load and the restore at disable see it, as a resident model would. With
AllGather a rank holds only its slice of the block, and with ``host_backing="mapped"`` the
block's source is the read-only checkpoint (and so with the disk tier of
``host_budget_gb``): there the forward fails with an error naming the tensors, instead of
losing the write silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dlo.host.shards import copy_back
from dlo.plan.layout import BlockLayout, TensorSpec
from dlo.platform.timing import StreamTimer
from dlo.runtime.chain import ExecutionOrder
from dlo.runtime.slots import Slot
from dlo.runtime.transport import Transport

IDLE, LOADED, RUNNING = "idle", "loaded", "running"


@dataclass(eq=False)
class StreamedBlock:
    """One block of a ring and everything needed to bind it to any slot."""

    name: str
    module: nn.Module
    layout: BlockLayout
    shard: Any
    """This rank's host shard of the block (uint8), or with ``host_backing="mapped"`` the
    block's place in the checkpoint, a :class:`~dlo.host.mapped.MappedBlock` (see [Note: mapped
    host backing]): whatever its transport's ``load`` takes."""
    tensors: list[torch.Tensor]
    """The block's Parameter and buffer objects, in layout order."""
    transport: Transport
    index: int = -1
    """Position in the manifest (identifies the block in the lock-step check)."""
    host_writable: bool = True
    """``shard`` is this rank's own copy of the whole block, so in-place writes can go back
    to it (not with AllGather, the mapped backing or a node-shared copy)."""
    placeholders: list[torch.Tensor] = field(default_factory=list)
    views: list[list[torch.Tensor]] = field(default_factory=list)
    """``views[slot.index][i]``: tensor i as a view of that slot."""
    ring: BlockRing | None = None
    state: str = IDLE
    slot: Slot | None = None
    wait: StreamTimer | None = None
    """Exposed wait of this block: compute-stream time spent waiting on ``ready``."""
    num_runs: int = 0
    num_demand_loads: int = 0
    num_wasted_loads: int = 0
    """Loads evicted or dropped before the block ran (a prefetch for a forward that skipped
    the block: a step cache's decision, see [Note: kept after exit] in
    :mod:`dlo.runtime.ring`)."""
    versions: list[int] = field(default_factory=list)
    """Each tensor's version counter when the block entered (see [Note: writes into
    streamed tensors])."""
    own: Slot | None = None
    """A pinned block's own device buffer, outside the pool ([Note: re-plan between
    forwards] in :mod:`dlo.plan.replan`); None while it streams."""
    own_views: list[torch.Tensor] = field(default_factory=list)
    host_version: int = 0
    """Bumped by every write into the host shard (a write kept, a LoRA fuse): an encoded copy
    made before it is stale (see [Note: codec turned on by measurement] in
    :mod:`dlo.runtime.late_codec`)."""
    raw: tuple[Any, Transport] | None = None
    """The raw host shard and transport of a block whose codec was turned on between
    forwards (``shard`` and ``transport`` are then the encoded copy's)."""

    def keep_writes(self, written: Sequence[tuple[TensorSpec, torch.Tensor]]) -> list[str]:
        """Copy ``written`` (the tensors the block wrote in place) back into its whole-block
        host shard; returns the names of those that have no such shard to go to."""
        self.to_raw()  # its encoded copy (a codec turned on late) would miss the write
        if (
            not self.host_writable
            or self.layout.group_size > 1
            or not isinstance(self.shard, torch.Tensor)
        ):
            return [spec.name for spec, _ in written]
        copy_back(self.shard, written)
        self.host_written()
        return []

    def host_written(self) -> None:
        """Its raw host shard was just written: loads read it from now on, and an encoded
        copy made before is stale (``host_version``)."""
        self.to_raw()
        self.host_version += 1

    def to_raw(self) -> None:
        """Load from the raw host shard again (a write is about to land in it)."""
        if self.raw is not None:
            self.shard, self.transport = self.raw
            self.raw = None


@dataclass(eq=False)
class BlockRing:
    """The streamed blocks of one component, its stacks in declared order, and the order
    they run in (see [Note: prefetch chain])."""

    name: str
    blocks: list[StreamedBlock]
    order: ExecutionOrder[StreamedBlock] = field(init=False)
    replanner: Any = None
    """Told of each entry and exit (:class:`dlo.runtime.replan.Replanner`), or None."""
    num_pinned: int = 0

    def __post_init__(self) -> None:
        self.order = ExecutionOrder(self.blocks, name=_block_name)
        for b in self.blocks:
            b.ring = self


def _block_name(block: StreamedBlock) -> str:
    return block.name
