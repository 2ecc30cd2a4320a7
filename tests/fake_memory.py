"""A device allocator for the CPU platform, so re-plans ([Note: re-plan between forwards] in
:mod:`dlo.plan.replan`) run, and are tested, without a GPU.

The CPU platform has no allocator statistics (its ``memory_now`` is None). This one says
the process holds ``fixed`` bytes plus what dlo holds on the device that a re-plan changes
(the pool's slots and the pinned blocks' buffers, read from the backend), and every block
forward reaches a peak of that plus ``per_element`` bytes per element of the block's inputs,
as a DiT's activations do. ``limit`` may differ per rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dlo.platform.device import CpuPlatform, MemoryNow
from dlo.runtime.replan import input_elements


class FakeMemory:
    def __init__(self, *, limit: int, fixed: int = 1 << 20, per_element: int = 64) -> None:
        self.limit, self.fixed, self.per_element = limit, fixed, per_element
        self.peak = 0
        self.backend: Any = None
        self.calls = 0

    def movable(self) -> int:
        state = self.backend._state if self.backend is not None else None
        if state is None or state.scheduler is None:
            return 0
        pinned = sum(b.own.buffer.numel() for r in state.scheduler.rings for b in r.blocks if b.own)
        return (state.pool.nbytes if state.pool else 0) + pinned

    def now(self) -> MemoryNow:
        self.calls += 1
        allocated = self.fixed + self.movable()
        self.peak = max(self.peak, allocated)
        return MemoryNow(allocated=allocated, peak=self.peak, limit=self.limit)

    def block_ran(self, elements: int) -> None:
        self.peak = max(self.peak, self.fixed + self.movable() + self.per_element * elements)

    def watch(self, blocks: list[nn.Module]) -> None:
        """Every forward of ``blocks`` reaches its activation peak."""
        for m in blocks:
            m.register_forward_pre_hook(
                lambda _m, args, kwargs: self.block_ran(input_elements(args, kwargs)),
                with_kwargs=True,
            )

    def install(self, monkeypatch: Any = None) -> None:
        fake = self

        def memory_now(_self: CpuPlatform) -> MemoryNow:
            return fake.now()

        if monkeypatch is not None:
            monkeypatch.setattr(CpuPlatform, "memory_now", memory_now)
        else:  # a rank's own process
            CpuPlatform.memory_now = memory_now  # type: ignore[method-assign]


def x(batch: int, dim: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, dim, generator=torch.Generator().manual_seed(seed))
