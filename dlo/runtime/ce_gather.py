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

A barrier is either stream memory operations on counters in the symmetric allocation (no
kernel; [Note: barriers without kernels]) or torch's barrier kernel on the signal pads;
either is bounded by ``collective_timeout_s`` (a watchdog on both; the kernel also traps on
the device), after which the worker must be discarded (as after an NCCL timeout). The trailing barrier makes
slot reuse safe: a rank overwrites its own range of S only after its compute is done with the block
(``free``), which follows its trailing barrier, which no rank passes before every peer's
pulls are done.

Pulling from the same slot index on every rank relies on lock step: ranks that run the same
block sequence make the same slot choices ([Note: ring protocol]); the lock-step check
compares the slot index as well as the block.

[Note: lock-step tags]
With kernel-free barriers, the lock-step check needs no NCCL gather either. Before a block's
first barrier, each rank writes its (block, slot) tag into its own tag words of every rank's
allocation (stream writes, ordered before the barrier's fenced counter write); after that
barrier every tag of the block is in place, and each rank copies the tag words to pinned
host memory for the usual asynchronous comparison ([Note: lock-step check]). The copy is
enqueued before the block's trailing barrier, and a rank writes the next block's tags only
after passing that barrier, so the copy never sees the next block's tags.

[Note: barriers without kernels]
torch's symmetric-memory barrier is a kernel: one CTA that spins on the signal pads until
every peer arrived. A spinning CTA holds its SM; when the running block's GEMMs are
persistent kernels sized to the whole GPU (as cuBLAS's Hopper kernels can be), one of their
CTAs cannot start until the barrier exits, so a barrier waiting on a late peer can stretch
a GEMM (the hypothesis behind this design; the profile with NCCL's spinning gathers showed
compute, not waiting, grow). When the driver
has stream memory operations, dlo's barrier uses none: each rank keeps one 32-bit counter
per peer in its symmetric allocation (after the slots); barrier number n writes n into its
own word on every peer (``cuStreamWriteValue32``: a fenced write, after the stream's earlier
copies) and waits until every peer's word on this rank reaches n (``cuStreamWaitValue32``,
cyclic >=, so the counters may wrap). The stream's front end does both; no SM is involved.
Counters only grow and every rank counts the same barriers (lock step), so a rank that is
ahead simply leaves a larger number. A stream wait has no timeout of its own: a watchdog
thread follows each block's trailing barrier (an event after it; an earlier barrier that
never completes holds it back too) and, when one has been the oldest unfinished for
``collective_timeout_s``, logs which block it belongs to and ends the process (as NCCL's
watchdog does after a collective timeout), since a device stream that never finishes leaves
no other bounded way out; a device error seen while polling (a barrier kernel's trap) ends
it at once. The same watchdog follows the barrier kernels: a kernel's own timeout runs only
once it has started, and one queued behind an unmatched NCCL gather (the lock-step check's,
when a peer stopped) never starts. (On two H200s a diverging rank with barrier kernels and
no watchdog ran to the test's 120 s bound instead of ending.) Which barrier is used is agreed by the group at enable (stream memory
operations only if every rank can use them).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any

import torch

from dlo.plan.layout import BlockLayout
from dlo.platform.device import Platform
from dlo.runtime.collectives import all_gather_objects

logger = logging.getLogger(__name__)


FLAG_NBYTES = 4096
"""Bytes after the slots in the symmetric allocation (zeroed before the rendezvous): one
uint32 barrier counter per peer from word 0, the lock-step tags from :data:`TAG_WORD`, and
a probe word at the end."""


TAG_WORD = 256
"""Rank p's tag of the block being gathered is the int64 pair at words ``TAG_WORD + 4p``
(block index, written as its low 32 bits) and ``TAG_WORD + 4p + 2`` (slot index); the high
words stay zero. Room for 192 ranks."""


PROBE_WORD = FLAG_NBYTES // 4 - 1


def symmetric_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 device buffer in symmetric memory (local allocation; no collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)


class SyncWatchdog:
    """Ends the process when one barrier stays unfinished too long (see [Note: barriers
    without kernels]); ``on_expire`` is replaceable for tests."""

    def __init__(
        self,
        platform: Platform,
        timeout_s: float,
        *,
        poll_s: float = 0.05,
        on_expire: Any = None,
    ) -> None:
        self.platform = platform
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.on_expire = on_expire or _abort
        self._pending: deque[tuple[Any, str]] = deque()
        self._spare: deque[Any] = deque()
        self._head_since = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, stream: Any, what: str) -> None:
        """Follow the barrier just enqueued on ``stream`` (an event after it)."""
        event = self._spare.popleft() if self._spare else self.platform.new_event()
        event.record(stream)
        if not self._pending:
            self._head_since = time.monotonic()
        self._pending.append((event, what))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dlo-ce-watchdog", daemon=True)
            self._thread.start()

    def check(self) -> None:
        """Drop finished barriers; fire when the oldest has waited past the timeout, or at
        once when the device reports an error (a barrier kernel that trapped at its
        timeout leaves the context unusable: every later call fails or hangs)."""
        try:
            while self._pending and self._pending[0][0].query():
                self._spare.append(self._pending.popleft()[0])
                self._head_since = time.monotonic()
        except RuntimeError as e:
            what = self._pending[0][1]
            self._pending.clear()
            self.on_expire(
                f"dlo: the device reported an error while block {what!r} was being gathered "
                f"(its cause may be any kernel of this process: {e}); the context is unusable: "
                "ending this worker"
            )
            return
        if self._pending and time.monotonic() - self._head_since > self.timeout_s:
            what = self._pending[0][1]
            self._pending.clear()
            self.on_expire(
                f"dlo: copy-engine gather of block {what!r} did not complete within "
                f"{self.timeout_s:.0f}s (collective_timeout_s): a peer is missing or runs a "
                "different block sequence; ending this worker"
            )

    def _run(self) -> None:
        # this rank's device: a thread starts on device 0, where a CUDA call would otherwise
        # create a context (memory on another rank's GPU)
        with self.platform.device_context():
            while not self._stop.wait(self.poll_s):
                self.check()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self._pending.clear()


