"""A small multi-process harness: real process groups, per-rank outcomes, a bound on time.

``run_ranks(fn, world_size, timeout_s=...)`` starts ``world_size`` processes (forkserver,
torch preloaded), initializes a process group in each (gloo on CPU, NCCL when ``backend``
says so, one GPU per rank; gloo with CUDA tensors where ``DLO_SHARE_GPU=1`` puts the ranks on
fewer GPUs: :func:`gpu`), calls ``fn(rank, world_size, *args)`` and returns one
:class:`Outcome` per rank: the value returned, or the exception (type name and message), or
the exit code of a process that died, or ``timed_out``. A process still running at the
bound is killed, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "dlo"])


@dataclass
class Outcome:
    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error_type is None and not self.timed_out and self.exitcode in (0, None)

    def __repr__(self) -> str:
        if self.ok:
            return f"Outcome(rank={self.rank}, value={self.value!r})"
        return (
            f"Outcome(rank={self.rank}, error={self.error_type}: {self.error}, "
            f"exitcode={self.exitcode}, timed_out={self.timed_out})\n{self.traceback or ''}"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    env: dict[str, str],
    args: tuple,
    out: Any,
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            **env,
        }
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":  # NCCL, or gloo where ranks share a GPU (DLO_SHARE_GPU=1)
        from dlo.parallel.groups import gpu_backend

        dev = gpu(rank)
        torch.cuda.set_device(dev)
        backend = gpu_backend(dev)
        if backend == "nccl":
            kwargs["device_id"] = dev
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
        **kwargs,
    )
    try:
        value = fn(rank, world, *args)
        ok = True
    except BaseException as e:  # report, never run collective cleanup on a failure path
        ok = False
        out.put((rank, "err", type(e).__name__, str(e), traceback.format_exc()))
    if ok:
        # pickled here, by value: the queue's own pickler passes a tensor's storage as a file
        # descriptor that the parent fetches from this process, which may have exited by then
        # ("Connection reset by peer" in the parent); and it pickles in a feeder thread, where
        # a failure would only be printed
        try:
            out.put((rank, "ok", pickle.dumps(value), None, None))
        except Exception as e:
            out.put((rank, "err", type(e).__name__, f"result not picklable: {e}", None))
    out.close()
    out.join_thread()  # the result reaches the parent before this process may exit
    if not ok and rank == 0:  # as the interpreter's exit would: rank 0, the store's host,
        # keeps it up until every rank has read the last exchange (a peer still reading the
        # enable agreement would find the store gone: seen in the one-GPU lane)
        from dlo.parallel.store import await_readers

        await_readers()
    if ok and _all_arrive(world):
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    os._exit(0)


def _all_arrive(world: int, bound_s: float = 10.0) -> bool:
    """Every rank reaches this point before any rank tears the store down (rank 0 hosts
    it). Through the store, bounded: a collective barrier would wait on a dead or diverged
    peer until the harness's bound."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("harness/done", 1)
        deadline = time.monotonic() + bound_s
        while store.add("harness/done", 0) < world:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True
    except Exception:
        return False


def gpu(rank: int) -> Any:
    """The CUDA device of ``rank`` (its own GPU, or a shared one under ``DLO_SHARE_GPU=1``:
    [Note: ranks sharing a GPU] in :mod:`dlo.platform.sharing`)."""
    from dlo.platform.device import default_device

    return default_device(rank)


def shares_gpu(world: int) -> bool:
    """Whether ``world`` ranks started by :func:`run_ranks` share GPUs (the one-GPU
    multi-rank lane: ``DLO_SHARE_GPU=1`` and fewer GPUs than ranks)."""
    import torch

    from dlo.platform.sharing import ranks_share_gpus

    return ranks_share_gpus(world, torch.cuda.device_count())


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    pg_timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes (see module doc)."""
    out = _CTX.Queue()
    port = free_port()
    procs = [
        _CTX.Process(
            target=_child,
            args=(fn, r, world_size, port, backend, pg_timeout_s, env or {}, args, out),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, out, world_size, timeout_s)
    finally:  # interrupted (pytest-timeout, ^C): no rank outlives its test, holding devices
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _collect(procs: list[Any], out: Any, world_size: int, timeout_s: float) -> list[Outcome]:
    results: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < world_size and time.monotonic() < deadline:
        try:
            rank, kind, a, b, c = out.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and out.empty():
                break
            continue
        results[rank] = (
            Outcome(rank, value=pickle.loads(a))
            if kind == "ok"
            else Outcome(rank, error_type=a, error=b, traceback=c)
        )
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) if r not in results else 5.0)
        if p.is_alive():
            p.kill()
            p.join()
            results.setdefault(r, Outcome(r, timed_out=True))
        results.setdefault(
            r, Outcome(r, exitcode=p.exitcode, error_type="died", error=f"exit code {p.exitcode}")
        )
    return [results[r] for r in range(world_size)]


def assert_all_ok(outcomes: list[Outcome]) -> list[Any]:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(repr(o) for o in bad)
    return [o.value for o in outcomes]


def forward_outcomes(model: Any, inputs: list[Any]) -> list[str]:
    """Run ``model(x)`` under ``no_grad`` for each input, as an application that catches
    Ctrl-C would: ``"ok"``, ``"interrupted"``, or the first dlo error (type: message), which
    ends the list."""
    import torch

    import dlo

    log: list[str] = []
    for x in inputs:
        try:
            with torch.no_grad():
                model(x)
            log.append("ok")
        except KeyboardInterrupt:
            log.append("interrupted")
        except dlo.OffloadError as e:
            log.append(f"{type(e).__name__}: {e}")
            break
    return log


def run_program(
    program: Any, *args: str, ranks: int = 1, timeout_s: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run the script ``program`` (a Path) on the CPU as a user would: one process, or
    ``ranks`` under torchrun (``--standalone``); dlo from this checkout, no inherited
    torchrun variables. Its temporary files (torchrun's ``torchelastic_*`` folders, which
    it leaves) go to a ``tmp`` folder beside it, not the test session's."""
    root = Path(__file__).resolve().parents[1]
    tmp = Path(program).parent / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp),
    }
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return subprocess.run(
        [*launch, str(program), *args],
        cwd=Path(program).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def run_rank_processes(
    argv_of: Callable[[int], list[str]], world: int, *, timeout_s: float = 240
) -> list[tuple[int, str, str]]:
    """One process per rank, started by hand with torchrun's variables (no torchrun, so no
    agent store: rank 0 hosts the job's store), dlo from this checkout; rank r runs
    ``argv_of(r)``. Returns ``(exit code, stdout, stderr)`` per rank; a process still
    running at the end is killed."""
    root = Path(__file__).resolve().parents[1]
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
        }
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(
            subprocess.Popen(
                argv_of(rank),
                env=env,
                cwd=root,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs
