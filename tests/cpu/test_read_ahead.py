"""The disk tier's reader ([Note: disk read-ahead]) on its own, with blocks whose reads are
scripted: the order it reads in, what it evicts, interrupted requests and failed reads never
hang a load or poison a later one."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from dlo.errors import OffloadError
from dlo.platform.device import CpuPlatform
from dlo.runtime.read_ahead import FREE, READY, ReadAhead

NBYTES = 4096


@dataclass(eq=False)
class FakeBlock:
    """What the reader needs of a disk shard (:class:`~dlo.runtime.read_ahead.DiskShard`): a
    name, its bytes and a fill (here: the block's byte value, or a scripted failure)."""

    name: str
    value: int
    read_nbytes: int = NBYTES
    fail: list[BaseException] = field(default_factory=list)
    fills: int = 0
    gate: threading.Event | None = None

    def fill(self, dst: torch.Tensor, *, pool: Any = None) -> None:
        if self.gate is not None:
            self.gate.wait(5)
        self.fills += 1
        if self.fail:
            raise self.fail.pop(0)
        dst.fill_(self.value)


@pytest.fixture
def ahead() -> Any:
    ra = ReadAhead(CpuPlatform(), buffer_nbytes=NBYTES, pin=False, rank=0)
    yield ra
    ra.close()


def _acquire(ra: ReadAhead, block: FakeBlock, timeout_s: float = 5.0) -> torch.Tensor:
    """``acquire`` on another thread, bounded: a hang is a failure, not a stuck test."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(_catch(ra.acquire, block)), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"acquire({block.name}) hung"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _catch(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except BaseException as e:
        return e


def _wait_for(cond: Any, timeout_s: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        time.sleep(0.005)


def _serve(ra: ReadAhead, block: FakeBlock) -> int:
    """One load as the staging filler runs it: requested, acquired, copied, released."""
    ra.requested(block)  # type: ignore[arg-type]
    buf = _acquire(ra, block)
    value = int(buf[0])
    assert bool((buf == value).all())
    ra.release(block, None)  # type: ignore[arg-type]
    return value


def test_predicted_blocks_are_read_before_their_loads(ahead: ReadAhead) -> None:
    a, b = FakeBlock("a", 1), FakeBlock("b", 2)
    ahead.upcoming([a, b])  # type: ignore[list-item]
    _wait_for(lambda: ahead.stats.num_reads == 2)
    assert [_serve(ahead, a), _serve(ahead, b)] == [1, 2]
    assert ahead.stats.num_waits == 0 and a.fills == b.fills == 1


def test_a_block_nobody_predicted_is_read_first_evicting_a_prediction(ahead: ReadAhead) -> None:
    a, b, c = FakeBlock("a", 1), FakeBlock("b", 2), FakeBlock("c", 3)
    ahead.upcoming([a, b])  # type: ignore[list-item]
    _wait_for(lambda: ahead.stats.num_reads == 2)  # both buffers hold predictions
    ahead.upcoming([])  # nothing else predicted: the evicted one is not read again
    assert _serve(ahead, c) == 3  # not predicted: read now, in a buffer taken from one
    # (its request alone may get it read before the load waits for it)
    assert ahead.stats.num_wasted_reads == 1 and ahead.stats.num_waits <= 1
    assert a.fills + b.fills == 2 and c.fills == 1


def test_a_request_the_filler_never_served_does_not_hold_a_buffer(ahead: ReadAhead) -> None:
    """An interrupted load: requested, never acquired. Later loads still run (the stale
    request is dropped when a later one is acquired), with both buffers busy before."""
    blocks = [FakeBlock(n, i + 1) for i, n in enumerate("abcd")]
    a, b, c, d = blocks
    ahead.requested(a)  # type: ignore[arg-type]  # never acquired
    ahead.upcoming([b, c])  # type: ignore[list-item]
    _wait_for(lambda: sum(x.state == READY for x in ahead._buffers) == 2)
    assert _serve(ahead, d) == 4
    assert _serve(ahead, b) == 2 and _serve(ahead, c) == 3
    assert not ahead._pending


def test_a_failed_read_fails_its_load_once_and_the_next_load_reads_again(ahead: ReadAhead) -> None:
    a = FakeBlock("a", 7, fail=[OSError(5, "Input/output error")])
    with pytest.raises(OSError, match="Input/output"):
        _serve(ahead, a)
    assert all(x.state == FREE for x in ahead._buffers)  # nothing kept for the failed read
    assert _serve(ahead, a) == 7 and a.fills == 2


def test_a_failed_prediction_is_forgotten_not_served_to_a_later_load(ahead: ReadAhead) -> None:
    a = FakeBlock("a", 5, fail=[OSError(5, "transient")])
    ahead.upcoming([a])  # type: ignore[list-item]
    _wait_for(lambda: a.fills == 1 and all(x.state == FREE for x in ahead._buffers))
    assert _serve(ahead, a) == 5  # the disk recovered: the load reads it again
    assert a.fills == 2


def test_a_load_waiting_for_a_stopped_reader_raises(ahead: ReadAhead) -> None:
    gate = threading.Event()
    a = FakeBlock("a", 1, gate=gate)
    ahead.requested(a)  # type: ignore[arg-type]
    ahead._stop = True  # the reader ends after its current read
    gate.set()
    _wait_for(lambda: ahead._thread is not None and not ahead._thread.is_alive())
    b = FakeBlock("b", 2)
    ahead.requested(b)  # type: ignore[arg-type]
    with pytest.raises(OffloadError, match="read-ahead thread is gone"):
        _acquire(ahead, b)
