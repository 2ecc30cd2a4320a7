"""Timing and tracing on the device's streams: exposed-wait timers (no host sync on the hot
path) and profiler ranges with stable labels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dlo.platform.device import Platform


# ----------------------------------------------------------------------------- timing
class StreamTimer:
    """Accumulates the device time between two points of one stream, without host syncs.

    ``begin``/``end`` record a pair of timing events; the elapsed time is collected later,
    by the next ``begin`` when the pair has completed (a non-blocking ``query``), or by
    ``harvest(block_host=True)`` on a setup/statistics path. A pair still running when it
    is needed again is dropped and counted, never waited for. On platforms without streams
    the timer reads zero.
    """

    def __init__(self, platform: Platform) -> None:
        self._events = (
            (platform.new_event(timing=True), platform.new_event(timing=True))
            if platform.has_streams
            else None
        )
        self._pending = False
        self.total_ms = 0.0
        self.count = 0
        self.dropped = 0

    def begin(self, stream: Any) -> None:
        if self._events is not None:
            self.harvest()
            self._events[0].record(stream)

    def end(self, stream: Any) -> None:
        if self._events is not None:
            self._events[1].record(stream)
            self._pending = True

    def harvest(self, *, block_host: bool = False) -> None:
        if not self._pending or self._events is None:
            return
        start, end = self._events
        if block_host:
            end.synchronize()
        elif not end.query():
            self.dropped += 1
            self._pending = False
            return
        self.total_ms += start.elapsed_time(end)
        self.count += 1
        self._pending = False


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """Profiler range with a stable label (``dlo::h2d``, ``dlo::allgather``, ``dlo::wait``)."""
    with torch.profiler.record_function(name):
        yield
