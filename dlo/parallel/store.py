"""Exchanges through the job's key-value store: every rank publishes one small record and reads
every rank's, with a timeout that names the ranks that never came.

Used by the startup agreement (:mod:`dlo.parallel.agreement`), the automatic policy's
measurements and the node-shared host copy. No tensor collective: nothing here can
mismatch in size between ranks.

[Note: one failed startup ends the worker]
Each exchange is numbered per process and per topic, so ranks stay paired only while every
rank takes part in every exchange. An exchange is decided exactly once in the store: every
rank publishes its record, then adds 1 to the exchange's arrival counter; the rank whose add
completes the count writes the outcome ``ok``; a rank that waited ``timeout_s`` adds a large
closing value instead, and the first such add (with arrivals short) writes the outcome
``closed``. A rank arriving after the close sees it in its own add's result, so no rank ever
reads a record of a closed (or earlier) exchange as a current one. Any startup that failed
after its first exchange (a timeout, a failed vote, a local failure between exchanges, a
failure after the agreement) marks the process (:func:`startup_failed`) and the store
(key ``dlo/startup-failed``): every later exchange of every backend object, in this process
or in a peer, refuses at once with an error naming what failed, and a peer waiting in an
exchange stops waiting. Ranks have no way to re-pair their numbering short of a new store,
so the worker must be recreated.

[Note: naming a missing rank]
A rank that never arrives may have exited (killed, crashed), hang, or simply not call
enable. Every rank records its process (pid and host) in the store when it creates a
multi-rank backend and when it enters its first exchange (:func:`announce`); a rank that gave
up waiting reads the missing ranks' records, and for a rank of its own host asks the kernel
whether that process still runs, so the timeout says "exited" or "running but not in
enable" instead of guessing. A store that cannot be reached (its host, rank 0, exited) is
named as such rather than surfacing torch's ``DistNetworkError``.

[Note: the store outlives the last read]
Rank 0 hosts the store when the job's processes were started without torchrun's agent. A rank
that reads an exchange's outcome and then fails (a refused agreement: exit 2 at once) would
take the store with it while a peer still polls for that outcome, and the peer reported "the
store cannot be reached" instead of the refusal (1 run in 6 of the two-folder test). So every
rank adds 1 to the exchange's read counter once it has read every record, and rank 0, where
it hosts the store (not under torchrun's agent store), waits at interpreter exit until every
rank has read the last exchange of each topic on that store: on a daemon thread joined for at
most :data:`DRAIN_BOUND_S`, so an unresponsive store cannot hold the exit. Its ``atexit``
handler is registered after dlo's own process group (:func:`dlo.parallel.groups.init`), so it
runs before that group is destroyed; a group the user destroys first ends the wait at once.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from dlo.errors import OffloadError
from dlo.parallel.records import decode, encode
from dlo.platform.env import torchrun_env

_GENERATIONS: dict[str, itertools.count[int]] = {}

_LAST_READ: dict[str, tuple[int, str, int]] = {}
"""Per topic, the last exchange this process read (the store's id, the key prefix and the
world size); see [Note: the store outlives the last read]."""

DRAIN_BOUND_S = 5.0
"""How long rank 0 waits at exit for its peers to read the last exchanges."""

_await_registered = False


_exchanges_started = 0


_failed: str | None = None
"""What made this process's multi-rank startup fail (see [Note: one failed startup ends
the worker]); None while none did."""


FAILED_KEY = "dlo/startup-failed"


_CLOSED = 1 << 20
"""Added to an exchange's arrival counter by a rank that gave up waiting (more than any
rank count)."""


_POLL_S = 0.02


_announced: set[int] = set()
"""The stores (by id) this process has recorded itself in."""


_POLL_MAX_S = 0.25
"""A waiting rank polls the store at 20 ms, backing off to 250 ms: quick startups stay quick,
a long wait (a peer loading a checkpoint) costs rank 0's store a few requests a second."""


def announce(rank: int) -> None:
    """Record this process (pid, host) under ``dlo/process/<rank>`` once (see [Note: naming a
    missing rank]); a store that cannot be reached now is left for the exchange to name."""
    try:
        store = _default_store()
        if id(store) in _announced:
            return
        record = {"pid": os.getpid(), "host": socket.gethostname(), "pidns": _pid_namespace()}
        store.set(f"dlo/process/{rank}", json.dumps(record).encode())
        _announced.add(id(store))  # once per store: a new process group has a new one
    except Exception:
        pass


