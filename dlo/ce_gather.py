"""The copy-engine gather: AllGather as peer-to-peer copies between symmetric device slots.

[Note: copy-engine gather]
NCCL's AllGather runs as kernels: while the next block's chunks are gathered, NCCL's CTAs
hold SMs the running block's GEMMs want, and a gather launched before a peer's slice has
landed spins on them. Between GPUs of one node with peer access (NVLink), the gather needs
no SMs at all: every rank's slots live in one symmetric-memory allocation
(``torch.distributed._symmetric_memory``) mapped into every peer's address space, so rank r
pulls peer p's slice of chunk k straight out of p's copy of the *same* slot with a
device-to-device ``cudaMemcpyAsync``, which a copy engine carries over NVLink.

Per block, on rank r's comm stream (the copy stream is unchanged, [Note: chunk pipeline]):

    for k: wait(chunk_event[k]); barrier        # every rank's slice k is in its slot
           for p != r: S[slice(k, p)] <- peer p's S[slice(k, p)]
    barrier                                     # every rank has finished reading its peers
    record(S.ready)

The barrier is one small kernel on the stream (signal pads in the symmetric allocation),
bounded by ``collective_timeout_s``: on expiry it traps, which is a device error, and the
worker must be discarded (as after an NCCL timeout). The trailing barrier makes slot reuse
safe: a rank overwrites its own range of S only after its compute is done with the block
(``free``), which follows its trailing barrier, which no rank passes before every peer's
pulls are done.

Pulling from the same slot index on every rank relies on lock step: ranks that run the same
block sequence make the same slot choices ([Note: ring protocol]); the lock-step check
compares the slot index as well as the block.
"""

from __future__ import annotations

from typing import Any

import torch

from dlo.layout import BlockLayout


def symmetric_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 device buffer in symmetric memory (local allocation; no collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)


class CopyEngineGather:
    """Pulls peers' slices out of their copies of a symmetric slot buffer.

    Args:
        base: this rank's symmetric buffer holding every slot (from :func:`symmetric_empty`).
        group: the weight-collective process group (every rank passes its own buffer of the
            same size; the rendezvous is a collective on ``group``).
        group_rank, group_size: this rank's place in ``group``.
        timeout_s: bound of every barrier.
    """

    def __init__(
        self,
        base: torch.Tensor,
        group: Any,
        *,
        group_rank: int,
        group_size: int,
        timeout_s: float,
    ) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.handle = symm_mem.rendezvous(base, group)
        self.group_rank = group_rank
        self.base_ptr = base.data_ptr()
        self.nbytes = base.numel()
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self.peers = {
            p: self.handle.get_buffer(p, (self.nbytes,), torch.uint8)
            for p in range(group_size)
            if p != group_rank
        }

    def covers(self, dst: torch.Tensor) -> bool:
        """Whether ``dst`` lies in the symmetric buffer (resident blocks do not: NCCL)."""
        off = dst.data_ptr() - self.base_ptr
        return off >= 0 and off + dst.numel() <= self.nbytes

    def gather_chunk(self, dst: torch.Tensor, layout: BlockLayout, k: int) -> None:
        """Enqueue, on the current stream, the pull of every peer's slice of chunk ``k``
        into ``dst`` (a slot); this rank's slice must already be in place."""
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        off = dst.data_ptr() - self.base_ptr
        for p, peer in self.peers.items():
            s, e = layout.slice_range(k, p)
            dst[s:e].copy_(peer[off + s : off + e], non_blocking=True)

    def finish(self) -> None:
        """Enqueue the trailing barrier of a block (every peer is done reading)."""
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)
