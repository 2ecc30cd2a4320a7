"""The codec of one layerwise enable: blocks encoded before the host region exists (their
sizes are known only then), laid into it, and decoded whole for disable and ``state_dict``
(see [Note: encoded blocks] in :mod:`dlo.codec.format`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dlo.codec.blocks import BlockDecoder, EncodedShard, encode_block
from dlo.codec.codecs import get_codec
from dlo.codec.format import EncodedLayout, write_pieces
from dlo.plan.layout import BlockLayout
from dlo.platform.device import Platform
from dlo.platform.progress import progress

Block = tuple[int, str, BlockLayout, Sequence[torch.Tensor], int]
"""``(manifest position, name, layout, the model's tensors, this rank's place in its weight
group)`` of a block to encode."""


class HostCodec:
    """Encodes this rank's encoded blocks at enable; decodes them back (its own stream)."""

    def __init__(self, platform: Platform, name: str) -> None:
        self.platform = platform
        self.name = name
        stream = platform.new_stream()  # the codec's, so the decoder's copies are ordered
        self.codec = get_codec(platform, name, stream)
        self.decoder = BlockDecoder(platform, self.codec, stream)
        self._pending: dict[int, tuple[EncodedLayout, list[torch.Tensor]]] = {}

    @property
    def bitstream(self) -> str:
        return self.codec.bitstream

    def encode(self, blocks: Sequence[Block]) -> dict[int, int]:
        """Encode ``blocks`` (held until :meth:`lay`); returns each one's encoded bytes by
        manifest position. Host memory: one raw shard and the encoded pieces."""
        if not blocks:
            return {}
        scratch = torch.empty(max(b[2].shard_nbytes for b in blocks), dtype=torch.uint8)
        for index, name, layout, tensors, group_rank in progress(
            blocks, desc="dlo: encode", total=len(blocks), unit="block"
        ):
            self._pending[index] = encode_block(
                self.platform, self.codec, name, layout, tensors, scratch, group_rank
            )
        return {i: enc.nbytes for i, (enc, _) in self._pending.items()}

    def lay(self, index: int, dst: torch.Tensor) -> EncodedShard:
        """Write block ``index``'s encoded pieces into ``dst`` (its bytes in the host region):
        its host copy from now on; the pieces are freed."""
        enc, datas = self._pending.pop(index)
        write_pieces(dst, enc, datas)
        return EncodedShard(enc, dst, self.decoder)

    def forget(self) -> None:
        """Drop encoded pieces not laid yet (a failed enable)."""
        self._pending.clear()