def _pid_namespace() -> int:
    """This process's PID namespace (0 if unknown): one host name may hold several."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def store_unreachable(what: str, e: BaseException, *, rank: int) -> OffloadError:
    """The error for a store that cannot be reached (see [Note: naming a missing rank])."""
    env = torchrun_env()
    where = f"{env.master_addr or '?'}:{env.master_port if env.master_port is not None else '?'}"
    return OffloadError(
        f"{what}: the job's key-value store cannot be reached ({e}); its host (rank 0's "
        f"process, or torchrun's agent) at MASTER_ADDR:MASTER_PORT ({where}) has probably "
        "exited: see its log",
        rank=rank,
    )


def whereabouts(store: Any, ranks: list[int]) -> str:
    """What is known of each missing rank's process (see [Note: naming a missing rank])."""
    here, parts = socket.gethostname(), []
    for r in ranks:
        key = f"dlo/process/{r}"
        try:  # a record of another shape is as good as none
            record: Any = json.loads(bytes(store.get(key))) if _has_key(store, key) else None
            pid, host = int(record["pid"]), str(record["host"])
            pidns = int(record.get("pidns", 0))
        except (TypeError, ValueError, KeyError, AttributeError):
            parts.append(f"rank {r} never created a dlo backend (it failed or exited before)")
            continue
        if host != here or pidns != _pid_namespace():  # its pid means nothing here
            parts.append(f"rank {r} (pid {pid} on {host}) exited, hangs or is not in enable")
        elif _running(pid):
            parts.append(
                f"rank {r} (pid {pid}, this host) is running but not at this exchange (slower "
                "to get here, hung, or not calling enable)"
            )
        else:
            parts.append(f"rank {r} (pid {pid}, this host) has exited: killed or crashed")
    return "; ".join(parts)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")  # not a zombie
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel directly
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def exchanges_started() -> int:
    """How many exchanges this process has entered (to tell whether a failed enable had
    started a multi-rank startup)."""
    return _exchanges_started


def startup_failed(reason: str, *, rank: int) -> None:
    """Mark this process, and the job's store, after a multi-rank startup failed partway
    (see [Note: one failed startup ends the worker]). The first reason is kept."""
    global _failed
    if _failed is None:
        _failed = f"rank {rank}: {reason}"
    try:
        store = _default_store()
        if not _has_key(store, FAILED_KEY):
            store.set(FAILED_KEY, _failed.encode())
    except Exception:  # no store left: the process mark still refuses here
        pass


def describe_failure(e: BaseException) -> str:
    """``e`` as a reason for :func:`startup_failed`: an :class:`OffloadError`'s own message
    (without its rank prefix, which the mark adds), else ``"Type: message"``."""
    if isinstance(e, OffloadError):
        text = str(e)
        return text.split("] ", 1)[1] if text.startswith("[dlo rank ") else text
    return f"{type(e).__name__}: {e}"


def _refusal(store: Any, *, rank: int, what: str) -> OffloadError | None:
    global _failed
    if _failed is None and _has_key(store, FAILED_KEY):  # a peer's: this process adopts it
        _failed = bytes(store.get(FAILED_KEY)).decode(errors="replace")
    reason = _failed
    if reason is None:
        return None
    return OffloadError(
        f"{what} refused: a previous multi-rank startup of dlo failed ({reason}); the "
        "ranks' exchanges can no longer be paired: recreate the worker",
        rank=rank,
    )


def share(
    obj: Any,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    topic: str,
    what: str,
    types: Iterable[type] = (),
) -> list[Any]:
    """Publish one record ``obj`` through the default store and read every rank's, in rank
    order, as JSON (:mod:`dlo.parallel.records`: plain values, tuples and instances of the
    dataclasses in ``types``; never pickle). Every rank calls it the same number of times
    per ``topic``.

    Raises:
        OffloadError: some ranks did not publish within ``timeout_s`` (named, with ``what``),
            or a record read back is malformed or of a type not in ``types``.
    """
    if world_size == 1:
        return [obj]
    global _exchanges_started
    _exchanges_started += 1
    store = _default_store()
    announce(rank)
    try:
        refused = _refusal(store, rank=rank, what=what)
        if refused is not None:
            raise refused
        records = _share(
            store,
            encode(obj),
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            topic=topic,
            what=what,
        )
        try:
            return [decode(r, types) for r in records]
        except ValueError as e:
            raise OffloadError(f"{what}: {e}", rank=rank) from None
    except dist.DistNetworkError as e:
        err = store_unreachable(what, e, rank=rank)
        startup_failed(describe_failure(err), rank=rank)
        raise err from e
    except BaseException as e:
        startup_failed(describe_failure(e), rank=rank)
        raise


def _share(
    store: Any,
    record: bytes,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    topic: str,
    what: str,
) -> list[bytes]:
    generation = next(_GENERATIONS.setdefault(topic, itertools.count()))
    prefix = f"dlo/{topic}/{generation}"
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    outcome = f"{prefix}/outcome"
    store.set(keys[rank], record)
    arrived = store.add(f"{prefix}/count", 1)
    if arrived >= _CLOSED:
        raise OffloadError(
            f"{what}: a peer had already given up this exchange (it waited "
            f"{timeout_s:g}s for this rank); the ranks' startups are out of step",
            rank=rank,
        )
    if arrived == world_size:
        store.set(outcome, b"ok")
    deadline = time.monotonic() + timeout_s
    pause = _POLL_S
    while not _has_key(store, outcome):
        refused = _refusal(store, rank=rank, what=what)
        if refused is not None:
            if _close(store, prefix, world_size):
                break  # decided "ok" before a peer's later failure marked the store
            raise refused
        if time.monotonic() >= deadline:
            if not _close(store, prefix, world_size):
                missing = [r for r, k in enumerate(keys) if not _has_key(store, k)]
                raise OffloadError(
                    f"{what} timed out after {timeout_s:g}s: rank(s) {missing} never "
                    f"reached enable ({whereabouts(store, missing)}; every rank of the job "
                    "must call enable with the same model)",
                    rank=rank,
                )
            break
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 1.5, _POLL_MAX_S)
    if bytes(store.get(outcome)) != b"ok":
        raise OffloadError(f"{what}: a peer gave up this exchange after {timeout_s:g}s", rank=rank)
    records = [bytes(store.get(k)) for k in keys]
    store.add(f"{prefix}/read", 1)
    global _await_registered
    if rank == 0 and not _await_registered and not _agent_store():
        _await_registered = True  # once, even after forget_reads() emptied _LAST_READ
        atexit.register(await_readers)  # after dlo's group destroy handler: runs before it
    _LAST_READ[topic] = (id(store), prefix, world_size)
    return records


def forget_reads() -> None:
    """Drop the exchanges waited on at exit: their store is going (a process group
    destroyed; a new one's store could reuse the id)."""
    _LAST_READ.clear()
    _announced.clear()


def _agent_store() -> bool:
    try:
        return torchrun_env().agent_store
    except ValueError:  # a malformed torchrun environment: assume rank 0 hosts the store
        return False


def await_readers(bound_s: float | None = None) -> None:
    """Rank 0 at exit: wait until every rank has read the last exchange of each topic on
    the current store, on a daemon thread joined for at most ``bound_s`` (default
    :data:`DRAIN_BOUND_S`); see [Note: the store outlives the last read]. A store already
    gone ends the wait."""
    bound = DRAIN_BOUND_S if bound_s is None else bound_s
    waiter = threading.Thread(target=_read_by_all, args=(bound,), name="dlo-await-readers")
    waiter.daemon = True
    waiter.start()
    waiter.join(bound)


def _read_by_all(bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    try:
        store = _default_store()
        for store_id, prefix, world_size in list(_LAST_READ.values()):
            if store_id != id(store):
                continue  # an earlier process group's store: nobody reads it any more
            while store.add(f"{prefix}/read", 0) < world_size:
                if time.monotonic() >= deadline:
                    return
                time.sleep(_POLL_S)
    except Exception:  # no group or no store left: nothing to wait for
        return


def _close(store: Any, prefix: str, world_size: int) -> bool:
    """Give up waiting on the exchange at ``prefix``; True when every rank had arrived
    anyway (the outcome is, or is about to be, ``ok``)."""
    total = store.add(f"{prefix}/count", _CLOSED)
    complete = total % _CLOSED == world_size
    if total < 2 * _CLOSED and not complete:  # the first close: it decides
        store.set(f"{prefix}/outcome", b"closed")
    if complete or total >= 2 * _CLOSED:  # decided by another rank: wait for its word
        store.wait([f"{prefix}/outcome"], datetime.timedelta(seconds=30))
    return complete and bytes(store.get(f"{prefix}/outcome")) == b"ok"


def _default_store() -> Any:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise OffloadError("this torch exposes no default store for dlo's startup agreement")
    return get()


def _has_key(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except dist.DistNetworkError:
        raise  # the store is gone: named by share
    except Exception:
        return False
