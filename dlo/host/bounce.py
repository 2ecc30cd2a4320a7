"""A page-locked buffer that whole-block copies outside the ring go through.

[Note: bounce buffer]
A copy between the device and pageable memory runs at a fraction of the link: on one H200,
7.4 GB/s host to device from pageable memory and 1.3 GB/s device to host into fresh memory
(``.cpu()``), against 55 GB/s both ways through pinned memory (docs/benchmarks.md,
2026-12-02g). The codec's passes move every block once outside the ring (the encode at
enable, the decode of a disable's restore and of ``state_dict()``), so each goes through one
buffer of the largest block it moves (the encode pass two, one packed on a thread while the
other's block is encoded): filled, copied, and reused block after block, pinned once for the
pass (a restore, one ``state_dict()`` call) and released when it ends; decodes take turns
in it (a lock), since ``state_dict()`` may run on any thread. The ledger counts it while it
lives; it is not charged to ``pin_budget_gb`` (it lives only during the pass, one or two
blocks' bytes). Where it cannot be pinned (a platform without pinning, a failed
registration) it is ordinary memory: slower, the same bytes.
"""

from __future__ import annotations

import torch

from dlo.host.region import HostRegion
from dlo.journal import atomic
from dlo.platform.device import Platform


class Bounce:
    """One reusable host buffer of at least ``nbytes`` (grown on demand), pinned where the
    platform can pin (see [Note: bounce buffer])."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self._region: HostRegion | None = None

    def view(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer (uint8); a larger request replaces it."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        region = self._region
        if region is None or region.block_nbytes[0] < nbytes:
            self.close()
            with atomic():  # [Note: interrupts during enable]: made and known together
                region = HostRegion([nbytes])
                try:
                    if self.platform.can_pin:
                        region.pin(self.platform, num_workers=1)
                except BaseException:
                    region.close()
                    raise
                self._region = region
        return region.view(0)[:nbytes]

    @property
    def pinned(self) -> bool:
        return self._region is not None and self._region.is_pinned(0)

    def close(self) -> None:
        """Unpin and release the buffer (idempotent); the next :meth:`view` makes a new one.
        The device is synchronized first: a pass that failed or was interrupted may have left
        a copy into or out of it queued."""
        with atomic():  # released and known as released together
            if self._region is not None:
                if self._region.is_pinned(0):
                    self.platform.synchronize()
                region, self._region = self._region, None
                region.close()
