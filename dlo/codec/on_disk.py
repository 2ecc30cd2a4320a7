"""Encoded blocks read from their encoded checkpoint at every use: the disk tier of a stack
with a codec.

Note [encoded blocks on disk]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ``host_budget_gb`` (see [Note: host budget tiers] in :mod:`dlo.plan.host_tiers`) a
block of a rank-local stack with a codec that does not fit the budget is not encoded at
enable (that would hold it in host memory) but served by the encoded checkpoint beside its
checkpoint (see [Note: encoded checkpoint] in :mod:`dlo.codec.offline`): the same entry an
enable would read into its host region, read instead into a read-ahead buffer at every use
(see [Note: disk read-ahead] in :mod:`dlo.runtime.read_ahead`), around the page cache (see
[Note: reads around the page cache] in :mod:`dlo.io.direct`), and handed to the transport's
decoder (see [Note: decode pipeline] in :mod:`dlo.runtime.decoding`). The disk gives the
encoded bytes: about 0.69x the raw ones for bf16 weights, so a disk-bound step is that
much shorter.

nvCOMP's decoder does not check its input (a corrupted byte faulted the device in the
probe), and a file can change under a long run: every piece of every read is checked
against the file's checksums, at every read (the loader's checkpoints check each piece
once), and a mismatch fails the forward naming the file and the block. Hashing runs on the
readers' threads beside the disk (one thread hashes about 2 GB/s).

A block no encoded checkpoint serves yet (none written, or written for other bytes, layout
or bitstream) is encoded once, at enable, into the encoded checkpoint beside its weights,
with the blocks the budget keeps in memory (later enables read those too), which keeps the
entries it had (:class:`~dlo.codec.spool.EncodedSpool`: one block in memory at a time, so a
model larger than the host's memory is encoded where it runs; the file is written once, under
a ``flock`` on its directory, so the ranks of a node sharing the folder encode it once and
the others read it; the lock does not reach across the nodes of a network filesystem, and
where the filesystem has none each rank encodes, with a warning). Where the folder takes
anonymous files (``O_TMPFILE``) that can be linked into place, the disk holds the new file
once beside the old one; elsewhere twice for a while (a spool, then the file: a Wan2.1-14B
folder with 26 GB free could not take the 2 x 19.5 GB, H100, 2026-12-07). Either way the
file is synced to the disk and dropped from the page cache before it is linked or renamed
into place (see [Note: writing files] in :mod:`dlo.io.files`): the forwards that follow read
it with ``O_DIRECT``, which Linux makes wait for a range's dirty pages to be written back
first (read after the enable that wrote it unsynced, Wan2.1-14B's 19.5 GB file gave 0.95 GB/s
against the raw checkpoint's 1.34 GB/s, H100, 2026-12-07), and its cached pages would sit
beside the host budget. Later enables read it. A block whose tensors are not all in one
checkpoint directory cannot be served, and is refused by name; so is a folder that cannot be
written.
The budget holds the kept blocks' encoded copies, so the tiers are chosen by their encoded
bytes: where a first choice by raw bytes leaves a coded block on disk, the file is completed
with every streamed coded block first and the choice made again
(:func:`dlo.backends.layer_codec_disk.file_nbytes`).
Resident blocks on the disk tier are read the same way, once. At disable the block's tensors
alias its raw checkpoint again, as on the raw disk tier.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dlo.codec.blocks import BlockDecoder, EncodedShard
from dlo.codec.format import EncodedLayout
from dlo.host.packer import fill_ranges
from dlo.io.checkpoint import Checkpoint
from dlo.io.direct import DirectReads


@dataclass(eq=False)
class EncodedOnDisk:
    """One encoded block served by its encoded checkpoint (see the note)."""

    name: str
    layout: EncodedLayout
    checkpoint: Checkpoint
    """The encoded checkpoint (opened verifying checksums), retained while it serves."""
    reads: DirectReads
    decoder: BlockDecoder
    """What decodes a whole block outside the ring (the codec's)."""

    @property
    def read_nbytes(self) -> int:
        return self.layout.nbytes

    def fill(self, dst: torch.Tensor, *, pool: ThreadPoolExecutor | None = None) -> None:
        """The block's encoded bytes into ``dst``, every piece checked (see the note)."""
        assert dst.numel() == self.read_nbytes
        fill_ranges(
            dst,
            [(0, 0, self.read_nbytes, 0)],
            [(self.checkpoint, self.name)],
            pool=pool,
            read=self._read,
        )

    def _read(self, ckpt: Checkpoint, name: str, offset: int, out: memoryview) -> None:
        self.reads.read_into(ckpt, name, offset, out, every_read=True)

    def shard(self, data: torch.Tensor) -> EncodedShard:
        """The block as the transport loads it, its bytes in ``data`` (a read-ahead buffer)."""
        return EncodedShard(self.layout, data, self.decoder)
