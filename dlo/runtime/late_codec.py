"""The codec turned on between forwards, for a ring measured to wait on its copies.

[Note: codec turned on by measurement]
``codec="auto"`` takes the codec at enable only where the block's compute time is given
(``block_compute_ms``): before any forward ran, the policy cannot tell a transfer-bound ring
(the codec saves about 0.3 of every copy) from a compute-bound one (the decode costs a few
percent). So the forwards tell. A re-planned DiT ring (see [Note: re-plan between forwards]
in :mod:`dlo.plan.replan`) whose config asked for ``"auto"`` with no compute time and no
host or pin budget (the encoded copies would come on top of either), and whose stacks took
``"none"``, times its forwards on the device (:mod:`dlo.runtime.forward_timing`: each
forward's span from its first block's entry to its last block's exit, and its blocks'
exposed wait, the compute stream waiting for a copy, from events of that forward, read once
complete, never dropped however far the host runs ahead). A ring whose last
:data:`MEASURED_FORWARDS` steady forwards (not the first, none that began with a re-plan
applying) each waited at least :data:`EXPOSED_SHARE` of the forward is *transfer-bound*, and
its streamed blocks are encoded:

1. in the background, on a thread and a stream of its own, one piece (a slice) at a time:
   the device holds two pieces of temporaries, never a block; the raw host copies stay as
   they are and keep serving the loads meanwhile. Only where the host has room for the
   encoded copies (``MemAvailable`` over the node's ranks, against the raw bytes).
2. at the start of the first forward after the last block is encoded (between forwards,
   with the ring's claim: no block runs): the encoded pieces laid into a host region of
   their own (pinned), one decoder for them, and each block's shard and transport switched
   to the encoded copy and the decoding transport (the device synchronized once first: a
   load issued before the switch must not be freed on the decoder's stream). A block whose
   host copy was written since its encode began (a write kept into the host shard, a LoRA
   fuse: its ``host_version`` moved) is not switched.

The re-planner takes no observation from a forward start after which the encode ran or at
which the switch allocated (their device memory is no forward's), and re-plans from what it
knew; the encode holds no device memory while the re-planner reads and plans it
(:attr:`LateCodec.device_lock`: it waits at most one piece's encode). Every output bit stays the same: the codec is lossless and the loads write the same
bytes into the slots. The raw host copies stay (disable and restores read them as before;
the host holds both, pinned); a block written in place after the switch goes back to its
raw copy and transport first (:meth:`StreamedBlock.to_raw
<dlo.runtime.streamed.StreamedBlock.to_raw>`), so the write lands where the loads read.
Rank-local blocks only (group size 1, the host region, loaded by a
:class:`~dlo.runtime.transport.BlockTransport`): a gathered block's ranks would have to switch
together. A failure leaves the ring raw (logged), never fails a forward; no codec on the
platform (no nvCOMP) leaves it raw. The encode thread is stopped at interpreter exit. Each
step is a re-plan record (``stats()["policy"]["replans"]``, ``--explain``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dlo.codec.blocks import BlockDecoder, EncodedShard
from dlo.codec.codecs import Codec, get_codec
from dlo.codec.format import EncodedLayout, encode_pieces, write_pieces
from dlo.host.region import HostRegion
from dlo.journal import atomic
from dlo.platform.device import Platform
from dlo.platform.env import host_available_bytes, torchrun_env
from dlo.runtime.decoding import Decoder
from dlo.runtime.exit_stop import track, untrack
from dlo.runtime.forward_timing import ForwardTimings
from dlo.runtime.streamed import BlockRing, StreamedBlock
from dlo.runtime.transport import BlockTransport

logger = logging.getLogger(__name__)

EXPOSED_SHARE = 0.10
"""Of a forward's device time, the exposed copy wait from which its ring is encoded: the
codec then saves more than its decode costs (compute-bound rings lose a few percent to the
decode; medium preset, compiled, H200, 2026-12-05: 0.69x at 4096 tokens, +3.2% at 16384)."""

MEASURED_FORWARDS = 2
"""Steady forwards measured transfer-bound in a row before the ring is encoded (the first
forward is never measured: its last block is not known yet; a forward that began with a
re-plan applying is not steady)."""


def transfer_bound(forward_ms: float, exposed_ms: float) -> bool:
    """A ring that waited on its copies for at least :data:`EXPOSED_SHARE` of a forward."""
    return forward_ms > 0 and exposed_ms >= EXPOSED_SHARE * forward_ms


@dataclass(eq=False)
class _Encoded:
    block: StreamedBlock
    host_version: int
    layout: EncodedLayout
    pieces: list[torch.Tensor]


@dataclass(eq=False)
class LateCodec:
    """Watches one ring and turns ``name``'s codec on for it (see the module Note).

    Args:
        record: adds a re-plan record (the ring's :class:`~dlo.runtime.replan.Replanner`).
        pin: page-lock the encoded copies (the config's ``pin_memory``).
    """

    platform: Platform
    ring: BlockRing
    name: str
    record: Callable[[dict[str, Any]], None]
    pin: bool = True
    rank: int = 0
    state: str = "watching"
    """``watching``, ``encoding``, ``on``, ``off`` (no codec, no room, a failure) or
    ``closed``."""
    forward_ms: float = 0.0
    exposed_ms: float = 0.0
    """The last steady forward measured (see :mod:`dlo.runtime.forward_timing`)."""
    timings: ForwardTimings = field(init=False)
    _thread: threading.Thread | None = None
    _cancel: threading.Event = field(default_factory=threading.Event)
    _done: list[_Encoded] = field(default_factory=list)
    _error: BaseException | None = None
    _region: HostRegion | None = None
    thread_name: str = "dlo-late-codec"
    device_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by the encode while a piece is on the device, and by the re-planner while it
    reads and plans the device memory: what it reads is the forwards' alone."""

    def __post_init__(self) -> None:
        self.timings = ForwardTimings(self.platform, self.ring)

    # ------------------------------------------------------------------ the forwards
    def forward_starts(self, forward: int) -> bool:
        """The ring's first block is about to run forward ``forward`` (the ring's claim is
        held): decide from the forwards measured, switch what is encoded. Returns whether the
        device memory since the last forward start is the forwards' alone (no encode ran, no
        switch now): the re-planner observes only those (see the Note)."""
        if self.state in ("off", "closed"):
            return True
        quiet = self.state != "encoding"
        try:
            if self.state == "encoding":
                if self._thread is not None and not self._thread.is_alive():
                    with torch.inference_mode(False), atomic():  # buffers written outside it
                        self._switch(forward)
            elif self.state == "watching":
                self.timings.collect()
                if self._bound():
                    self._start(forward)
                    quiet = False  # its first piece may be on the device already
            self.timings.recording = self.state == "watching"
            self.timings.begin()
        except Exception as e:  # never the forward's failure: every block back on its raw copy
            self._cancel.set()
            self._revert()
            self._off(forward, f"failed ({e!r})")
        return quiet

    def forward_ends(self) -> None:
        """The ring's last block exited (on the compute stream)."""
        self.timings.end()

    def replanned(self) -> None:
        """A re-plan applied at this forward's start: it is no steady forward."""
        self.timings.skip()

    def _bound(self) -> bool:
        """The last :data:`MEASURED_FORWARDS` steady forwards were all transfer-bound."""
        steady = [s for s in self.timings.samples if not s.skip][-MEASURED_FORWARDS:]
        if steady:
            self.forward_ms, self.exposed_ms = steady[-1].forward_ms, steady[-1].exposed_ms
        return len(steady) == MEASURED_FORWARDS and all(
            transfer_bound(s.forward_ms, s.exposed_ms) for s in steady
        )

    # ------------------------------------------------------------------ encoding
    def _eligible(self) -> list[StreamedBlock]:
        return [
            b
            for b in self.ring.blocks
            if b.own is None
            and b.raw is None
            and b.host_writable
            and isinstance(b.shard, torch.Tensor)
            and b.shard.numel() > 0
            and isinstance(b.transport, BlockTransport)
            and b.transport.group_size == 1
            and b.transport.decoder is None
        ]

    def _start(self, forward: int) -> None:
        blocks = self._eligible()
        raw = sum(b.shard.numel() for b in blocks)
        available = host_available_bytes()
        if available is not None:  # the node's ranks may each encode theirs at once
            available //= max(1, torchrun_env().local_world_size)
        base = {"blocks": len(blocks), "raw_nbytes": raw}
        if not blocks or (available is not None and available < raw):
            why = "no block to encode" if not blocks else "the host has no room for them"
            self._off(forward, why, **base, host_available_nbytes=available)
            return
        try:
            stream = self.platform.new_stream()
            codec = get_codec(self.platform, self.name, stream)
        except Exception as e:  # no nvCOMP: the ring stays raw
            self._off(forward, f"codec {self.name!r} unavailable ({e})", **base)
            return
        self.state = "encoding"
        self._record("codec: encoding", forward=forward, **base)
        work = [(b, b.host_version) for b in blocks]
        self._thread = threading.Thread(
            target=self._encode_all,
            args=(work, codec, stream),
            name=self.thread_name,
            daemon=True,
        )
        track(self)  # stopped at interpreter exit, not killed inside a CUDA call
        self._thread.start()

    def _encode_all(self, work: list[tuple[StreamedBlock, int]], codec: Codec, stream: Any) -> None:
        pf = self.platform
        device = pf.device if pf.has_streams else None

        def encode(chunk: torch.Tensor) -> torch.Tensor:  # one slice on the device at a time
            if device is None:
                return codec.encode(chunk)
            with self.device_lock:  # freed before the re-planner reads the device
                return codec.encode(chunk.to(device)).cpu()

        try:
            with pf.stream(stream):
                for b, version in work:
                    if self._cancel.is_set():
                        return
                    shard = b.shard
                    enc, datas = encode_pieces(
                        b.name, shard, b.layout.slice_nbytes, codec.bitstream, encode
                    )
                    self._done.append(_Encoded(b, version, enc, datas))
        except BaseException as e:  # reported at the switch
            self._error = e

    # ------------------------------------------------------------------ switching
    def _switch(self, forward: int) -> None:
        if self._error is not None:
            self._off(forward, f"encoding failed ({self._error!r})")
            self._done.clear()
            return
        done = [e for e in self._done if e.block.host_version == e.host_version]
        self._done.clear()
        if not done:
            self._off(forward, "every block was written since its encode")
            return
        pf = self.platform
        try:
            region = self._region = HostRegion([e.layout.nbytes for e in done])
            for i, e in enumerate(done):
                write_pieces(region.view(i), e.layout, e.pieces)
                e.pieces = []
            if self.pin and pf.has_streams:
                region.pin(pf)
            decoder = Decoder.for_shards(
                pf, self.name, [(e.layout, e.block.layout.num_chunks) for e in done], rank=self.rank
            )
            stream = pf.new_stream()
            whole = BlockDecoder(pf, get_codec(pf, self.name, stream), stream)
        except Exception as err:  # nothing switched yet
            self._free()
            self._off(forward, f"laying the encoded copies failed ({err!r})")
            return
        pf.synchronize()  # no load of the raw transport is left to free on the decoder's
        decoding: dict[int, BlockTransport] = {}
        for i, e in enumerate(done):
            b, raw = e.block, e.block.transport
            assert isinstance(raw, BlockTransport)
            t = decoding.setdefault(id(raw), raw.with_decoder(decoder))
            b.raw = (b.shard, raw)
            b.shard, b.transport = EncodedShard(e.layout, region.view(i), whole), t
        encoded = sum(e.layout.nbytes for e in done)
        raw_nbytes = sum(e.layout.raw_nbytes for e in done)
        self.state = "on"
        self._record(
            "codec: on",
            forward=forward,
            blocks=len(done),
            raw_nbytes=raw_nbytes,
            encoded_nbytes=encoded,
            ratio=encoded / raw_nbytes if raw_nbytes else 1.0,
        )

    # ------------------------------------------------------------------ records, close
    def _off(self, forward: int, why: str, **more: Any) -> None:
        self.state = "off"
        logger.info("dlo: the codec stays off for %s: %s", self.ring.name or "the model", why)
        self._record("codec: off", forward=forward, why=why, **more)

    def _record(self, action: str, **more: Any) -> None:
        self.record(
            {
                "component": self.ring.name,
                "action": action,
                "forward_ms": self.forward_ms,
                "exposed_wait_ms": self.exposed_ms,
                **more,
            }
        )

    def _revert(self) -> None:
        """Every block back on its raw copy and transport, the encoded copies freed."""
        self.platform.synchronize()  # no load reads an encoded copy freed below
        for b in self.ring.blocks:
            b.to_raw()
        self._free()

    def _free(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None

    def stop_thread(self, timeout_s: float | None = None) -> bool:
        """Let the encode finish its block and stop; whether it has stopped."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def close(self) -> None:
        """Stop encoding, put every block back on its raw copy, free the encoded ones
        (disable)."""
        self.stop_thread()
        untrack(self)
        self._revert()
        self._done.clear()
        self.state = "closed"
