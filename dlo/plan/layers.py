"""The layer plan: what the layerwise backend executes, computed once from block shapes. Pure.

[Note: layer plan]
:func:`plan_layers` takes the resolved stacks (a concrete transfer, weight group and resident
count each; see :mod:`dlo.plan.topology`), each block's tensor description (names, kinds,
shapes, strides, dtypes: :func:`~dlo.plan.layout.describe_entries`) and the byte settings of
the config, lays out every block for its stack's group size ([Note: block layout], [Note:
chunks and shards]) and derives everything the install sizes from the layouts:

* the manifest and its digest (compared by every rank at the startup agreement);
* the slot size: the largest padded block that streams (resident blocks get their own
  buffer, so they do not size the slots);
* the bytes of this rank's private host region per block: the block's shard, or nothing for
  a node-shared block (it lives in the node's copy), for the mapped backing (its bytes
  stay in the checkpoint file) and for a block that ``host_budget_gb`` leaves in its file
  (see [Note: host budget tiers] in :mod:`dlo.plan.host_tiers`);
* the pin budgets: the config's ``pin_budget_gb`` is charged first for the node-shared
  streamed blocks (each rank pays 1/L of the node's copy, L its sharers on the node), and the
  rest is this rank's private region's; after the private region pinned, what it did not use
  is the node-shared copy's (:meth:`LayerPlan.shared_pin_budget_nbytes`);
* the most chunks of a block per weight axis (each transport's chunk events).

The automatic policy reads the same descriptions (:func:`payload_nbytes`), so both size a
block by one rule. Nothing under :mod:`dlo.runtime` or :mod:`dlo.backends` computes a
layout, a slot size or a budget: they execute this plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dlo.plan.host_tiers import READ_AHEAD_BUFFERS, choose_on_disk
from dlo.plan.layout import (
    ALIGN,
    BlockLayout,
    Manifest,
    build_manifest,
    plan_block_layout,
    round_up,
)
from dlo.plan.topology import BlockStack
from dlo.platform.env import page_size

TensorDescription = Sequence[tuple[str, str, Sequence[int], Sequence[int], torch.dtype]]
"""``(name, kind, shape, stride, dtype)`` of every tensor of a block, in layout order."""


ENCODED_AXIS = "encoded"
"""The read-ahead of a codec's disk-tier blocks, whole encoded blocks read from an encoded
checkpoint (see [Note: encoded blocks on disk] in :mod:`dlo.codec.on_disk`)."""


@dataclass(frozen=True)
class BlockPlan:
    """One block of the layer plan."""

    name: str
    """The block's dotted path from the pipeline."""
    stack: BlockStack
    resident: bool
    """Kept on the device (a leading block of its stack); else streamed."""
    layout: BlockLayout
    """Laid out for its stack's group size."""

    @property
    def node_shared(self) -> bool:
        return self.stack.transfer == "node-shared"


