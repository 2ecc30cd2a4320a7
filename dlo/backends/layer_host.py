"""The host side of the layerwise install: the selected blocks with the model's tensors, this
rank's host region (or the mapped backing), the node-shared copy, and releasing and
restoring the model's tensors. Every step is journaled (see [Note: one journal for enable
and disable] in :mod:`dlo.journal`); the sizes come from the layer plan (see [Note: layer
plan] in :mod:`dlo.plan.layers`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from dlo import faults
from dlo.backends.layer_block import LayerBlock
from dlo.backends.layer_codec import HostCodec
from dlo.backends.layer_codec_disk import file_nbytes, serve_on_disk
from dlo.backends.model_hooks import mark_released, refuse_released_forward
from dlo.codec.blocks import EncodedShard
from dlo.codec.format import EncodedLayout
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.errors import OffloadError
from dlo.host.mapped import largest_file, map_blocks
from dlo.host.node_share import SharedBlock, packer, share_host, sharers
from dlo.host.packer import pack_block
from dlo.host.region import HostRegion, PinReport, RegionPins
from dlo.host.shards import copy_back, placeholder, unpack_tensor, written_tensors
from dlo.io.direct import DirectReads, read_bandwidth
from dlo.io.header_checks import CheckpointError
from dlo.journal import Journal, atomic
from dlo.parallel.agreement import RankReport
from dlo.parallel.groups import World, current_world, group_of
from dlo.plan.layers import LayerPlan
from dlo.plan.subclasses import retarget_all
from dlo.platform.device import Platform
from dlo.platform.progress import progress

logger = logging.getLogger(__name__)


class LayerHost:
    """This rank's host storage of the selected blocks (see the module docstring).

    Args:
        platform: the device (placeholders are made on it).
        config: the concrete layer config (no ``"auto"`` left).
        blocks: the selected blocks, in manifest order.
    """

    def __init__(self, platform: Platform, config: OffloadConfig, blocks: list[LayerBlock]) -> None:
        self.platform = platform
        self.config = config
        self.blocks = blocks
        self.region: HostRegion | None = None
        self.shared: HostRegion | None = None
        """The node-shared host copy (see [Note: node-shared host copy] in
        :mod:`dlo.host.node_share`)."""
        self._pins: RegionPins | None = None
        """The private region's pinning, started while it is filled."""
        self.pageable: tuple[str, ...] = ()
        """Blocks every rank keeps pageable (``pin_failure_policy="whole_block_fallback"``)."""
        self.codec: HostCodec | None = None
        """The codec of the encoded blocks (see :mod:`dlo.backends.layer_codec`)."""
        self.reads: DirectReads | None = None
        """The disk tier's reads around the page cache (``host_budget_gb``)."""
        self.disk_probe: tuple[str, float, bool] | None = None
        """The disk tier's file, its read rate (bytes/s) and whether it was O_DIRECT."""

    # ------------------------------------------------------------------ private region
    def prepare(
        self, plan: LayerPlan, journal: Journal, group_rank: Callable[[str], int]
    ) -> LayerPlan:
        """Fill this rank's region with its slices of every block that is not node-shared
        (``group_rank(axis)``: this rank's place in the weight group of an axis). With
        group size 1 the region then holds every byte of a block, so the originals are
        released at once; with the mapped backing nothing is packed. Returns the plan as
        laid: with a codec under ``host_budget_gb``, its disk tier chosen by the encoded
        bytes (:meth:`_tier_encoded`)."""
        plan = self._tier_encoded(plan, journal)
        if plan.from_file:
            self._map_blocks(plan, journal, group_rank)
        sizes = plan.region_nbytes
        # closed after every release below is undone: a block laid into the region is
        # rebuilt from it (see [Note: released as encoded] in dlo.backends.layer_codec)
        journal.record("host region", self._close_region)
        todo = [(i, self.blocks[i]) for i in plan.encoded if i not in plan.from_file]
        todo = [(i, b) for i, b in todo if not b.node_shared]
        if todo:  # sizes known once encoded
            shards = [
                (i, b.name, b.layout, b.tensors, group_rank(b.stack.group_axis)) for i, b in todo
            ]

            def released(i: int) -> None:
                if self.blocks[i].layout.group_size == 1:
                    self.release(self.blocks[i], journal)

            for i, n in self._codec(journal).encode(shards, released).items():
                sizes[i] = n
        with atomic():  # [Note: interrupts during enable] in dlo.journal
            region = self.region = HostRegion(sizes)
        if self.config.pin_memory:  # each block pinned once filled, behind the next fills
            with atomic():
                pins = self._pins = region.pin_as_filled(
                    self.platform,
                    budget_nbytes=plan.private_pin_budget_nbytes,
                    blocks=plan.streamed,
                )
                journal.record("pin behind fill", pins.cancel)
        for i, b in progress(
            enumerate(self.blocks), desc="dlo: host shards", total=len(self.blocks), unit="block"
        ):
            if b.node_shared:  # packed after the agreement, into the node's copy
                continue
            b.region, b.host_index = region, i
            if b.mapped is not None:  # its bytes stay in the checkpoint: nothing to pack
                if b.layout.group_size == 1:  # gathered blocks: after the agreement
                    self.release(b, journal)
                elif b.from_disk:  # a gathered disk block aliases its file again at disable
                    journal.record(f"restore {b.name}", functools.partial(self.restore, b))
                continue
            faults.check("host_fill")
            if self.codec is not None and b.stack.codec != "none":
                with atomic():  # laid and known as laid together ([Note: released as encoded])
                    b.encoded = self.codec.lay(i, region.view(i))
            else:  # pack_shard, or straight from the file for checkpoint-mapped tensors
                pack_block(region.view(i), b.layout, group_rank(b.stack.group_axis), b.tensors)
            if self._pins is not None:
                self._pins.filled(i)
            if b.layout.group_size == 1 and not b.released:
                self.release(b, journal)
        return plan

    def _tier_encoded(self, plan: LayerPlan, journal: Journal) -> LayerPlan:
        """With a codec on blocks ``host_budget_gb`` leaves on disk, the tiers chosen anew by
        the bytes the budget really holds: the encoded copies' (about 0.69x the raw ones for
        bf16), from the encoded checkpoint beside the weights, written first where it lacks
        some (see [Note: host budget tiers] in :mod:`dlo.plan.host_tiers`)."""
        coded = [
            b
            for b in (self.blocks[i] for i in plan.encoded)
            if not b.resident and b.layout.group_size == 1 and not b.node_shared
        ]
        if plan.mapped or not any(b.index in plan.on_disk for b in coded):
            return plan
        blocks = [(b.index, b.name, b.layout, b.tensors, 0) for b in coded]
        sizes = file_nbytes(self._codec(journal), blocks)
        tiered = plan.tiered(sizes)
        unserved = {b.index for b in coded} - set(sizes)  # no file can serve them from disk
        if (tiered.on_disk - plan.on_disk) & unserved:
            return plan  # the raw choice left them in memory: keep it
        return tiered

    def _close_region(self) -> None:
        if self.region is not None:
            self.region.close()

    def _codec(self, journal: Journal) -> HostCodec:
        """The codec of the encoded blocks, made once (one codec per enable: ``"ans"``)."""
        if self.codec is None:
            (name,) = {b.stack.codec for b in self.blocks if b.stack.codec != "none"}
            self.codec = HostCodec(self.platform, name)
            journal.record("encoded pieces", self.codec.forget)
        return self.codec

    def _map_blocks(self, plan: LayerPlan, journal: Journal, rank: Callable[[str], int]) -> None:
        """Give the blocks read from their file their :class:`MappedBlock` (see [Note: mapped
        host backing] in :mod:`dlo.host.mapped`): through the page cache with the mapped
        backing, around it on the disk tier of ``host_budget_gb``."""
        reads = None
        if not plan.mapped:
            reads = self.reads = DirectReads()
            journal.record("disk reads", reads.close)
        blocks = [self.blocks[i] for i in plan.from_file]
        mapped = map_blocks(
            [(b.name, b.layout, b.tensors, rank(b.stack.group_axis)) for b in blocks], reads
        )
        for b, m in zip(blocks, mapped):
            b.mapped = m
        coded = [b for b in blocks if b.stack.codec != "none"]  # [Note: encoded blocks on disk]
        if reads is not None and coded:
            kept = [self.blocks[i] for i in plan.encoded if i not in plan.on_disk]
            served = serve_on_disk(
                self._codec(journal),
                [(b.index, b.name, b.layout, b.tensors, 0) for b in coded],
                reads,
                journal,
                kept=[(b.index, b.name, b.layout, b.tensors, 0) for b in kept if not b.node_shared],
            )
            for b, e in zip(coded, served):
                b.encoded = e
        # the files stay open while blocks are read from them, and until disable has
        # rebuilt the blocks from them (load_pipeline's close is deferred until then)
        for ckpt in {id(c): c for m in mapped for c in m.checkpoints}.values():
            ckpt.retain()
            journal.record("checkpoint files", ckpt.release)
        if reads is not None and (path := largest_file(mapped)) is not None:
            self.disk_probe = (path, *read_bandwidth(path))  # the policy's disk tier

    def pin(self) -> PinReport | None:
        """Finish pinning the streamed blocks of the private region within the plan's budget
        (started by :meth:`prepare`, each block as soon as it was filled)."""
        if self._pins is None:
            return None
        return self._pins.finish()

    def keep_pageable(
        self, region: HostRegion | None, blocks: Sequence[LayerBlock], names: tuple[str, ...]
    ) -> None:
        """The group decided: every rank keeps ``names`` pageable, for equal timing
        (``blocks``: the region's blocks, in its order)."""
        self.pageable += names
        if names and region is not None:
            keep = set(names)
            region.unpin([i for i, b in enumerate(blocks) if b.name in keep])
            what = "node-shared blocks" if region is self.shared else "blocks"
            logger.warning(
                "dlo: %d %s stay pageable (pin_failure_policy='whole_block_fallback'): %s",
                len(names),
                what,
                ", ".join(names[:8]),
            )

    # ------------------------------------------------------------------ node-shared copy
    def share(
        self,
        plan: LayerPlan,
        journal: Journal,
        reports: Sequence[RankReport],
        parallel: ParallelConfig,
        world: World,
        *,
        exchanges: bool,
    ) -> None:
        """Pack the node-shared blocks into the node's copy (see [Note: node-shared host
        copy] in :mod:`dlo.host.node_share`), shared with the ranks of this rank's share
        group on its node. The agreement compared every stack's transfer, so either every
        exchanging rank has such blocks and meets the others here, or none has."""
        shared = [b for b in self.blocks if b.node_shared]
        if not shared:
            return
        assert self.region is not None
        cfg = self.config
        # no exchange: a share group of one (the weight axis has one rank), or one process
        axis = shared[0].stack.share_axis
        members = (
            sharers(reports, group_of(parallel, axis, world.rank), world.rank)
            if exchanges
            else [world.rank]
        )
        token_of = {r.rank: r.token for r in reports}
        layouts: dict[int, EncodedLayout] = {}
        encoded = [(k, b) for k, b in enumerate(shared) if b.stack.codec != "none"]
        if encoded:  # each sharer encodes the blocks it packs, then the tables are exchanged
            codec = self._codec(journal)
            layouts = codec.encode_shared(
                {
                    r: [
                        (b.index, b.name, b.layout, b.tensors, 0)
                        for k, b in encoded
                        if packer(k, len(members)) == i
                    ]
                    for i, r in enumerate(members)
                },
                rank=world.rank,
                world_size=world.size if exchanges else 1,
                timeout_s=cfg.collective_timeout_s,
            )
        region, fallback = share_host(
            [
                SharedBlock(
                    b.name,
                    b.layout,
                    b.tensors,
                    streamed=not b.resident,
                    nbytes=layouts[b.index].nbytes if b.index in layouts else None,
                    fill=functools.partial(self.codec.write, b.index)
                    if self.codec is not None and b.index in layouts
                    else None,
                )
                for b in shared
            ],
            tokens=[token_of[r] for r in members],
            members=members,
            rank=world.rank,
            world_size=world.size if exchanges else 1,
            platform=self.platform,
            pin=cfg.pin_memory,
            budget_nbytes=plan.shared_pin_budget_nbytes(self.region.charged_pinned_nbytes),
            pin_failure_policy=cfg.pin_failure_policy,
            timeout_s=cfg.collective_timeout_s,
            journal=journal,
        )
        self.shared = region
        self.keep_pageable(region, shared, fallback)
        for i, b in enumerate(shared):
            b.region, b.host_index = region, i
            if self.codec is not None and b.index in layouts:
                b.encoded = self.codec.shard(layouts[b.index], region.view(i))
            self.release(b, journal)

    # ------------------------------------------------------------------ the model's tensors
    def release(self, b: LayerBlock, journal: Journal) -> None:
        """Release the model's originals of ``b`` (its host copy holds them), journaling the
        rebuild from the host copy."""
        with atomic():
            self.release_originals(b)
            b.released = True
            journal.record(f"release {b.name}", functools.partial(self.restore, b))

    def release_originals(self, b: LayerBlock) -> None:
        leave_host(b, self.platform.device)  # first: it may fail, nothing lost yet
        for t in b.tensors:
            t.data = placeholder(t, self.platform.device)

    def release_gathered(self, b: LayerBlock) -> None:
        """The undo of an AllGather block's install: its weights go, unless
        ``disable(restore=True)`` gathered them back already."""
        if not (b.restored or b.from_disk):  # a disk block aliases its file again
            self.release_originals(b)

    def restore(self, b: LayerBlock) -> None:
        """Rebuild the model's tensors of ``b`` from its whole-block host copy."""
        if b.mapped is not None:
            try:  # every tensor read before any is bound: a block is whole or released
                data = [b.mapped.rebuild(i).to(dev) for i, dev in enumerate(b.original_devices)]
            except (CheckpointError, OSError) as e:  # the file, not the device
                self._lose_mapped(b, e)
            for t, d in zip(b.tensors, data):
                t.data = d
        else:
            shard = self._raw_copy(b)
            for spec, t, dev in zip(b.layout.tensors, b.tensors, b.original_devices):
                t.data = unpack_tensor(shard, spec, dev)
        restore_wrappers(b)

    def _raw_copy(self, b: LayerBlock) -> torch.Tensor:
        """``b``'s whole-block host copy as raw bytes: decoded from its encoded copy, or from
        its pieces not laid yet (released as encoded), else its region bytes."""
        if isinstance(b.encoded, EncodedShard):  # to the host at once where tensors go back
            host = all(d.type == "cpu" for d in b.original_devices)
            return b.encoded.raw("cpu" if host else self.platform.device, keep=True)
        if self.codec is not None and self.codec.holds(b.index):
            return self.codec.pending_raw(b.index, self.platform.device)
        if b.stack.codec != "none" and self.codec is not None:  # never encoded bytes as raw
            raise OffloadError(f"block {b.name!r} has no host copy to rebuild it from")
        return b.host_view()

    def _lose_mapped(self, b: LayerBlock, e: Exception) -> NoReturn:
        """A mapped block whose checkpoint can no longer be read (truncated, rewritten, a disk
        gone) stays released: enable refuses the model and its forward says to reload it
        (see [Note: what disable restores])."""
        why = f"when offload was disabled: its checkpoint could not be read back ({e})"
        rank = current_world().rank
        mark_released(b.tensors, why)
        refuse_released_forward([(b.name, b.module, why)], rank=rank)
        raise OffloadError(
            f"disable could not restore block {b.name!r} from its checkpoint ({e}); the file "
            "changed while dlo served it: the block stays empty, reload the model",
            rank=rank,
            block=b.name,
        ) from e

    def keep_resident_writes(self, b: LayerBlock, versions: list[int]) -> None:
        """Before a resident block (group size 1) is restored from its host copy, copy the
        tensors its forwards wrote in place into that copy (see [Note: writes into streamed
        tensors] in :mod:`dlo.runtime.ring`); the mapped backing's source is the read-only
        checkpoint."""
        written = written_tensors(b.layout.tensors, b.tensors, versions)
        if not written:
            return
        if not b.host_writable or b.region is None:
            logger.warning(
                "dlo: resident block %s wrote %s in place; its source is %s: the writes are "
                "not kept after disable",
                b.name,
                [spec.name for spec, _ in written],
                "the node-shared host copy"
                if b.node_shared
                else "the encoded host copy"
                if isinstance(b.encoded, EncodedShard)
                else "the checkpoint",
            )
            return
        copy_back(b.host_view(), written)


def leave_host(b: LayerBlock, device: torch.device) -> None:
    """Record where ``b``'s tensors and wrappers are (what a restore gives back) and make
    the wrappers report ``device``, where the tensors go (see [Note: tensor subclasses])."""
    b.original_devices = [t.device for t in b.tensors]
    b.wrapper_devices = [w.tensor.device for w in b.wrapped]
    retarget_all(b.wrapped, [device] * len(b.wrapped))


def restore_wrappers(b: LayerBlock) -> None:
    """Give ``b``'s wrappers back the devices they had before enable (their inner tensors
    are back there)."""
    retarget_all(b.wrapped, b.wrapper_devices)