def _completes(event: Any, timeout_s: float) -> bool:
    """Whether ``event`` completes within ``timeout_s`` (polled, the host never blocks)."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _abort(message: str) -> None:
    logger.critical(message)
    os._exit(70)


class _KernelBarrier:
    """torch's symmetric-memory barrier kernel, on the current stream (the comm stream).

    It traps on the device at its timeout, but that alone does not bound the worker: a
    barrier enqueued behind work that never finishes (the lock-step check's NCCL gather
    unmatched by a peer that stopped) never starts, so its own timeout never runs. The
    watchdog follows a block's trailing barrier here as with stream barriers."""

    name = "kernel"

    def __init__(self, handle: Any, timeout_s: float, *, watchdog: SyncWatchdog) -> None:
        self.handle = handle
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self.watchdog = watchdog

    def __call__(self, stream: Any, what: str, *, track: bool = False) -> None:
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        if track:
            self.watchdog.track(stream, what)

    def close(self) -> None:
        self.watchdog.close()


class _FlagBarrier:
    """Counters and stream memory operations (see [Note: barriers without kernels])."""

    name = "stream"

    def __init__(
        self,
        platform: Platform,
        mine: dict[int, int],
        theirs: dict[int, int],
        *,
        watchdog: SyncWatchdog,
    ) -> None:
        self.platform = platform
        self.mine = mine
        """peer -> address of that peer's counter in this rank's allocation."""
        self.theirs = theirs
        """peer -> address of this rank's counter in that peer's allocation."""
        self.watchdog = watchdog
        self.count = 0

    def __call__(self, stream: Any, what: str, *, track: bool = False) -> None:
        """One barrier on ``stream``; ``track``: follow it with the watchdog (a block's last
        barrier: any earlier one that never completes holds it back too)."""
        self.count += 1
        for address in self.theirs.values():
            self.platform.stream_write_u32(stream, address, self.count)
        for address in self.mine.values():
            self.platform.stream_wait_u32(stream, address, self.count)
        if track:
            self.watchdog.track(stream, what)

    def close(self) -> None:
        self.watchdog.close()


