"""``fuse_lora`` / ``unfuse_lora`` while dlo streams the blocks.

[Note: fusing while streaming]
A fuse writes the base weights, which live in dlo's host copies, so PEFT's own merge runs on
real tensors one block at a time: before the first adapter layer of a block merges, the
block's tensors are rebound to a device copy of its host bytes (a pinned block's own device
copy, a resident block's tensors as they are); once the fuse has moved on to the next block,
every tensor of the block goes back into its host copy, its pinned copy is updated, a copy
kept in a ring slot is evicted (the next load reads the new bytes), and its placeholders are
bound again. So at most one streamed block is on the device beside the slots, and the merge
is PEFT's own, on the device, as on the resident model: the same bits.

Only blocks whose host copy is their own whole block can be rewritten (group size 1, the
host region, not node-shared); a fuse that would reach another block is refused before
anything changes, naming it (the mapped backing and the disk tier are the read-only
checkpoint, a gathered block is 1/N per rank). An encoded block is encoded again from its
merged tensors (:meth:`~dlo.backends.layer_codec.HostCodec.reencode`): into its region
bytes where it fits, else into host memory of its own; the decoders are fitted to it
(piece sizes prepared, staging grown) before the next forward; its origin is dropped, so
``save_encoded`` never writes fused bytes under the checkpoint's fingerprints, and the next
enable encodes it anew (the restored tensors no longer alias the checkpoint: the encoded
checkpoint's entry is stale for them). Tensors outside blocks are ordinary device tensors: the merge writes them in place and
disable gives them back with their values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dlo.backends.layer_block import LayerBlock
from dlo.backends.layer_codec import HostCodec
from dlo.codec.blocks import EncodedShard
from dlo.errors import OffloadError
from dlo.host.shards import copy_back, shard_view
from dlo.journal import atomic
from dlo.platform.device import Platform
from dlo.runtime.decoding import Decoder
from dlo.runtime.ring import RingScheduler
from dlo.runtime.streamed import LOADED, StreamedBlock

MERGES = ("merge", "unmerge")
"""PEFT adapter-layer methods that write the base layer's weights."""


