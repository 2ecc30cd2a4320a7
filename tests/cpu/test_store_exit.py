"""[Note: the store outlives the last read], with real processes: rank 0 hosts the store
(no torchrun agent), reads an exchange and exits at once; rank 1 polls slowly, so it reads
the outcome after rank 0 has begun to exit. Without rank 0's wait at exit rank 1 found the
store gone ("cannot be reached"); with it both read every record."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[2]

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
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
        }
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _RANK, str(rank)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, out, err in outs:
        assert rc == 0, err[-2000:]
        assert "records [['hello', 0], ['hello', 1]]" in out or "records [('hello', 0)" in out, out
