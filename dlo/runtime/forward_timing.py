"""A ring's forwards timed on the device: each forward's span (its first block's entry to its
last block's exit) and its blocks' exposed copy wait, from event pairs of its own, read once
complete and never dropped (see [Note: codec turned on by measurement] in
:mod:`dlo.runtime.late_codec`).

The ring's per-block wait timers (:class:`~dlo.platform.timing.StreamTimer`) reuse one pair
each and drop a pair still running when the block waits again: in a denoise loop that never
synchronizes, the host runs a forward or more ahead of the device and most pairs are dropped
(84 of 98 in ten forwards on an H100, 2026-12-07), and what is left mixes forwards. Here
every forward gets fresh events, kept until its last one completed (a non-blocking query at
the next forwards' starts), so the span and the wait of a sample are the same forward's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dlo.platform.device import Platform
from dlo.platform.timing import StreamTimer
from dlo.runtime.streamed import BlockRing

MAX_PENDING = 8
"""Forwards whose events may wait to complete; beyond, forwards go unmeasured (the device
is that far behind: nothing is dropped, nothing more is recorded)."""


MAX_SAMPLES = 16
"""The latest forwards kept (a ring that stays compute-bound keeps being timed)."""


@dataclass(frozen=True)
class Sample:
    """One forward's device times."""

    forward_ms: float
    exposed_ms: float
    """The compute stream's wait for its blocks' copies."""
    skip: bool
    """The forward began with a re-plan applying (its loads are no steady forward's)."""


@dataclass(eq=False)
class _Forward:
    start: Any
    events: list[Any] = field(default_factory=list)
    """Each wait's begin and end, in turn."""
    end: Any = None
    skip: bool = False


class _WaitTimer(StreamTimer):
    """A block's wait timer that also records each wait into the forward being timed."""

    def __init__(self, platform: Platform, timings: ForwardTimings) -> None:
        super().__init__(platform)
        self.timings = timings

    def begin(self, stream: Any) -> None:
        super().begin(stream)
        self.timings.wait_event(stream)

    def end(self, stream: Any) -> None:
        super().end(stream)
        self.timings.wait_event(stream)


class ForwardTimings:
    """Times ``ring``'s forwards while :attr:`recording` (its blocks' wait timers become
    :class:`_WaitTimer`; their totals go on as before). Without device streams each forward
    gives a sample of zeros."""

    def __init__(self, platform: Platform, ring: BlockRing) -> None:
        self.platform = platform
        self.samples: deque[Sample] = deque(maxlen=MAX_SAMPLES)
        self.recording = True
        self._pending: deque[_Forward] = deque()
        self._current: _Forward | None = None
        for b in ring.blocks:
            b.wait = _WaitTimer(platform, self)

    def _event(self) -> Any:
        e = self.platform.new_event(timing=True)
        e.record(self.platform.current_stream())
        return e

    def begin(self) -> None:
        """A forward starts (an unfinished one before it, a forward that raised or the first,
        whose last block was not known yet, is no sample)."""
        self._current = None
        if not self.recording or len(self._pending) >= MAX_PENDING:
            return
        self._current = _Forward(self._event() if self.platform.has_streams else None)

    def abort(self) -> None:
        """The forward being timed raised: no sample (its waits may be half recorded)."""
        self._current = None

    def skip(self) -> None:
        """The forward being timed is no steady one (a re-plan applied at its start)."""
        if self._current is not None:
            self._current.skip = True

    def wait_event(self, stream: Any) -> None:
        if self._current is not None and self.platform.has_streams:
            e = self.platform.new_event(timing=True)
            e.record(stream)
            self._current.events.append(e)

    def end(self) -> None:
        """The forward's last block exited."""
        f, self._current = self._current, None
        if f is None:
            return
        if not self.platform.has_streams:
            self.samples.append(Sample(0.0, 0.0, f.skip))
            return
        f.end = self._event()
        self._pending.append(f)

    def collect(self) -> None:
        """Read the forwards whose events completed, in order (never waits)."""
        while self._pending and self._pending[0].end.query():
            f = self._pending.popleft()
            pairs = f.events[: len(f.events) // 2 * 2]
            waited = sum(a.elapsed_time(b) for a, b in zip(pairs[::2], pairs[1::2]))
            self.samples.append(Sample(f.start.elapsed_time(f.end), waited, f.skip))
