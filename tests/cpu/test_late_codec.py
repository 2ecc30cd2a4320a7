"""``codec="auto"`` turning the codec on between forwards for a ring measured to wait on its
copies ([Note: codec turned on by measurement] in dlo.runtime.late_codec). CPU platform: no
device timers, so the measurement is stood in for (``transfer_bound``); the reference codec
encodes, and the switch, the loads through the decoder, writes after the switch, a stale
encode, a failure and disable mid-encode are real."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
import dlo.config.unset as unset
import dlo.runtime.late_codec as late_codec
from dlo.commands.pipeline_calls import resident_reference
from dlo.host.region import LEDGER
from dlo.plan.policy_explain import replans_explained
from dlo.platform.device import CpuPlatform
from dlo.runtime.late_codec import LateCodec
from tests.cpu.test_adapters_streaming import flux_call, folder, loras
from tests.cpu.test_codec import _run
from tests.toys import ToyBlock, ToyDiT, assert_same, clone, snapshot

__all__ = ["folder", "loras"]  # fixtures


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every measured forward is transfer-bound."""
    monkeypatch.setattr(late_codec, "transfer_bound", lambda forward_ms, exposed_ms: True)


def _enable(model: torch.nn.Module, codec: str | None = "auto") -> Any:
    b = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer", codec=codec), device="cpu")
    assert b is not None
    return b


def _late(b: Any) -> LateCodec:
    (late,) = [r.replanner.late for r in b._scheduler.rings if r.replanner is not None]
    assert late is not None
    return late


def _encoded_once(b: Any, model: torch.nn.Module, ref: list[torch.Tensor]) -> list[torch.Tensor]:
    """Four forwards (the second and third measured, the fourth starts the encode), the
    encode waited for, then three forwards, the first of which switches."""
    out = _run(model, 4)
    late = _late(b)
    assert late.state == "encoding" and late._thread is not None
    late._thread.join()
    return out + _run(model, 3)


