"""The codec of one layerwise enable: blocks encoded before the host region exists (their
sizes are known only then), laid into it, and decoded whole for disable and ``state_dict``
(see [Note: encoded blocks] in :mod:`dlo.codec.format`).

[Note: released as encoded]
A whole block (group size 1) encoded at enable releases the model's originals as soon as
its pieces are held, so the host never holds the model and every encoded block at once:
the peak is about the larger of the two, plus one raw shard. Until the block is laid into
the host region, a failed enable rebuilds it from its pieces (:meth:`HostCodec.pending_raw`);
once laid, from the region, which the journal closes only after every release is undone.
A block read from an encoded checkpoint keeps its originals until it is laid (they alias
the checkpoint file; nothing to gain), and so do AllGather slices (the region holds 1/G).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dlo.codec.blocks import BlockDecoder, EncodedShard, encode_packed, pack_raw
from dlo.codec.codecs import get_codec
from dlo.codec.format import EncodedLayout, Piece, check_bitstream, check_layout, write_pieces
from dlo.codec.offline import (
    ENCODED_FILE,
    EncodedFiles,
    Origin,
    Reader,
    origin_of,
    write_encoded,
)
from dlo.codec.on_disk import EncodedOnDisk
from dlo.errors import OffloadError
from dlo.host.bounce import Bounce
from dlo.host.node_share import share_step
from dlo.io.checkpoint import Checkpoint
from dlo.journal import atomic
from dlo.plan.layout import BlockLayout
from dlo.platform.device import Platform
from dlo.platform.progress import progress

logger = logging.getLogger(__name__)

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
        self.bounces = (Bounce(platform), Bounce(platform))
        """The encode pass's (see [Note: bounce buffer]): released at its end, or by
        :meth:`forget` if an interrupt came before that."""
        self._pending: dict[int, tuple[EncodedLayout, list[torch.Tensor] | Reader]] = {}
        """Encoded blocks not laid yet: their pieces, or the reader of their encoded bytes
        in an encoded checkpoint."""
        self.files = EncodedFiles()
        self.origins: dict[int, Origin] = {}
        """The checkpoint of each block of group size 1 whose tensors alias one (what
        :meth:`save` writes beside)."""
        self.failed_writes: dict[Path, ValueError] = {}
        """Encoded checkpoints that could not be written this enable (not tried again)."""
        self.retained: list[Checkpoint] = []
        """The encoded checkpoints serving blocks on disk (see
        :mod:`dlo.backends.layer_codec_disk`)."""
        self.read_blocks = 0
        """Blocks read from an encoded checkpoint instead of encoded (see [Note: encoded
        checkpoint] in :mod:`dlo.codec.offline`)."""

    @property
    def bitstream(self) -> str:
        return self.codec.bitstream

    def encode(
        self, blocks: Sequence[Block], released: Callable[[int], Any] | None = None
    ) -> dict[int, int]:
        """Encode ``blocks``, or find them in an encoded checkpoint (held until
        :meth:`lay`); returns each one's encoded bytes by manifest position. Host memory:
        two raw shards (pinned) and the encoded pieces of the blocks encoded here.
        ``released(index)`` is called as soon as a block's pieces are held (see [Note:
        released as encoded])."""
        todo: list[Block] = []
        for block in blocks:
            index, _, layout, tensors, _ = block
            origin = self.origin(index, layout, tensors)
            found = self.files.find(layout, origin, self.bitstream)
            if found is None:
                todo.append(block)
            else:
                self._pending[index] = found
                self.read_blocks += 1
        if todo:
            self._encode(todo, released)
        return {i: enc.nbytes for i, (enc, _) in self._pending.items()}

    def _encode(self, todo: Sequence[Block], released: Callable[[int], Any] | None) -> None:
        """Encode ``todo`` in order: block k + 1 is packed on a thread into one bounce buffer
        while block k is encoded from the other (see [Note: bounce buffer])."""
        nbytes = max(b[2].shard_nbytes for b in todo)
        bounces = self.bounces

        def pack(k: int) -> torch.Tensor:
            _, _, layout, tensors, group_rank = todo[k]
            return pack_raw(layout, tensors, bounces[k % 2], group_rank)

        pool = ThreadPoolExecutor(1, thread_name_prefix="dlo-encode-pack")
        ahead: Future[torch.Tensor] | None = None
        try:
            for b in bounces:
                b.view(nbytes)  # sized once, before the thread writes into either
            ahead = pool.submit(pack, 0)
            for k in progress(range(len(todo)), desc="dlo: encode", total=len(todo), unit="block"):
                assert ahead is not None  # block k's pack, submitted before
                raw = ahead.result()
                ahead = pool.submit(pack, k + 1) if k + 1 < len(todo) else None
                index, name, layout, _, _ = todo[k]
                self._pending[index] = encode_packed(
                    self.platform, self.codec, name, layout, raw, bounces[k % 2]
                )
                if released is not None:
                    released(index)
        finally:
            with atomic():  # [Note: interrupts during enable]: nothing left behind
                if ahead is not None and not ahead.cancel():  # never free what a pack writes
                    with contextlib.suppress(BaseException):
                        ahead.result()
                pool.shutdown(wait=True)
                for b in bounces:
                    b.close()

    def holds(self, index: int) -> bool:
        """Block ``index``'s encoded pieces are held, not laid yet."""
        entry = self._pending.get(index)
        return entry is not None and not callable(entry[1])

    def pending_raw(self, index: int, device: torch.device) -> torch.Tensor:
        """Block ``index``'s raw shard, decoded from its pieces held (the rebuild of a block
        released as encoded, when the enable fails before it is laid)."""
        enc, datas = self._pending[index]
        assert not callable(datas)
        buffer = torch.empty(enc.nbytes, dtype=torch.uint8)
        write_pieces(buffer, enc, datas)
        return self.shard(enc, buffer).raw(device)

    def origin(
        self, index: int, layout: BlockLayout, tensors: Sequence[torch.Tensor]
    ) -> Origin | None:
        """Block ``index``'s origin (group size 1 only), found once: its fingerprints stat
        files and hash the tensors no checkpoint holds."""
        if index not in self.origins and layout.group_size == 1:
            origin = origin_of(tensors)
            if origin is not None:
                self.origins[index] = origin
        return self.origins.get(index)

    def layout(self, index: int) -> EncodedLayout:
        """The piece table of block ``index``, encoded and not laid yet."""
        return self._pending[index][0]

    def write(self, index: int, dst: torch.Tensor) -> None:
        """Write block ``index``'s encoded bytes into ``dst`` (its bytes in the host region):
        its pieces, freed, or read from its encoded checkpoint (verified)."""
        enc, datas = self._pending[index]
        if callable(datas):
            datas(dst)
        else:
            write_pieces(dst, enc, datas)
        del self._pending[index]  # only once laid: until then a rollback rebuilds from them
        if not self._pending:
            self.files.close()

    def reencode(
        self, index: int, name: str, layout: BlockLayout, tensors: Sequence[torch.Tensor]
    ) -> tuple[EncodedLayout, list[torch.Tensor]]:
        """Block ``index`` encoded again from ``tensors`` (a LoRA fuse rewrote them: see [Note:
        fusing while streaming] in :mod:`dlo.backends.lora_fuse`): its piece table and
        pieces, for :meth:`place`. Its bytes are no longer its checkpoint's: its origin is
        dropped, so :meth:`save` never writes them under the checkpoint's fingerprints. The
        bounce buffers stay for the next block (:meth:`release_bounces`)."""
        raw = pack_raw(layout, tensors, self.bounces[0])
        enc, datas = encode_packed(self.platform, self.codec, name, layout, raw, self.bounces[1])
        self.origins.pop(index, None)
        return enc, datas

    def place(
        self, name: str, enc: EncodedLayout, datas: list[torch.Tensor], dst: torch.Tensor
    ) -> EncodedShard:
        """:meth:`reencode`'s block laid into ``dst`` (its bytes in the host region) where it
        fits, else into host memory of its own (pageable: the pin budget is spent)."""
        if enc.nbytes <= dst.numel():
            out = dst[: enc.nbytes]
        else:
            logger.warning(
                "dlo: block %s encoded again takes %d bytes, more than its %d in the host "
                "region: it moves to pageable memory of its own (its loads are slower)",
                name,
                enc.nbytes,
                dst.numel(),
            )
            out = torch.empty(enc.nbytes, dtype=torch.uint8)
        write_pieces(out, enc, datas)
        return self.shard(enc, out)

    def release_bounces(self) -> None:
        """Free the bounce buffers of an encode pass."""
        for bounce in self.bounces:
            bounce.close()

    def shard(self, layout: EncodedLayout, data: torch.Tensor) -> EncodedShard:
        """The host copy of an encoded block whose pieces ``data`` holds (laid here, or by
        another sharer of a node-shared copy)."""
        return EncodedShard(layout, data, self.decoder)

    def lay(self, index: int, dst: torch.Tensor) -> EncodedShard:
        """Write block ``index``'s encoded pieces into ``dst``: its host copy from now on."""
        layout = self.layout(index)
        self.write(index, dst)
        return self.shard(layout, dst)

    def encode_shared(
        self, packs: Mapping[int, Sequence[Block]], *, rank: int, world_size: int, timeout_s: float
    ) -> dict[int, EncodedLayout]:
        """Encode the node-shared blocks this rank packs (``packs[rank]``; ``packs`` holds
        every sharer's, by rank) and exchange the piece tables with every rank: the node's
        copy is sized only once every block is encoded, and each sharer encodes 1/L of them
        (see [Note: node-shared host copy] in :mod:`dlo.host.node_share`). A failure anywhere
        is the same error on every rank; a sharer's table is checked before it sizes the copy.

        Returns:
            The piece table of every block in ``packs``, by manifest position.
        """

        for blocks in packs.values():  # every block's origin, for save(): all sharers' too
            for index, _, layout, tensors, _ in blocks:
                self.origin(index, layout, tensors)

        def encode_mine() -> list[tuple[int, EncodedLayout]]:
            self.encode(packs[rank])
            return [(b[0], self.layout(b[0])) for b in packs[rank]]

        replies = share_step(
            encode_mine,
            [],
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            topic="host-share-encoded",
            what="node-shared encoded blocks",
            types=(EncodedLayout, Piece),
        )
        by_rank = dict(enumerate(replies)) if world_size > 1 else {rank: replies[0]}
        layouts: dict[int, EncodedLayout] = {}
        for r, blocks in packs.items():
            tables = dict(by_rank[r])
            for index, name, layout, _, _ in blocks:
                enc = tables.get(index)
                if not isinstance(enc, EncodedLayout) or enc.name != name:
                    raise OffloadError(
                        f"rank {r} sent no piece table for node-shared block {name!r}, which "
                        "it encodes",
                        rank=rank,
                        block=name,
                    )
                check_bitstream(enc, self.bitstream, rank=rank)
                check_layout(
                    enc,
                    layout.shard_nbytes,
                    layout.slice_nbytes,
                    source=f" (sent by rank {r})",
                    rank=rank,
                )
                layouts[index] = enc
        return layouts

    def save(
        self, blocks: Sequence[tuple[BlockLayout, int, EncodedShard | EncodedOnDisk]]
    ) -> list[Path]:
        """Write ``blocks`` (``(layout, manifest position, host copy)``) as encoded
        checkpoints, one beside each checkpoint they were loaded from (see [Note: encoded
        checkpoint] in :mod:`dlo.codec.offline`).

        Raises:
            ValueError: no block of group size 1 comes from a checkpoint.
        """
        return [
            write_encoded(d / ENCODED_FILE, self.bitstream, items)
            for d, items in self._by_directory(blocks).items()
        ]

    def save_targets(
        self, blocks: Sequence[tuple[BlockLayout, int, EncodedShard | EncodedOnDisk]]
    ) -> list[Path]:
        """The files :meth:`save` would write, writing nothing (every rank can check them:
        each records every block's origin).

        Raises:
            ValueError: as :meth:`save`.
        """
        return [d / ENCODED_FILE for d in self._by_directory(blocks)]

    def _by_directory(
        self, blocks: Sequence[tuple[BlockLayout, int, EncodedShard | EncodedOnDisk]]
    ) -> dict[Path, list[tuple[BlockLayout, Origin, EncodedLayout, torch.Tensor]]]:
        by_dir: dict[Path, list[tuple[BlockLayout, Origin, EncodedLayout, torch.Tensor]]] = {}
        for layout, index, shard in blocks:
            if not isinstance(shard, EncodedShard):
                raise ValueError(
                    f"save_encoded: block {layout.name!r} is served by the encoded checkpoint "
                    f"on disk ({shard.checkpoint.entries[shard.name].file}), which holds it already: to write a "
                    "new one, enable without host_budget_gb"
                )
            origin = self.origins.get(index)
            if origin is not None and origin.directory is not None:
                item = (layout, origin, shard.layout, shard.data)
                by_dir.setdefault(origin.directory, []).append(item)
        if not by_dir:
            raise ValueError(
                "save_encoded writes encoded blocks beside the checkpoint they were loaded "
                "from, but no encoded block of group size 1 (rank-local, node-shared) "
                "comes from a checkpoint: load the model with dlo.load_pipeline (a tensor "
                "written or replaced since the load no longer comes from it)"
            )
        return by_dir

    def forget(self) -> None:
        """Drop encoded pieces not laid yet (a failed enable), and the bounce buffers
        (recorded before any block is released: runs after every restore)."""
        self._pending.clear()
        self.files.close()
        self.decoder.close()
        for b in self.bounces:
            b.close()