class BlockFuse:
    """Merges of adapter layers inside blocks, block by block, during a fuse or unfuse
    (see [Note: fusing while streaming])."""

    def __init__(
        self,
        platform: Platform,
        scheduler: RingScheduler,
        blocks: list[LayerBlock],
        *,
        rank: int,
        codec: HostCodec | None = None,
        decoders: Sequence[Decoder] = (),
    ) -> None:
        self.platform, self.scheduler, self.rank = platform, scheduler, rank
        self.codec, self.decoders = codec, decoders
        """What encodes a rewritten encoded block again, and the decoders that load it."""
        streamed = [sb for ring in scheduler.rings for sb in ring.blocks]
        self.blocks: dict[int, StreamedBlock | LayerBlock] = {
            **{id(b.module): b for b in blocks if b.resident},
            **{id(sb.module): sb for sb in streamed},
        }
        """id(block module) -> what dlo holds of it: a ring's block, or a resident block."""
        self.layer = {id(b.module): b for b in blocks}
        self.owners: dict[int, StreamedBlock | LayerBlock] = {}
        """id(adapter layer) -> its block, for the fuse running (the layers :meth:`guard`
        guards: those :meth:`in_blocks` finds)."""
        self.open: StreamedBlock | LayerBlock | None = None
        self.before: list[torch.Tensor] = []
        """The open block's device tensors as bound for the merge (a pinned or resident
        block keeps them: a merge that rebinds ``.data`` is copied back into them)."""

    def in_blocks(self, roots: list[nn.Module]) -> Iterator[tuple[nn.Module, Any]]:
        """Each adapter layer under ``roots`` inside a block, and the block."""
        seen: set[int] = set()
        for root in roots:
            for m in root.modules():
                owner = self.blocks.get(id(m))
                if owner is None or id(m) in seen:
                    continue
                seen.add(id(m))
                for t in m.modules():
                    if is_tuner(t):
                        yield t, owner

    def run(self, roots: list[nn.Module], method: str, fuse: Callable[[], Any]) -> Any:
        """``fuse()``: the merges it makes of layers inside blocks (:meth:`merge`, through
        the adapter layers' guards) done on real tensors, block by block."""
        tuners = list(self.in_blocks(roots))
        self.owners = {id(t): o for t, o in tuners}
        touched = [o for t, o in tuners if method == "fuse_lora" or getattr(t, "merged", False)]
        for owner in {id(o): o for o in touched}.values():
            layer = self.layer[id(owner.module)]
            if not self._rewritable(layer):
                raise OffloadError(
                    f"{method}() would rewrite block {owner.name!r}, whose host copy is "
                    f"{_why(layer)}: fuse before enabling (backend.disable(), fuse, enable "
                    "again)",
                    rank=self.rank,
                    block=owner.name,
                )
        self.platform.synchronize()  # no load in flight reads a host copy this rewrites
        try:
            return fuse()
        finally:
            try:
                self._close()
            finally:
                if self.codec is not None:
                    self.codec.release_bounces()  # kept across the blocks encoded again

    def _rewritable(self, b: LayerBlock) -> bool:
        """``b``'s host copy is its own whole block in the host region: raw, or encoded with
        the codec at hand to encode it again."""
        own = b.layout.group_size == 1 and b.mapped is None and not b.node_shared
        if b.encoded is not None:
            return own and isinstance(b.encoded, EncodedShard) and self.codec is not None
        return own and b.region is not None

    def merge(self, tuner: nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
        """PEFT's ``method`` of ``tuner`` on real tensors: its block opened first."""
        owner = self.owners.get(id(tuner))  # every guarded layer is one of run()'s
        if owner is not None and owner is not self.open:
            self._close()
            self._open(owner)
        return getattr(type(tuner), method)(tuner, *args, **kwargs)

    def guard(self, roots: list[nn.Module], fusing: Callable[[], bool]) -> None:
        """Each adapter layer inside a block under ``roots`` gets guarded ``merge`` /
        ``unmerge``: while ``fusing()`` they go block by block (:meth:`merge`); at any other
        time they are refused (PEFT unmerges a fused layer in place when its adapters are
        disabled or switched, inside a forward: on a device copy dlo would overwrite, or
        never keep)."""
        for tuner, _ in self.in_blocks(roots):
            for method in MERGES:
                if not getattr(vars(tuner).get(method), "_dlo_guard", False):
                    vars(tuner)[method] = self._guarded(tuner, method, fusing)

    def _guarded(
        self, tuner: nn.Module, method: str, fusing: Callable[[], bool]
    ) -> Callable[..., Any]:
        real = getattr(type(tuner), method).__get__(tuner)

        @functools.wraps(real)  # diffusers reads merge's signature
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if fusing():
                return self.merge(tuner, method, *args, **kwargs)
            raise OffloadError(
                f"{method}() of a LoRA layer in a block dlo streams, outside fuse_lora() / "
                "unfuse_lora(): PEFT unmerges a fused layer in place when its adapters are "
                "disabled or switched, which would change a device copy only. Call "
                "unfuse_lora() first, then disable or switch the adapters",
                rank=self.rank,
            )

        guarded._dlo_guard = True  # type: ignore[attr-defined]
        return guarded

    def _open(self, owner: StreamedBlock | LayerBlock) -> None:
        """Bind ``owner``'s tensors to real device tensors for the merge (a streamed block:
        views of one device copy of its host bytes; a pinned one: its own copy)."""
        if isinstance(owner, StreamedBlock):
            if owner.own is not None:
                real = list(owner.own_views)
            else:
                shard = owner.shard
                raw = (
                    shard.raw(self.platform.device)
                    if isinstance(shard, EncodedShard)
                    else shard.to(self.platform.device)
                )
                real = [shard_view(raw, s) for s in owner.layout.tensors]
            for t, r in zip(owner.tensors, real):
                t.data = r
        self.before = [t.data for t in owner.tensors]
        self.open = owner  # only once bound: a close writes back what is bound

    def _close(self) -> None:
        """The open block's tensors back into its host copy (and its pinned or resident
        device copy); a streamed block's copy in a slot evicted, its placeholders bound.
        Interrupts wait until it is done (the copies would disagree otherwise)."""
        owner = self.open
        if owner is None:
            return
        with atomic():
            self.open = None
            self.platform.synchronize()
            if isinstance(owner, StreamedBlock) and owner.state == LOADED and owner.slot:
                self.scheduler.evict(owner.slot)  # a stale copy: the next load reads anew
            layer = self.layer[id(owner.module)]
            if layer.encoded is not None:  # encoded again from the merged tensors
                self._reencode(layer, owner)
            else:
                copy_back(layer.host_view(), list(zip(owner.layout.tensors, owner.tensors)))
                if isinstance(owner, StreamedBlock):  # an encoded copy made late is stale
                    owner.host_written()
            if isinstance(owner, LayerBlock) or owner.own is not None:
                for t, kept in zip(owner.tensors, self.before):  # PEFT may rebind .data
                    if t.data.data_ptr() != kept.data_ptr():
                        kept.copy_(t.data)
                        t.data = kept
            if isinstance(owner, StreamedBlock):
                for t, ph in zip(owner.tensors, owner.placeholders):
                    t.data = ph
            self.platform.synchronize()

    def _reencode(self, b: LayerBlock, owner: StreamedBlock | LayerBlock) -> None:
        """``b``'s host copy encoded again from ``owner``'s merged tensors; the transport's
        decoders fitted to it; the ring reads the new copy from its next load."""
        assert self.codec is not None and b.region is not None
        enc, datas = self.codec.reencode(b.index, b.name, b.layout, owner.tensors)
        for decoder in self.decoders:  # before the host copy changes: a failure leaves it
            decoder.fit(enc)
        shard = self.codec.place(b.name, enc, datas, b.region.view(b.host_index))
        b.encoded = shard
        if isinstance(owner, StreamedBlock):
            owner.shard = shard


def unguard(tuners: Iterable[nn.Module]) -> None:
    """Take :meth:`BlockFuse.guard`'s guards off (at disable)."""
    for tuner in tuners:
        for method in MERGES:
            if getattr(vars(tuner).get(method), "_dlo_guard", False):
                del vars(tuner)[method]


def is_tuner(m: nn.Module) -> bool:
    """A PEFT adapter layer (its ``base_layer`` the wrapped module)."""
    return hasattr(m, "base_layer") and hasattr(m, "adapter_layer_names")


def _why(b: LayerBlock) -> str:
    if b.layout.group_size > 1:
        return f"1/{b.layout.group_size} of it per rank (AllGather)"
    if b.mapped is not None:
        return "the read-only checkpoint (host_backing='mapped', or host_budget_gb's disk tier)"
    if b.node_shared:
        return "the node's shared copy"
    if b.encoded is not None:
        return "encoded on disk (host_budget_gb's disk tier reads the encoded checkpoint)"
    return "not kept (no host region)"