@dataclass(frozen=True)
class LayerPlan:
    """Every block's layout and the sizes derived from them (see [Note: layer plan])."""

    blocks: tuple[BlockPlan, ...]
    """Every selected block, stacks in plan order, blocks in execution order."""
    manifest: Manifest
    num_slots: int
    slot_nbytes: int
    """Bytes of one device slot: the largest padded streamed block (0: nothing streams)."""
    pin_budget_nbytes: int | None
    """The config's budget for pinned host bytes of this rank (None: no budget)."""
    shared_charged_nbytes: int
    """Bytes of the node-shared streamed blocks charged to this rank (1/L of the node's copy)."""
    mapped: bool
    """``host_backing="mapped"``: blocks stream from the checkpoint file."""
    host_budget_nbytes: int | None = None
    """The config's ``host_budget_gb`` in bytes (None: no budget)."""
    on_disk: frozenset[int] = frozenset()
    """Positions of the blocks that ``host_budget_gb`` leaves in their file: read for every
    use (see [Note: host budget tiers])."""

    def tiered(self, host_nbytes: Mapping[int, int]) -> LayerPlan:
        """The plan with its disk tier chosen under the host budget, counting
        ``host_nbytes[i]`` for block ``i``'s host copy where given (an encoded copy's bytes)
        and its raw shard elsewhere, each rounded up to the pages the host region gives it
        (see [Note: host budget tiers])."""
        if self.host_budget_nbytes is None:
            return self
        page = page_size()
        on_disk = choose_on_disk(
            [
                round_up(host_nbytes.get(i, b.layout.shard_nbytes), page)
                for i, b in enumerate(self.blocks)
            ],
            [b.stack.component for b in self.blocks],
            [b.resident for b in self.blocks],
            self.host_budget_nbytes,
        )
        return dataclasses.replace(self, on_disk=on_disk)

    @property
    def from_file(self) -> list[int]:
        """Positions of the blocks whose bytes are read from their file for every load (the
        mapped backing's, the disk tier's)."""
        if self.mapped:
            return list(range(len(self.blocks)))
        return sorted(self.on_disk)

    @property
    def streamed(self) -> list[int]:
        """Positions of the streamed blocks (resident ones cross the link once: pinning them
        would only take budget from the blocks streamed every forward)."""
        return [i for i, b in enumerate(self.blocks) if not b.resident]

    @property
    def allocated_slots(self) -> int:
        """Slots the ring allocates: ``num_slots``, but never more than the streamed blocks
        (a slot beyond one per block could never be filled; ``num_slots`` stays what the
        config asked for, and the explanation and ``stats()`` say what was allocated)."""
        return max(1, min(self.num_slots, len(self.streamed)))

    @property
    def encoded(self) -> list[int]:
        """Positions of the blocks whose host copy is encoded (their region bytes are known
        only once encoded: see [Note: encoded blocks] in :mod:`dlo.codec.format`)."""
        return [i for i, b in enumerate(self.blocks) if b.stack.codec != "none"]

    @property
    def region_nbytes(self) -> list[int]:
        """Bytes of each block in this rank's private host region."""
        return [
            0 if self.mapped or b.node_shared or i in self.on_disk else b.layout.shard_nbytes
            for i, b in enumerate(self.blocks)
        ]

    @property
    def read_ahead_sizes(self) -> dict[str, int]:
        """Per weight axis with disk-tier blocks (``"local"``: whole blocks; :data:`ENCODED_AXIS`:
        whole encoded blocks), the bytes of each of its read-ahead buffers: the largest host
        shard it reads (see [Note: host budget tiers])."""
        out: dict[str, int] = {}
        for i in sorted(self.on_disk):
            b = self.blocks[i]
            axis = b.stack.group_axis if b.layout.group_size > 1 else "local"
            if b.stack.codec != "none":  # read encoded: never over the raw bytes (check_layout)
                axis = ENCODED_AXIS
            out[axis] = max(out.get(axis, 0), b.layout.shard_nbytes)
        return out

    @property
    def read_ahead_nbytes(self) -> int:
        """Every read-ahead buffer's bytes; pinned out of the budget before the private
        region."""
        return READ_AHEAD_BUFFERS * sum(self.read_ahead_sizes.values())

    def read_ahead_pin_budgets(self) -> dict[str, int | None]:
        """What each axis's read-ahead buffers may pin: their bytes, in axis order, within
        what the node-shared charge leaves of the budget (None: no budget)."""
        left = None if self.pin_budget_nbytes is None else self.pin_budget_nbytes
        if left is not None:
            left -= self.shared_charged_nbytes
        out: dict[str, int | None] = {}
        for axis, n in self.read_ahead_sizes.items():
            if left is None:
                out[axis] = None
                continue
            pins = max(0, min(READ_AHEAD_BUFFERS * n, left))
            out[axis], left = pins, left - pins
        return out

    @property
    def private_pin_budget_nbytes(self) -> int | None:
        """What the private region may pin: the budget less the node-shared charge and the
        read-ahead buffers."""
        if self.pin_budget_nbytes is None:
            return None
        return max(0, self.pin_budget_nbytes - self.shared_charged_nbytes - self.read_ahead_nbytes)

    def shared_pin_budget_nbytes(self, private_pinned_nbytes: int) -> int | None:
        """What the node-shared copy may pin once the private region pinned
        ``private_pinned_nbytes`` (charged bytes)."""
        if self.pin_budget_nbytes is None:
            return None
        return self.pin_budget_nbytes - private_pinned_nbytes

    @property
    def gathers(self) -> bool:
        """Some stack rebuilds its blocks with a collective (group size > 1)."""
        return any(b.stack.group_size > 1 for b in self.blocks)

    def max_chunks(self, axis: str) -> int:
        """The most chunks of any block of the stacks on weight axis ``axis``."""
        return max(
            (b.layout.num_chunks for b in self.blocks if b.stack.group_axis == axis), default=0
        )

    @property
    def resident_nbytes(self) -> int:
        """Device bytes of the resident blocks (each in its own padded buffer)."""
        return sum(b.layout.padded_nbytes for b in self.blocks if b.resident)


