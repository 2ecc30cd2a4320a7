"""[Note: the store outlives the last read], with real processes: rank 0 hosts the store
(no torchrun agent), reads an exchange and exits at once; rank 1 polls slowly, so it reads
the outcome after rank 0 has begun to exit. Without rank 0's wait at exit rank 1 found the
store gone ("cannot be reached"); with it both read every record."""

from __future__ import annotations

import sys

from tests.harness import run_rank_processes

_RANK = """
import datetime, sys, time
import torch.distributed as dist
import dlo.parallel.store as store
rank = int(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
if rank == 1:  # arrive first, then sleep through rank 0's arrival and exit
    store._POLL_S = store._POLL_MAX_S = 4.0
else:
    time.sleep(0.5)
got = store.share(("hello", rank), rank=rank, world_size=2, timeout_s=30.0, topic="t", what="t")
print("records", got, flush=True)
"""


def test_rank_zero_exiting_right_after_an_exchange_leaves_the_store_to_its_reader() -> None:
    outs = run_rank_processes(lambda rank: [sys.executable, "-c", _RANK, str(rank)], 2)
    for rc, out, err in outs:
        assert rc == 0, err[-2000:]
        assert "records [['hello', 0], ['hello', 1]]" in out or "records [('hello', 0)" in out, out
