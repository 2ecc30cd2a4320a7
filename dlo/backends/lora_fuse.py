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
host region, no codec, not node-shared: ``host_writable``); a fuse that would reach another
block is refused before anything changes, naming it (an encoded block would have to be
encoded again, the mapped backing is the read-only checkpoint, a gathered block is 1/N per
rank). Tensors outside blocks are ordinary device tensors: the merge writes them in place and
disable gives them back with their values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dlo.backends.layer_host import LayerBlock
from dlo.errors import OffloadError
from dlo.host.shards import copy_back, unpack_tensor
from dlo.platform.device import Platform
from dlo.runtime.ring import RingScheduler
from dlo.runtime.streamed import LOADED, StreamedBlock

MERGES = ("merge", "unmerge")
"""PEFT adapter-layer methods that write the base layer's weights."""


class BlockFuse:
    """One fuse (or unfuse) call's merges, block by block (see [Note: fusing while
    streaming])."""

    def __init__(
        self,
        platform: Platform,
        scheduler: RingScheduler,
        blocks: list[LayerBlock],
        *,
        rank: int,
    ) -> None:
        self.platform, self.scheduler, self.rank = platform, scheduler, rank
        streamed = [sb for ring in scheduler.rings for sb in ring.blocks]
        self.streamed = {id(sb.module): sb for sb in streamed}
        self.resident = {id(b.module): b for b in blocks if b.resident}
        self.layer = {id(b.module): b for b in blocks}
        self.open: StreamedBlock | LayerBlock | None = None
        self.before: list[torch.Tensor] = []
        """The open block's tensors as the merge found them (what a resident keeps)."""

    def run(self, roots: list[nn.Module], fuse: Callable[[], Any]) -> Any:
        """``fuse()`` with every adapter layer's merge under ``roots`` done on real tensors."""
        owners = self._owners(roots)
        self._refuse(owners)
        self.platform.synchronize()  # no load reads a host copy this rewrites
        shadowed = []
        try:
            for tuner, owner in owners.items():
                for method in MERGES:
                    vars(tuner)[method] = functools.partial(self._merge, tuner, owner, method)
                    shadowed.append((tuner, method))
            return fuse()
        finally:
            try:
                self._close()
            finally:
                for tuner, method in shadowed:
                    vars(tuner).pop(method, None)

    def _owners(self, roots: list[nn.Module]) -> dict[nn.Module, Any]:
        """Each adapter layer under ``roots`` and the block holding it (None: no block)."""
        out: dict[nn.Module, Any] = {}
        for root in roots:
            for block in _blocks_under(root, self.layer):
                for m in block.modules():
                    if _is_tuner(m):
                        out[m] = self.streamed.get(id(block)) or self.resident.get(id(block))
            for m in root.modules():
                if _is_tuner(m) and m not in out:
                    out[m] = None
        return out

    def _refuse(self, owners: dict[nn.Module, Any]) -> None:
        for owner in {id(o): o for o in owners.values() if o is not None}.values():
            if not owner.host_writable or self.layer[id(owner.module)].region is None:
                raise OffloadError(
                    f"fuse_lora() / unfuse_lora() would rewrite block {owner.name!r}, whose host "
                    f"copy is {_why(self.layer[id(owner.module)])}: fuse before enabling "
                    "(backend.disable(), fuse, enable again)",
                    rank=self.rank,
                    block=owner.name,
                )

    def _merge(self, tuner: nn.Module, owner: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if owner is not None and owner is not self.open:
            self._close()
            self._open(owner)
        return getattr(type(tuner), method)(tuner, *args, **kwargs)

    def _open(self, owner: StreamedBlock | LayerBlock) -> None:
        """Bind ``owner``'s tensors to real device tensors for the merge."""
        self.open = owner
        if isinstance(owner, StreamedBlock):
            if owner.own is not None:  # pinned: its own device copy
                real = list(owner.own_views)
            else:
                raw = owner.shard.to(self.platform.device)
                real = [unpack_tensor(raw, s, self.platform.device) for s in owner.layout.tensors]
            for t, r in zip(owner.tensors, real):
                t.data = r
        self.before = [t.data for t in owner.tensors]

    def _close(self) -> None:
        """The open block's tensors back into its host copy (and pinned or resident device
        copy); a streamed block's slot copy evicted and its placeholders bound."""
        owner, self.open = self.open, None
        if owner is None:
            return
        self.platform.synchronize()
        layer = self.layer[id(owner.module)]
        copy_back(layer.host_view(), list(zip(owner.layout.tensors, owner.tensors)))
        if isinstance(owner, LayerBlock) or (owner.own is not None):
            for t, kept in zip(owner.tensors, self.before):  # PEFT may rebind .data
                if t.data.data_ptr() != kept.data_ptr():
                    kept.copy_(t.data)
                    t.data = kept
        if isinstance(owner, StreamedBlock):
            if owner.state == LOADED and owner.slot is not None:  # a stale copy in a slot
                self.scheduler.evict(owner.slot)
            for t, ph in zip(owner.tensors, owner.placeholders):
                t.data = ph
        self.platform.synchronize()


def _blocks_under(root: nn.Module, layer: dict[int, LayerBlock]) -> Iterator[nn.Module]:
    for m in root.modules():
        if id(m) in layer:
            yield m


def _is_tuner(m: nn.Module) -> bool:
    return hasattr(m, "base_layer") and hasattr(m, "adapter_layer_names")


def _why(b: LayerBlock) -> str:
    if b.layout.group_size > 1:
        return f"1/{b.layout.group_size} of it per rank (AllGather)"
    if b.mapped is not None:
        return "the read-only checkpoint (host_backing='mapped')"
    if b.node_shared:
        return "the node's shared copy"
    if b.encoded is not None:
        return "encoded (a codec: it would have to be encoded again)"
    return "not kept (no host region)"