def test_a_transfer_bound_ring_turns_the_codec_on_bitwise(bound: None) -> None:
    model = ToyDiT(5)
    resident = clone(model)
    ref = _run(resident, 4) + _run(resident, 3)
    before = snapshot(model)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    b = _enable(model)
    assert b.stats()["codec"] == "none"  # enable could not tell: no compute time given
    out = _encoded_once(b, model, ref)
    assert all(torch.equal(x, y) for x, y in zip(ref, out))
    late = _late(b)
    assert late.state == "on"
    (ring,) = b._scheduler.rings
    assert all(sb.raw is not None for sb in ring.blocks)  # every streamed block switched
    st = b.stats()
    assert st["decoded_nbytes"] > 0 and st["encoded_h2d_nbytes"] < st["decoded_nbytes"]
    assert st["codec_late"] == {"": "on"}
    actions = [r["action"] for r in st["policy"]["replans"]]
    assert actions == ["codec: encoding", "codec: on"], actions
    on = st["policy"]["replans"][-1]
    assert on["forward"] == 5 and 0 < on["ratio"] < 1 and on["blocks"] == len(ring.blocks)
    assert "codec: on" in replans_explained(st["policy"])
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in want.items())
    b.disable()
    assert_same(before, model)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_a_ring_that_does_not_wait_stays_raw(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(late_codec, "transfer_bound", lambda forward_ms, exposed_ms: False)
    model = ToyDiT(4)
    ref = _run(clone(model), 5)
    b = _enable(model)
    assert all(torch.equal(x, y) for x, y in zip(ref, _run(model, 5)))
    assert _late(b).state == "watching" and b.stats()["decoded_nbytes"] == 0
    b.disable()


def test_an_explicit_codec_is_never_changed(bound: None) -> None:
    model = ToyDiT(4)
    b = _enable(model, codec="none")
    (ring,) = b._scheduler.rings
    assert ring.replanner is not None and ring.replanner.late is None
    _run(model, 4)
    assert b.stats()["decoded_nbytes"] == 0
    b.disable()


def test_an_unset_codec_is_measured_on_a_gpu_never_on_a_cpu_device(
    bound: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[Note: automatic by default]: an unset codec is "none" on a CPU device (no late codec),
    "auto" on a GPU (faked: its defaults on the CPU platform), where the ring is encoded and
    switched as with an explicit "auto"; an explicit "none" is never measured there."""
    model = ToyDiT(5)
    resident = clone(model)
    ref = _run(resident, 4) + _run(resident, 3)
    b = _enable(model, codec=None)
    assert _ring_late(b) is None and b.stats()["codec_late"] == {}
    b.disable()
    monkeypatch.setattr(unset, "device_values", lambda _: dict.fromkeys(unset.UNSET_FIELDS, "auto"))
    monkeypatch.setattr(CpuPlatform, "free_memory", lambda self: 0)  # no block kept: all stream
    b = _enable(model, codec="none")
    assert _ring_late(b) is None
    b.disable()
    b = _enable(model, codec=None)
    assert b.stats()["codec"] == "none"  # enable could not tell: no compute time given
    out = _encoded_once(b, model, ref)
    assert all(torch.equal(x, y) for x, y in zip(ref, out))
    assert b.stats()["codec_late"] == {"": "on"} and b.stats()["decoded_nbytes"] > 0
    b.disable()


def _ring_late(b: Any) -> Any:
    (ring,) = b._scheduler.rings
    assert ring.replanner is not None  # re-planned: the late codec's only precondition left
    return ring.replanner.late


class _Writes(ToyBlock):
    writing = False

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        if type(self).writing:
            self.gain.add_(1)  # a step counter kept in a buffer
        return super().forward(x, scale=scale)


def test_a_write_after_the_switch_lands_in_the_raw_copy(
    bound: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ToyDiT(4)
    model.blocks[2] = _Writes(16, 2)
    resident = clone(model)
    monkeypatch.setattr(_Writes, "writing", False)
    ref = _run(resident, 4) + _run(resident, 3)
    b = _enable(model)
    out = _encoded_once(b, model, ref)
    (ring,) = b._scheduler.rings
    writer = next(sb for sb in ring.blocks if sb.name.endswith("blocks.2"))
    assert writer.raw is not None  # switched, like every block
    monkeypatch.setattr(_Writes, "writing", True)  # from now on it writes at every call
    ref += _run(resident, 3)
    out += _run(model, 3)
    assert all(torch.equal(x, y) for x, y in zip(ref, out))
    # back on its raw copy, which holds the writes; the others stay encoded
    assert writer.raw is None and isinstance(writer.shard, torch.Tensor)
    assert all(sb.raw is not None for sb in ring.blocks if sb is not writer)
    b.disable()
    assert torch.equal(model.blocks[2].gain, resident.blocks[2].gain)


def test_a_block_written_during_its_encode_is_not_switched(
    bound: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ToyDiT(4)
    resident = clone(model)
    ref = _run(resident, 4) + _run(resident, 3) + _run(resident, 1)
    b = _enable(model)
    (ring,) = b._scheduler.rings
    stale = ring.blocks[1]
    real = late_codec.encode_pieces

    def encode_then_write(name: str, *args: Any, **kw: Any) -> Any:
        out = real(name, *args, **kw)
        if name == stale.name:
            stale.host_version += 1  # a write kept into its host shard meanwhile
        return out

    monkeypatch.setattr(late_codec, "encode_pieces", encode_then_write)
    out = _encoded_once(b, model, ref) + _run(model, 1)
    assert all(torch.equal(x, y) for x, y in zip(ref, out))
    assert stale.raw is None and all(sb.raw is not None for sb in ring.blocks if sb is not stale)
    b.disable()


def test_an_encode_failure_leaves_the_ring_raw(
    bound: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("nvcomp: out of memory")

    monkeypatch.setattr(late_codec, "encode_pieces", fail)
    model = ToyDiT(4)
    resident = clone(model)
    ref = _run(resident, 4) + _run(resident, 3) + _run(resident, 1)
    b = _enable(model)
    out = _encoded_once(b, model, ref) + _run(model, 1)
    assert all(torch.equal(x, y) for x, y in zip(ref, out))
    late = _late(b)
    assert late.state == "off" and b.stats()["decoded_nbytes"] == 0
    (off,) = [r for r in late.record.__self__ if r["action"] == "codec: off"]  # type: ignore[attr-defined]
    assert "nvcomp: out of memory" in off["why"]
    b.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_disable_while_encoding_stops_the_encode_and_frees_everything(
    bound: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release = threading.Event(), threading.Event()
    real = late_codec.encode_pieces

    calls: list[str] = []

    def slow(*args: Any, **kw: Any) -> Any:
        calls.append(args[0])
        started.set()
        release.wait(5)
        return real(*args, **kw)

    monkeypatch.setattr(late_codec, "encode_pieces", slow)
    model = ToyDiT(5)
    before = snapshot(model)
    b = _enable(model)
    _run(model, 4)
    late = _late(b)
    assert started.wait(5) and late.state == "encoding"
    threading.Timer(0.2, release.set).start()
    t0 = time.perf_counter()
    b.disable()  # waits for the block being encoded, encodes no other
    assert time.perf_counter() - t0 < 5
    assert late.state == "closed" and late._thread is not None and not late._thread.is_alive()
    assert len(calls) == 1 and len(late._done) == 0  # the block under way only
    assert_same(before, model)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_no_host_room_keeps_the_codec_off(bound: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(late_codec, "host_available_bytes", lambda: 1)
    model = ToyDiT(4)
    b = _enable(model)
    _run(model, 4)
    late = _late(b)
    assert late.state == "off" and late._thread is None
    (off,) = [r for r in late.record.__self__ if r["action"] == "codec: off"]  # type: ignore[attr-defined]
    assert off["why"] == "the host has no room for them" and off["host_available_nbytes"] == 1
    b.disable()


def test_a_fuse_after_the_switch_rewrites_the_raw_copies_bitwise(
    bound: None, folder: Path, loras: list[Path]
) -> None:
    """A LoRA fuse writes the blocks' raw host copies: those blocks load from them again
    (their encoded copies would be stale). Bitwise throughout."""
    ref = resident_reference(str(folder), torch.float32, torch.device("cpu"))
    cfg = dlo.OffloadConfig(mode="layer", codec="auto")
    pipe, backend = dlo.load_pipeline(folder, cfg, device="cpu")
    assert backend is not None
    try:
        for p in (ref, pipe):
            p.load_lora_weights(loras[0], adapter_name="a0")
        assert torch.equal(flux_call(pipe), flux_call(ref))  # forwards 1-2
        assert torch.equal(flux_call(pipe), flux_call(ref))  # 3: measured; 4: encoding starts
        late = _late(backend)
        assert late._thread is not None
        late._thread.join()
        assert torch.equal(flux_call(pipe), flux_call(ref)) and late.state == "on"
        for p in (ref, pipe):
            p.fuse_lora(lora_scale=0.7, adapter_names=["a0"])
        want = flux_call(ref)
        assert torch.equal(flux_call(pipe), want) and torch.equal(flux_call(pipe), want)
        fused = [sb for sb in late.ring.blocks if sb.host_version > 0]
        assert fused and all(sb.raw is None for sb in fused)
    finally:
        backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


@pytest.mark.parametrize(
    "kw",
    [{"block_compute_ms": 1e6}, {"pin_budget_gb": 1.0}, {"host_budget_gb": 1.0}],
    ids=["compute-time-given", "pin-budget", "host-budget"],
)
def test_no_late_codec_where_enable_decided_or_a_budget_would_be_overrun(
    bound: None, kw: dict[str, Any]
) -> None:
    """A compute time given (the policy modelled the ring and chose "none"), or a host or pin
    budget (the encoded copies would come on top of it): the ring stays as enable made it."""
    model = ToyDiT(4)
    cfg = dlo.OffloadConfig(mode="layer", codec="auto", **kw)
    b = dlo.enable_offload(model, cfg, device="cpu")
    assert b is not None
    try:
        (ring,) = b._scheduler.rings
        assert ring.replanner is not None and ring.replanner.late is None
        assert b.stats()["codec_late"] == {}
    finally:
        b.disable()


class _Clock:
    now = 0.0
    done = 0.0
    """Device time completed so far."""


class _Event:
    def __init__(self) -> None:
        self.t = -1.0

    def record(self, stream: Any) -> None:
        self.t = _Clock.now

    def query(self) -> bool:
        return self.t <= _Clock.done

    def elapsed_time(self, end: _Event) -> float:
        return end.t - self.t


class _Platform:
    has_streams = True

    def new_event(self, *, timing: bool = False) -> _Event:
        return _Event()

    def current_stream(self) -> None:
        return None


def test_forward_timings_wait_for_the_device_and_drop_nothing() -> None:
    """The host runs forwards ahead of the device: each forward's span and waits are read
    once its events completed, the same forward's together, in order; a re-planned forward
    is marked; beyond MAX_PENDING forwards nothing more is recorded until some complete."""
    from dlo.runtime.forward_timing import MAX_PENDING, ForwardTimings, Sample
    from dlo.runtime.streamed import BlockRing

    ring = BlockRing("dit", [])
    t = ForwardTimings(_Platform(), ring)  # type: ignore[arg-type]

    def forward(span: float, waits: list[float], skip: bool = False) -> None:
        t.begin()
        if skip:
            t.skip()
        start = _Clock.now
        for w in waits:
            t.wait_event(None)
            _Clock.now += w
            t.wait_event(None)
        _Clock.now = start + span
        t.end()

    _Clock.now = _Clock.done = 0.0
    forward(10.0, [2.0, 3.0])
    forward(20.0, [1.0], skip=True)
    t.collect()
    assert list(t.samples) == []  # the device has done nothing yet: nothing read or dropped
    _Clock.done = 10.0
    t.collect()
    assert list(t.samples) == [Sample(10.0, 5.0, False)]
    _Clock.done = 1e9
    t.collect()
    assert list(t.samples) == [Sample(10.0, 5.0, False), Sample(20.0, 1.0, True)]
    _Clock.done = _Clock.now
    for _ in range(MAX_PENDING + 3):
        forward(1.0, [0.5])
    assert len(t._pending) == MAX_PENDING  # the rest went unmeasured
    _Clock.done = 1e9
    t.collect()
    assert list(t.samples)[2:] == [Sample(1.0, 0.5, False)] * MAX_PENDING


@pytest.mark.parametrize(
    ("samples", "bound_"),
    [
        ([(10.0, 5.0, False), (10.0, 5.0, False)], True),
        ([(10.0, 5.0, False)], False),  # one forward is not enough
        ([(10.0, 5.0, False), (10.0, 0.5, False)], False),  # the last one hid its copies
        ([(10.0, 0.5, False), (10.0, 5.0, True), (10.0, 5.0, False)], False),  # a re-plan's
        ([(10.0, 5.0, False), (10.0, 0.5, True), (10.0, 5.0, False)], True),
    ],
)
def test_the_decision_takes_the_last_steady_forwards(
    samples: list[tuple[float, float, bool]], bound_: bool
) -> None:
    from dlo.runtime.forward_timing import Sample
    from dlo.runtime.streamed import BlockRing

    late = LateCodec(_Platform(), BlockRing("dit", []), "ans", lambda r: None)  # type: ignore[arg-type]
    late.timings.samples.extend(Sample(*s) for s in samples)
    assert late._bound() is bound_
