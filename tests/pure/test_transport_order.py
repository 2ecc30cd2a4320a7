"""The order in which a load drives the copy-engine gather (pure: recording fakes on CPU).

The copy-engine gather is only correct in one order per block: this rank's tag posted before
the first barrier, the tags read after it and before the trailing barrier, every chunk's
pulls after that chunk's barrier ([Note: lock-step tags], [Note: copy-engine gather])."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dlo.plan.layout import plan_block_layout
from dlo.platform.device import CpuPlatform
from dlo.runtime.transport import BlockTransport, TransferCounters


class _CE:
    def __init__(self, log: list[str], tags: bool) -> None:
        self.log, self.has_tags = log, tags
        self.tags = torch.zeros(4, dtype=torch.int64)

    def covers(self, dst: torch.Tensor) -> bool:
        return True

    def post_tag(self, stream: Any, index: int, slot: int) -> None:
        self.log.append(f"post_tag {index} {slot}")

    def wait_chunk(self, stream: Any, what: str) -> None:
        self.log.append("barrier")

    def pull_chunk(self, dst: torch.Tensor, layout: Any, k: int) -> None:
        self.log.append(f"pull {k}")

    def finish(self, stream: Any, what: str) -> None:
        self.log.append("barrier (end)")


class _Check:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def issue(self, index: int, stream: Any, *, slot: int = -1) -> None:
        self.log.append(f"nccl check {index} {slot}")

    def take(self) -> str:
        self.log.append("take")
        return "entry"

    def read(
        self, tags: torch.Tensor, stream: Any, index: int, *, slot: int, entry: Any = None
    ) -> None:
        self.log.append(f"read tags {index} {slot} with {entry}")


@pytest.mark.parametrize("tags", [True, False])
def test_a_load_drives_the_copy_engine_gather_in_order(tags: bool) -> None:
    layout = plan_block_layout(
        "blocks.0", [("w", "param", (3, 1024), (1024, 1), torch.float32)], group_size=2,
        chunk_nbytes=4096,
    )  # fmt: skip
    assert layout.num_chunks == 3
    log: list[str] = []
    pf = CpuPlatform()
    transport = BlockTransport(
        pf,
        group=object(),
        group_rank=1,
        group_size=2,
        copy_stream=pf.new_stream(),
        comm_stream=pf.new_stream(),
        max_chunks=layout.num_chunks,
        counters=TransferCounters(),
        sequence_check=_Check(log),  # type: ignore[arg-type]
        ce_gather=_CE(log, tags),  # type: ignore[arg-type]
    )
    shard = torch.arange(layout.shard_nbytes, dtype=torch.int64).to(torch.uint8)
    slot = torch.zeros(layout.padded_nbytes, dtype=torch.uint8)
    transport.load(
        layout, shard, slot, free_event=pf.new_event(), ready_event=pf.new_event(), index=7,
        slot_index=1,
    )  # fmt: skip
    # with tags the check's entry is taken (a divergence raised) before anything is enqueued
    first = (
        ["take", "post_tag 7 1", "barrier", "read tags 7 1 with entry"]
        if tags
        else ["nccl check 7 1", "barrier"]
    )
    assert log == [*first, "pull 0", "barrier", "pull 1", "barrier", "pull 2", "barrier (end)"]
    for start, end, off in layout.shard_ranges(1):  # this rank's slices landed in place
        assert torch.equal(slot[start:end], shard[off : off + layout.slice_nbytes])