PROBE_TIMEOUT_S = 5.0


def can_use_stream_ops(
    platform: Platform, probe: torch.Tensor, peer_words: list[int] | None = None
) -> bool:
    """Whether this rank's driver runs stream memory operations: on a fresh stream, a write
    then a wait on ``probe`` (one zeroed uint32 of its own allocation), and a write of 0 to
    each of ``peer_words`` (this rank's counters in its peers' allocations, still 0), all
    finished within :data:`PROBE_TIMEOUT_S` (a wait that never returns is a "no", not a
    hang: the probe word is then set by an ordinary kernel to release the wait, because a
    stream left waiting would hang every later device synchronization; if even that does not
    release it, the worker ends as after a barrier timeout)."""
    try:
        stream = platform.new_stream()
        platform.stream_write_u32(stream, probe.data_ptr(), 1)
        platform.stream_wait_u32(stream, probe.data_ptr(), 1)
        for address in peer_words or ():
            platform.stream_write_u32(stream, address, 0)
        done = platform.new_event()
        done.record(stream)
        if not _completes(done, PROBE_TIMEOUT_S):
            logger.warning("stream memory operations did not complete: kernel barriers")
            with platform.stream(platform.new_stream()):
                probe.fill_(1)
            if not _completes(done, PROBE_TIMEOUT_S):
                _abort(
                    "dlo: a stream memory operation probe stays blocked on the device; every "
                    "later synchronization would hang: ending this worker"
                )
            probe.zero_()
            return False
        ok = int(probe.item()) == 1
        probe.zero_()
        return ok
    except (RuntimeError, OSError, AttributeError, NotImplementedError) as e:
        logger.info("stream memory operations unavailable (%s): kernel barriers", e)
        return False


def flag_addresses(
    rank: int, flag_bases: list[int]
) -> tuple[dict[int, int], dict[int, int], list[int]]:
    """Addresses of rank ``rank``'s barrier counters and tag words.

    Args:
        rank: this rank's place in the group.
        flag_bases: for every rank q, where q's flag region (the last :data:`FLAG_NBYTES` of
            its allocation) is mapped in this process.

    Returns:
        ``(mine, theirs, tags)``: peer -> its counter in this rank's region; peer -> this
        rank's counter in that peer's region; for every rank q, this rank's tag words in
        q's region (block index at the address, slot index 8 bytes on).
    """
    group_size = len(flag_bases)
    if TAG_WORD + 4 * group_size > PROBE_WORD:
        raise ValueError(f"copy-engine gather supports at most 191 ranks, got {group_size}")
    word = 4
    peers = [p for p in range(group_size) if p != rank]
    mine = {p: flag_bases[rank] + p * word for p in peers}
    theirs = {p: flag_bases[p] + rank * word for p in peers}
    tags = [base + (TAG_WORD + 4 * rank) * word for base in flag_bases]
    return mine, theirs, tags


