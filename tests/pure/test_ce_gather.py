"""The copy-engine gather's watchdog (pure: fake events, no device)."""

from __future__ import annotations

import time
from typing import Any

from dlo.runtime.ce_gather import SyncWatchdog


class _Event:
    def __init__(self) -> None:
        self.done = False

    def record(self, stream: Any) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class _Platform:
    def __init__(self) -> None:
        self.events: list[_Event] = []

    def device_context(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def new_event(self) -> _Event:
        self.events.append(_Event())
        return self.events[-1]


def _wait_for(cond: Any, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_a_barrier_that_never_completes_fires_once_naming_its_block() -> None:
    fired: list[str] = []
    dog = SyncWatchdog(_Platform(), 0.2, poll_s=0.01, on_expire=fired.append)  # type: ignore[arg-type]
    dog.track(None, "blocks.3")
    assert _wait_for(lambda: fired, 3.0)
    time.sleep(0.3)
    dog.close()
    assert len(fired) == 1 and "'blocks.3'" in fired[0] and "collective_timeout_s" in fired[0]


def test_completing_barriers_never_fire_and_events_are_reused() -> None:
    fired: list[str] = []
    pf = _Platform()
    dog = SyncWatchdog(pf, 0.2, poll_s=0.01, on_expire=fired.append)  # type: ignore[arg-type]
    for i in range(20):  # 20 blocks, each done within a tenth of the timeout
        dog.track(None, f"blocks.{i}")
        for e in pf.events:
            e.done = True
        time.sleep(0.02)
    time.sleep(0.4)
    dog.close()
    assert fired == []
    assert len(pf.events) < 20  # finished events went back to the pool


def test_the_clock_starts_when_a_barrier_becomes_the_oldest() -> None:
    fired: list[str] = []
    pf = _Platform()
    dog = SyncWatchdog(pf, 0.3, poll_s=0.01, on_expire=fired.append)  # type: ignore[arg-type]
    dog.track(None, "blocks.0")
    dog.track(None, "blocks.1")
    time.sleep(0.2)
    pf.events[0].done = True  # blocks.0 took 0.2 s: blocks.1's clock starts only now
    time.sleep(0.2)
    assert fired == []  # 0.4 s since blocks.1 was enqueued, 0.2 s as the oldest
    assert _wait_for(lambda: fired, 3.0) and "'blocks.1'" in fired[0]
    dog.close()


def test_a_device_error_fires_at_once_naming_the_block() -> None:
    # a barrier kernel that trapped leaves the context failing every call: no waiting out
    # the timeout, and the watchdog thread reports instead of dying with the exception
    class _Broken(_Event):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: unspecified launch failure")

    class _BrokenPlatform(_Platform):
        def new_event(self) -> _Event:
            return _Broken()

    fired: list[str] = []
    dog = SyncWatchdog(_BrokenPlatform(), 60.0, poll_s=0.01, on_expire=fired.append)  # type: ignore[arg-type]
    dog.track(None, "blocks.4")
    assert _wait_for(lambda: fired, 3.0)
    dog.close()
    assert len(fired) == 1 and "'blocks.4'" in fired[0] and "unspecified launch failure" in fired[0]


def test_barrier_kernels_are_watched_at_each_blocks_trailing_barrier() -> None:
    from dlo.runtime.ce_gather import _KernelBarrier

    class _Handle:
        def __init__(self) -> None:
            self.calls: list[int] = []

        def barrier(self, *, channel: int, timeout_ms: int) -> None:
            self.calls.append(timeout_ms)

    fired: list[str] = []
    handle = _Handle()
    dog = SyncWatchdog(_Platform(), 0.2, poll_s=0.01, on_expire=fired.append)  # type: ignore[arg-type]
    barrier = _KernelBarrier(handle, 2.5, watchdog=dog)
    barrier(None, "blocks.0")  # a chunk's barrier: not followed
    barrier(None, "blocks.0", track=True)  # the trailing one: followed, never completes
    assert handle.calls == [2500, 2500]
    assert _wait_for(lambda: fired, 3.0) and "'blocks.0'" in fired[0]
    barrier.close()
    assert dog._thread is None


def test_flag_addresses_meet_in_real_memory_for_barriers_and_tags() -> None:
    """Emulate every rank's stream writes with plain stores into G real flag regions: each
    counter lands where its reader waits, and each region's tag view reads every rank's
    (block, slot) in rank order, as the lock-step check expects."""
    import ctypes

    import torch

    from dlo.runtime.ce_gather import FLAG_NBYTES, TAG_WORD, flag_addresses

    group = 3
    regions = [torch.zeros(FLAG_NBYTES, dtype=torch.uint8) for _ in range(group)]
    bases = [r.data_ptr() for r in regions]  # one address space stands in for the mappings
    table = [flag_addresses(rank, bases) for rank in range(group)]

    def store(address: int, value: int) -> None:
        ctypes.c_uint32.from_address(address).value = value

    def load(address: int) -> int:
        return ctypes.c_uint32.from_address(address).value

    for _, theirs, tags in table:  # barrier 7, block 41 in slot 2
        for address in theirs.values():
            store(address, 7)
        for address in tags:
            store(address, 41)
            store(address + 8, 2)
    for mine, _, _ in table:
        assert [load(a) for a in mine.values()] == [7] * (group - 1)
    for region in regions:
        words = region.view(torch.int32)
        tags = words[TAG_WORD : TAG_WORD + 4 * group].view(torch.int64).tolist()
        assert list(zip(tags[0::2], tags[1::2])) == [(41, 2)] * group
        assert int(words[:TAG_WORD].sum()) == 7 * (group - 1)  # only counters below the tags


def test_symmetric_slots_count_in_the_device_peak() -> None:
    # the symmetric buffer lives outside torch's caching allocator: max_memory_allocated misses
    # it, so the backend reports it and the peak figures add it
    import torch

    from dlo.platform.device import CpuPlatform
    from dlo.runtime.measure import device_peak_nbytes
    from dlo.runtime.slots import SlotPool

    class Peak(CpuPlatform):
        def max_memory_allocated(self) -> int:
            return 1000

    pf = Peak()
    plain = SlotPool.allocate(pf, 2, 512)
    assert plain.symmetric_nbytes == 0
    sym = SlotPool(pf, slot_nbytes=512)
    sym.base = torch.empty(2 * 512 + 4096, dtype=torch.uint8)
    assert sym.symmetric_nbytes == 2 * 512 + 4096
    assert device_peak_nbytes(pf) == 1000
    assert device_peak_nbytes(pf, {"device_symmetric_nbytes": sym.symmetric_nbytes}) == 6120
    sym.release()
    assert sym.symmetric_nbytes == 0


class _ProbePlatform:
    """Stream memory operations emulated on a CPU word: ``writes_land`` says whether the
    driver's write reaches memory; the probe's wait completes once the word is >= 1, unless
    the device is ``stuck``."""

    def __init__(self, *, writes_land: bool, stuck: bool = False) -> None:
        self.writes_land, self.stuck = writes_land, stuck
        self.word: Any = None
        self.completed = False

    def new_stream(self) -> object:
        return object()

    def stream(self, stream: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def stream_write_u32(self, stream: Any, address: int, value: int) -> None:
        if self.writes_land and address == self.word.data_ptr():
            self.word.fill_(value)

    def stream_wait_u32(self, stream: Any, address: int, value: int) -> None:
        return None

    def new_event(self) -> Any:
        platform = self

        class Done:
            def record(self, stream: Any) -> None:
                return None

            def query(self) -> bool:
                if not platform.stuck and int(platform.word.item()) >= 1:
                    platform.completed = True
                return platform.completed

        return Done()


def _probe(platform: _ProbePlatform, monkeypatch: Any) -> bool:
    import torch

    from dlo.runtime import ce_gather

    monkeypatch.setattr(ce_gather, "PROBE_TIMEOUT_S", 0.05)
    platform.word = torch.zeros(1, dtype=torch.int32)
    ok = ce_gather.can_use_stream_ops(platform, platform.word)  # type: ignore[arg-type]
    assert int(platform.word.item()) == 0  # left zeroed: it is a barrier counter's neighbour
    return ok


def test_probe_says_yes_when_the_operations_run(monkeypatch: Any) -> None:
    assert _probe(_ProbePlatform(writes_land=True), monkeypatch)


def test_probe_that_times_out_releases_its_wait_and_says_no(monkeypatch: Any) -> None:
    # a stream left waiting would hang every later device synchronization
    platform = _ProbePlatform(writes_land=False)
    assert not _probe(platform, monkeypatch)
    assert platform.completed


def test_probe_that_cannot_be_released_ends_the_worker(monkeypatch: Any) -> None:
    import pytest

    from dlo.runtime import ce_gather

    def abort(message: str) -> None:
        raise SystemExit(message)

    monkeypatch.setattr(ce_gather, "_abort", abort)
    with pytest.raises(SystemExit, match="stays blocked"):
        _probe(_ProbePlatform(writes_land=False, stuck=True), monkeypatch)
