"""A multi-rank startup that failed partway ends the worker (FAULTS.md C, "enable again
after a failed multi-rank startup"), and a local failure before the vote is named on every
rank promptly. Real gloo ranks; see [Note: one failed startup ends the worker]."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

import dlo
from dlo import faults
from dlo.backends.layerwise import LayerwiseBackend
from dlo.platform.device import CpuPlatform
from tests.harness import assert_all_ok, run_ranks
from tests.toys import ToyDiT

TIMEOUT_S = 3.0


def _cfg(**kw: object) -> dlo.OffloadConfig:
    return dlo.OffloadConfig(
        mode="layer", transfer="allgather", collective_timeout_s=TIMEOUT_S, **kw
    )


def _backend(world: int, cfg: dlo.OffloadConfig | None = None) -> LayerwiseBackend:
    return LayerwiseBackend(
        cfg or _cfg(), dlo.ParallelConfig(data_parallel_size=world), CpuPlatform()
    )


def _attempt(backend: LayerwiseBackend, model: ToyDiT) -> tuple[float, str]:
    """``(seconds, "Type: message")`` of one enable that must fail with an OffloadError (a
    ValueError: this rank's config was refused)."""
    t0 = time.monotonic()
    try:
        backend.enable(model)
    except (dlo.OffloadError, ValueError) as e:
        return time.monotonic() - t0, f"{type(e).__name__}: {e}"
    return time.monotonic() - t0, "enabled"


def _peer_skips_round_one(rank: int, world: int) -> list[tuple[float, str]]:
    model, backend = ToyDiT(3), _backend(world)
    rounds = []
    if rank == 0:
        rounds.append(_attempt(backend, model))  # rank 1 never comes: times out
    dist.barrier()  # rank 1 arrives only after rank 0 gave up
    rounds.append(_attempt(backend, model))  # the same backend object
    rounds.append(_attempt(_backend(world), model))  # and a new one
    return rounds


def test_enable_after_a_timed_out_startup_is_refused_on_every_rank() -> None:
    outs = assert_all_ok(run_ranks(_peer_skips_round_one, 2, timeout_s=60))
    seconds, first = outs[0][0]
    assert "rank(s) [1] never reached enable" in first and seconds < TIMEOUT_S + 2
    for rank, rounds in enumerate(outs):
        later = rounds[1:] if rank == 0 else rounds
        for seconds, msg in later:
            # each rank once named the other as missing, or paired with its stale record
            assert msg.startswith("OffloadError"), msg
            assert "previous multi-rank startup of dlo failed" in msg, msg
            assert "recreate the worker" in msg and "never reached enable" in msg, msg
            assert seconds < 1.0, (seconds, msg)


def _mapped_on_rank_one(rank: int, world: int) -> list[tuple[float, str]]:
    model = ToyDiT(3)
    # host_backing="mapped" with an AllGather stack fails after the request exchange
    backend = _backend(world, _cfg(host_backing="mapped") if rank == 1 else None)
    rounds = [_attempt(backend, model)]
    dist.barrier()
    rounds.append(_attempt(backend, model))
    rounds.append(_attempt(_backend(world), model))  # a valid config on a new object
    return rounds


def test_local_failure_before_the_vote_is_named_on_every_rank_then_refused() -> None:
    outs = assert_all_ok(run_ranks(_mapped_on_rank_one, 2, timeout_s=60))
    # the vote: the same message on every rank; the rank whose config was refused raises
    # it as a ValueError, its peer as an OffloadError
    assert outs[0][0][1].startswith("OffloadError: [dlo rank 0] enable failed on rank(s) [1]")
    assert outs[1][0][1].startswith("ValueError: enable failed on rank(s) [1]")
    assert outs[0][0][1].split("]", 1)[1] == outs[1][0][1].split(":", 1)[1]
    for rounds in outs:
        seconds, msg = rounds[0]
        assert seconds < TIMEOUT_S / 2, (seconds, msg)  # not the timeout
        assert "rank(s) [1]" in msg and "ValueError: host_backing='mapped'" in msg, msg
        for seconds, msg in rounds[1:]:
            assert "DistStoreError" not in msg and "recreate the worker" in msg, msg
            assert seconds < 1.0, (seconds, msg)


def _fails_between_exchanges(rank: int, world: int) -> tuple[float, str]:
    backend = _backend(world)
    if rank == 1:  # after the request exchange, outside the vote: peers wait in the vote
        with faults.inject("agreement"):
            return _attempt_any(backend)
    return _attempt(backend, ToyDiT(3))


def _attempt_any(backend: LayerwiseBackend) -> tuple[float, str]:
    t0 = time.monotonic()
    try:
        backend.enable(ToyDiT(3))
    except Exception as e:
        return time.monotonic() - t0, f"{type(e).__name__}: {e}"
    return time.monotonic() - t0, "enabled"


def test_failure_between_exchanges_stops_the_waiting_peer_naming_it() -> None:
    (s0, m0), (_, m1) = assert_all_ok(run_ranks(_fails_between_exchanges, 2, timeout_s=60))
    assert m1.startswith("InjectedFault"), m1
    assert s0 < TIMEOUT_S / 2, (s0, m0)
    assert "rank 1" in m0 and "agreement" in m0 and "recreate the worker" in m0, m0


def _peer_exits_or_idles(rank: int, world: int, exits: bool) -> tuple[float, str]:
    dist.barrier()  # both ranks' gloo setup done before rank 1 may exit
    backend = _backend(world)
    if rank == 1:
        if exits:
            os._exit(3)  # killed before the startup exchange (issue 26 item 6)
        time.sleep(TIMEOUT_S + 2)  # alive, never in enable
        return 0.0, "idle"
    return _attempt(backend, ToyDiT(3))


@pytest.mark.parametrize("exits", [True, False])
def test_a_missing_rank_is_named_as_exited_or_running(exits: bool) -> None:
    """[Note: naming a missing rank]: the timeout says whether the missing rank's process
    still runs (same host: asked of the kernel), not only that it never reached enable."""
    outs = run_ranks(_peer_exits_or_idles, 2, exits, timeout_s=60)
    assert outs[0].ok, outs[0]
    seconds, msg = outs[0].value
    assert "rank(s) [1] never reached enable" in msg and seconds < TIMEOUT_S + 2, msg
    if exits:
        assert outs[1].exitcode == 3, outs[1]
        assert "rank 1 (pid " in msg and "this host) has exited: killed or crashed" in msg, msg
    else:
        assert "this host) is running but not at this exchange" in msg, msg


def _store_host_exits(rank: int, world: int) -> str:
    dist.barrier()  # both ranks' gloo setup done: rank 0's exit must not cut rank 1's short
    if rank == 0:
        os._exit(0)  # rank 0 serves the job's TCPStore
    time.sleep(0.5)
    try:
        _backend(world).enable(ToyDiT(3))
    except dlo.OffloadError as e:
        return str(e)
    return "enabled"


def test_a_store_whose_host_exited_is_named_not_a_raw_network_error() -> None:
    outs = run_ranks(_store_host_exits, 2, timeout_s=60)
    assert outs[1].ok, outs[1]
    msg = outs[1].value
    assert "key-value store cannot be reached" in msg and "rank 0's process" in msg, msg
