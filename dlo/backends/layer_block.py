"""A selected block during the layerwise install: its plan, its module, the model's tensors
and where its bytes are kept (:mod:`dlo.backends.layer_host` builds its host storage)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dlo.codec.blocks import EncodedShard
from dlo.codec.on_disk import EncodedOnDisk
from dlo.host.mapped import MappedBlock
from dlo.host.region import HostRegion
from dlo.plan.layers import BlockPlan
from dlo.plan.layout import BlockLayout, module_wrappers
from dlo.plan.subclasses import Wrapped
from dlo.plan.topology import BlockStack


@dataclass(eq=False)
class LayerBlock:
    """A selected block during install: its plan, its module and the model's tensors."""

    plan: BlockPlan
    module: nn.Module
    entries: list[tuple[str, str, torch.Tensor]]
    """``(name, kind, tensor)`` of the block's tensors, in layout order."""
    index: int
    """Position in the manifest."""
    region: HostRegion | None = None
    """The host region holding this block: this rank's, or the node-shared copy."""
    host_index: int = -1
    """The block's index in ``region``."""
    original_devices: list[torch.device] = field(default_factory=list)
    mapped: MappedBlock | None = None
    """With ``host_backing="mapped"``, or left in its file by ``host_budget_gb``: the
    block's host backing (no region bytes)."""
    device_buffer: torch.Tensor | None = None
    """A resident block's own device buffer (its tensors are views of it)."""
    restored: bool = False
    """``disable(restore=True)`` gathered this AllGather block back into ordinary tensors."""
    encoded: EncodedShard | EncodedOnDisk | None = None
    """With a codec: the block's host copy, encoded (its region's or encoded file's bytes)."""
    wrapped: list[Wrapped] = field(init=False)
    """Its wrapper-subclass tensors (``entries`` holds their inner tensors; see [Note:
    tensor subclasses])."""
    wrapper_devices: list[torch.device] = field(default_factory=list)
    released: bool = False
    """The model's originals were released (their bytes are in the host copy)."""

    def __post_init__(self) -> None:
        self.wrapped = module_wrappers(self.module)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def stack(self) -> BlockStack:
        return self.plan.stack

    @property
    def resident(self) -> bool:
        return self.plan.resident

    @property
    def layout(self) -> BlockLayout:
        return self.plan.layout

    @property
    def node_shared(self) -> bool:
        return self.plan.node_shared

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for _, _, t in self.entries]

    @property
    def host_writable(self) -> bool:
        """Its host copy is this rank's own whole block, so in-place writes can go back
        (not with AllGather, the mapped backing or a node-shared copy)."""
        return (
            self.layout.group_size == 1
            and self.mapped is None
            and not self.node_shared
            and self.encoded is None
        )

    @property
    def from_disk(self) -> bool:
        """Left in its file by ``host_budget_gb``: its tensors can alias the file again."""
        return self.mapped is not None and self.mapped.reads is not None

    @property
    def shard(self) -> torch.Tensor | MappedBlock | EncodedShard | EncodedOnDisk:
        """What the block's transport loads: its host bytes, encoded or mapped ones."""
        return self.encoded or self.mapped or self.host_view()

    def host_view(self) -> torch.Tensor:
        """The block's bytes in its host region."""
        assert self.region is not None
        return self.region.view(self.host_index)