def charged_nbytes(nbytes: int, share_ranks: int) -> int:
    """What one of ``share_ranks`` ranks sharing ``nbytes`` of host memory is charged for it:
    ``ceil(nbytes / share_ranks)``, so the charges of a node's ranks cover the whole copy."""
    return -(-nbytes // share_ranks)


def payload_nbytes(name: str, tensors: TensorDescription) -> int:
    """A block's payload bytes (the end of its last tensor): the same for every group size
    and chunking."""
    return plan_block_layout(name, tensors, group_size=1, chunk_nbytes=ALIGN).nbytes


def plan_units(
    tensors: Mapping[str, TensorDescription], *, chunk_nbytes: int
) -> dict[str, BlockLayout]:
    """Layouts of the components the model-level swap moves whole (component path -> its
    tensor description): each is laid out like a block of a group of one, so its host copy
    is one exact-size region entry and it loads in one copy (see [Note: swap protocol] in
    :mod:`dlo.backends.model_swap`)."""
    return {
        path: plan_block_layout(path, t, group_size=1, chunk_nbytes=chunk_nbytes)
        for path, t in tensors.items()
    }


def check_stacks(
    stacks: Sequence[BlockStack], *, host_backing: str, host_budget: float | None = None
) -> None:
    """What no layer plan can serve, refused by name.

    Raises:
        ValueError: ``host_backing="mapped"`` with an AllGather or node-shared stack; a
            a codec with the mapped backing; ``host_budget_gb`` with the mapped backing, a
            node-shared stack or a codec on a stack that gathers; node-shared stacks on different
            weight axes (one host copy per node and axis).
    """
    if host_budget is not None:
        if host_backing == "mapped":
            raise ValueError(
                "host_budget_gb caps the host region, but host_backing='mapped' keeps no "
                "region (every block is read from the file's page cache): give one of them"
            )
        for s in stacks:
            if s.transfer == "node-shared":
                raise ValueError(
                    f"host_budget_gb reads blocks beyond the budget from their file on "
                    f"rank-local and AllGather stacks only (for now), but stack "
                    f"{s.container_path!r} uses transfer 'node-shared' (set another transfer, "
                    "or leave host_budget_gb unset)"
                )
            if s.codec != "none" and s.group_size > 1:
                raise ValueError(
                    f"host_budget_gb with codec {s.codec!r} reads blocks beyond the budget "
                    "from an encoded checkpoint, which holds whole blocks, but stack "
                    f"{s.container_path!r} gathers its blocks over {s.group_size} ranks (use "
                    "transfer='rank-local', codec='none', or leave host_budget_gb unset)"
                )
    if host_backing == "mapped":
        for s in stacks:
            if s.group_size > 1 or s.transfer == "node-shared":
                raise ValueError(
                    f"host_backing='mapped' applies to rank-local stacks only, but stack "
                    f"{s.container_path!r} uses transfer {s.transfer!r} (group size "
                    f"{s.group_size}): AllGather stacks keep per-rank shards, node-shared ones "
                    "a node's copy in shared memory (use host_backing='region')"
                )
    for s in stacks:
        if s.codec != "none" and host_backing == "mapped":
            raise ValueError(
                f"codec={s.codec!r} encodes the host copy, but host_backing='mapped' streams "
                f"stack {s.container_path!r} from the checkpoint's own bytes: use "
                "host_backing='region', or codec='none' (layer_options sets it per component)"
            )
    axes = {s.container_path: s.share_axis for s in stacks if s.transfer == "node-shared"}
    if len(set(axes.values())) > 1:
        raise ValueError(
            f"node-shared stacks share one host copy per node along one weight axis, but they "
            f"resolve to different axes: {axes} (set one weight_axis)"
        )


def plan_layers(
    stacks: Sequence[BlockStack],
    tensors: Mapping[str, TensorDescription],
    *,
    chunk_nbytes: int,
    num_slots: int,
    pin_budget_nbytes: int | None = None,
    host_backing: str = "region",
    node_sharers: int = 1,
    host_budget_nbytes: int | None = None,
) -> LayerPlan:
    """The layer plan of ``stacks`` (see [Note: layer plan]).

    Args:
        stacks: the resolved stacks, each with a concrete transfer (no ``"auto"``).
        tensors: block path -> the block's tensor description, for every block of ``stacks``.
        chunk_nbytes: the config's chunk size in bytes.
        num_slots: device slots of the ring.
        pin_budget_nbytes: the config's pin budget in bytes (None: no budget).
        host_backing: ``"region"`` or ``"mapped"``.
        node_sharers: L, this rank's sharers of the node-shared copy (itself included).
        host_budget_nbytes: the config's host budget in bytes (None: none): the blocks
            beyond it are read from their file (see [Note: host budget tiers]).
    Returns:
        The :class:`LayerPlan`.
    Raises:
        ValueError: a stack the plan cannot serve (:func:`check_stacks`), an ``"auto"``
            transfer left, or a layout error (an overlapping tensor, a size past int64).

    Example:
        >>> s = BlockStack(component="dit", component_path="", container_path="blocks",
        ...                block_paths=("blocks.0",), transfer="rank-local", num_resident=0,
        ...                group_axis="local", group_size=1)
        >>> t = {"blocks.0": [("w", "param", (4, 4), (4, 1), torch.float32)]}
        >>> plan_layers([s], t, chunk_nbytes=1 << 20, num_slots=2).slot_nbytes
        256
    """
    check_stacks(stacks, host_backing=host_backing, host_budget=host_budget_nbytes)
    blocks: list[BlockPlan] = []
    for stack in stacks:
        if stack.transfer == "auto":
            raise ValueError(f"stack {stack.container_path!r}: transfer='auto' is not decided")
        for i, path in enumerate(stack.block_paths):
            layout = plan_block_layout(
                path, tensors[path], group_size=stack.group_size, chunk_nbytes=chunk_nbytes
            )
            blocks.append(BlockPlan(path, stack, i < stack.num_resident, layout))
    streamed = [b for b in blocks if not b.resident]
    return LayerPlan(
        blocks=tuple(blocks),
        manifest=build_manifest([b.layout for b in blocks]),
        num_slots=num_slots,
        slot_nbytes=max((b.layout.padded_nbytes for b in streamed), default=0),
        pin_budget_nbytes=pin_budget_nbytes,
        shared_charged_nbytes=sum(
            charged_nbytes(b.layout.shard_nbytes, node_sharers if b.stack.share_size > 1 else 1)
            for b in streamed
            if b.node_shared
        ),
        mapped=host_backing == "mapped",
        host_budget_nbytes=host_budget_nbytes,
    ).tiered({})
