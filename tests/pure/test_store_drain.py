"""[Note: the store outlives the last read]: rank 0 waits at exit, bounded, until every rank
has read the last exchange of each topic (a fake store stands in for the job's)."""

from __future__ import annotations

import threading
import time

import pytest

import dlo.parallel.store as store_mod


class _CountingStore:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, key: str, n: int) -> int:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _CountingStore:
    st = _CountingStore()
    monkeypatch.setattr(store_mod, "_default_store", lambda: st)
    last = {"agreement": (id(st), "dlo/agreement/0", 2), "old": (0, "dlo/old/0", 2)}
    monkeypatch.setattr(store_mod, "_LAST_READ", last)  # "old": another store's, skipped
    st.add("dlo/agreement/0/read", 1)  # rank 0's own read
    return st


def test_rank_zero_waits_for_the_last_reader(fake: _CountingStore) -> None:
    late = threading.Timer(0.3, lambda: fake.add("dlo/agreement/0/read", 1))
    late.start()
    t0 = time.monotonic()
    store_mod.await_readers(bound_s=5.0)
    waited = time.monotonic() - t0
    late.join()
    assert fake.counts["dlo/agreement/0/read"] == 2
    assert 0.25 <= waited < 5.0  # returned once the peer read, not at the bound


def test_a_peer_that_never_reads_holds_rank_zero_only_for_the_bound(
    fake: _CountingStore,
) -> None:
    t0 = time.monotonic()
    store_mod.await_readers(bound_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0


def test_an_unresponsive_store_holds_rank_zero_only_for_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Stuck(_CountingStore):
        def add(self, key: str, n: int) -> int:
            time.sleep(30)  # a store call that never answers
            return 0

    st = Stuck()
    monkeypatch.setattr(store_mod, "_default_store", lambda: st)
    monkeypatch.setattr(store_mod, "_LAST_READ", {"agreement": (id(st), "dlo/agreement/0", 2)})
    t0 = time.monotonic()
    store_mod.await_readers(bound_s=0.3)
    assert time.monotonic() - t0 < 2.0


def test_a_store_already_gone_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    def gone() -> None:
        raise RuntimeError("Connection was likely closed")

    monkeypatch.setattr(store_mod, "_default_store", gone)
    monkeypatch.setattr(store_mod, "_LAST_READ", {"agreement": (1, "dlo/agreement/0", 2)})
    t0 = time.monotonic()
    store_mod.await_readers(bound_s=5.0)
    assert time.monotonic() - t0 < 1.0