class CopyEngineGather:
    """Pulls peers' slices out of their copies of a symmetric slot buffer.

    Args:
        platform: this rank's CUDA platform.
        base: this rank's symmetric buffer: every slot, then :data:`FLAG_NBYTES` of zeroed
            counters (see :class:`dlo.runtime.slots.SlotPool`).
        group: the weight-collective process group (every rank passes its own buffer of the
            same size; the rendezvous and the choice of barrier are collectives on it).
        group_rank, group_size: this rank's place in ``group``.
        timeout_s: bound of every barrier.
        sync: ``"auto"``, ``"stream"`` or ``"kernel"`` (``OffloadConfig.gather_sync``; see
            [Note: barriers without kernels]).
    """

    def __init__(
        self,
        platform: Platform,
        base: torch.Tensor,
        group: Any,
        *,
        group_rank: int,
        group_size: int,
        timeout_s: float,
        sync: str = "auto",
    ) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        if sync not in ("auto", "stream", "kernel"):
            raise ValueError(f"sync={sync!r} is not one of 'auto', 'stream', 'kernel'")
        self.platform = platform
        self.group_rank = group_rank
        self.base_ptr = base.data_ptr()
        self.nbytes = base.numel()
        flags = base[self.nbytes - FLAG_NBYTES :].view(torch.int32)
        platform.synchronize()  # counters zeroed before any peer can write to them
        self.handle = symm_mem.rendezvous(base, group)
        # peers' buffers at this tensor's place in their allocations (torch versions that
        # carve symmetric tensors out of a pool put them at an offset; 2.11 does not)
        offset = int(getattr(self.handle, "offset", 0) or 0)
        at = {"storage_offset": offset} if offset else {}
        self.peers = {
            p: self.handle.get_buffer(p, (self.nbytes,), torch.uint8, **at)
            for p in range(group_size)
            if p != group_rank
        }
        flag_bases = [
            (self.base_ptr if q == group_rank else self.peers[q].data_ptr())
            + self.nbytes
            - FLAG_NBYTES
            for q in range(group_size)
        ]
        mine, theirs, tag_addrs = flag_addresses(group_rank, flag_bases)
        local_ok = sync != "kernel" and can_use_stream_ops(
            platform, flags[PROBE_WORD : PROBE_WORD + 1], list(theirs.values())
        )
        everyone_ok = all(all_gather_objects(local_ok, group))  # one choice for the group
        if sync == "stream" and not everyone_ok:
            raise RuntimeError("sync='stream': a rank of the group has no stream memory operations")
        if everyone_ok:
            self._tag_addrs = tag_addrs
            self.barrier: _KernelBarrier | _FlagBarrier = _FlagBarrier(
                platform, mine, theirs, watchdog=SyncWatchdog(platform, timeout_s)
            )
        else:
            self._tag_addrs = []
            self.barrier = _KernelBarrier(
                self.handle, timeout_s, watchdog=SyncWatchdog(platform, timeout_s)
            )
        self.tags = flags[TAG_WORD : TAG_WORD + 4 * group_size].view(torch.int64)
        """Every rank's (block, slot) tag in this rank's allocation (2 x group_size int64)."""
        logger.info("dlo copy-engine gather: %s barriers", self.barrier.name)

    @property
    def sync(self) -> str:
        return self.barrier.name

    def covers(self, dst: torch.Tensor) -> bool:
        """Whether ``dst`` lies in the slots (resident blocks do not: NCCL gathers them)."""
        off = dst.data_ptr() - self.base_ptr
        return off >= 0 and off + dst.numel() <= self.nbytes - FLAG_NBYTES

    @property
    def has_tags(self) -> bool:
        """Whether the lock-step check can use tags (kernel-free barriers only)."""
        return bool(self._tag_addrs)

    def post_tag(self, stream: Any, index: int, slot: int) -> None:
        """Enqueue on ``stream`` the writes of this rank's (block, slot) tag into every
        rank's allocation; the next barrier makes them visible (see [Note: lock-step
        tags])."""
        for address in self._tag_addrs:
            self.platform.stream_write_u32(stream, address, index)
            self.platform.stream_write_u32(stream, address + 8, slot)

    def wait_chunk(self, stream: Any, what: str) -> None:
        """Enqueue on ``stream`` the barrier before the pulls of a chunk (every rank's
        slice has landed, and every rank's tag for this block is in place)."""
        self.barrier(stream, what)

    def pull_chunk(self, dst: torch.Tensor, layout: BlockLayout, k: int) -> None:
        """Enqueue on the current stream the copies of every peer's slice of chunk ``k``
        into ``dst`` (a slot); after :meth:`wait_chunk`."""
        off = dst.data_ptr() - self.base_ptr
        for p, peer in self.peers.items():
            s, e = layout.slice_range(k, p)
            dst[s:e].copy_(peer[off + s : off + e], non_blocking=True)

    def finish(self, stream: Any, what: str) -> None:
        """Enqueue the trailing barrier of a block (every peer is done reading)."""
        self.barrier(stream, what, track=True)

    def close(self) -> None:
        """Stop the watchdog (disable; the device was synchronized)."""
        self.barrier.close()
