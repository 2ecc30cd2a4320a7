"""Distributed layerwise offload with real gloo process groups (world sizes 1-4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dlo
from dlo import faults
from dlo.backends.layerwise import LayerwiseBackend
from dlo.host.region import LEDGER
from dlo.platform.device import CpuPlatform
from tests.harness import assert_all_ok, forward_outcomes, run_ranks
from tests.toys import ToyDiT, TwoStackDiT, assert_same, clone, snapshot

DIM = 16


class FakePinPlatform(CpuPlatform):
    """CPU platform that pretends to pin (so budgets and pin failures can be voted on)."""

    can_pin = True

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail

    def register_host(self, tensor: torch.Tensor) -> bool:
        return not self.fail


def _x(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(2, 3, DIM, generator=g)


def _par(world: int) -> dlo.ParallelConfig:
    return dlo.ParallelConfig(data_parallel_size=world)


def _cfg(**kw: Any) -> dlo.OffloadConfig:
    kw.setdefault("transfer", "allgather")
    kw.setdefault("collective_timeout_s", 20.0)
    return dlo.OffloadConfig(mode="layer", **kw)


def _steps(model: torch.nn.Module, rank: int, n: int) -> list[torch.Tensor]:
    out = []
    for s in range(n):
        ctx = torch.inference_mode() if s % 2 else torch.no_grad()
        with ctx:
            out.append(model(_x(rank, s)).clone())
    return out


# ----------------------------------------------------------------------------- rank bodies
def _parity(
    rank: int, world: int, num_blocks: int, chunk_mb: int, resident: int, transfer: str
) -> dict[str, Any]:
    model = TwoStackDiT(num_blocks, num_blocks2=2) if num_blocks % 2 else ToyDiT(num_blocks)
    ref = _steps(clone(model), rank, 4)
    before = snapshot(model)
    backend = LayerwiseBackend(
        _cfg(chunk_mb=chunk_mb, resident_layers=resident, transfer=transfer),
        _par(world),
        CpuPlatform(),
    )
    backend.enable(model)
    got = _steps(model, rank, 4)
    st = backend.stats()
    same = all(torch.equal(a, b) for a, b in zip(ref, got))
    manifest_digest = None
    assert backend._blocks
    from dlo.plan.layout import build_manifest

    manifest_digest = build_manifest([b.layout for b in backend._blocks]).digest
    shard_sum = sum(b.layout.shard_nbytes for b in backend._blocks)
    padded_sum = sum(b.layout.padded_nbytes for b in backend._blocks)
    backend.disable()
    restored = True
    if transfer == "rank-local" or world == 1:
        assert_same(before, model)
    else:
        restored = all(p.numel() == 0 for b in model.blocks for p in b.parameters())
    return {
        "same": same,
        "stats": st,
        "digest": manifest_digest,
        "shard_sum": shard_sum,
        "padded_sum": padded_sum,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
        "restored": restored,
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_allgather_parity_and_per_rank_bytes(world: int) -> None:
    res = assert_all_ok(run_ranks(_parity, world, 5, 1, 0, "allgather", timeout_s=120))
    assert all(r["same"] for r in res)
    assert len({r["digest"] for r in res}) == 1
    for rank, r in enumerate(res):
        st = r["stats"]
        assert st["group_size"] == world and st["group_rank"] == rank
        assert st["transfer"] == ("allgather" if world > 1 else "rank-local") or world == 1
        # exactly this rank's slices: padded blocks / world
        assert st["host_nbytes"] == r["shard_sum"] and r["shard_sum"] * world == r["padded_sum"]
        assert st["allgather_nbytes"] > 0 if world > 1 else st["allgather_nbytes"] == 0
        assert r["ledger"] == (0, 0)
        assert r["restored"]


@pytest.mark.parametrize("world", [2, 3])
def test_allgather_small_chunks_resident_and_even_blocks(world: int) -> None:
    res = assert_all_ok(run_ranks(_parity, world, 4, 1, 2, "allgather", timeout_s=120))
    assert all(r["same"] for r in res)
    assert all(r["stats"]["num_resident_blocks"] == 2 for r in res)


def test_rank_local_mode_world_2_no_collectives() -> None:
    res = assert_all_ok(run_ranks(_parity, 2, 3, 64, 1, "rank-local", timeout_s=120))
    for r in res:
        assert r["same"] and r["stats"]["allgather_nbytes"] == 0
        assert r["stats"]["group_size"] == 1


def _refused_enable(
    model: torch.nn.Module, cfg: dlo.OffloadConfig, world: int
) -> tuple[LayerwiseBackend, dlo.OffloadError | None]:
    """Enable where the agreement should refuse; a refusal must leave nothing behind."""
    backend = LayerwiseBackend(cfg, _par(world), CpuPlatform())
    before = snapshot(model)
    try:
        backend.enable(model)
    except dlo.OffloadError as e:
        assert_same(before, model)
        assert LEDGER.host_nbytes == 0
        return backend, e
    return backend, None


def _different_model(rank: int, world: int) -> str:
    model = ToyDiT(3 if rank != 1 else 4)
    backend, e = _refused_enable(model, _cfg(), world)
    if e is None:
        return "enabled"
    try:
        backend.enable(model)
    except dlo.BackendPoisonedError as e2:
        return f"{e} || {e2}"
    return "re-enable allowed"


def test_rank_with_different_model_fails_everywhere_same_error() -> None:
    outs = assert_all_ok(run_ranks(_different_model, 3, timeout_s=120))
    msgs = [o.split("||")[0].split("]", 1)[1] for o in outs]
    assert len(set(msgs)) == 1, msgs
    assert "different block manifests" in msgs[0] and "[[0, 2], [1]]" in msgs[0]
    assert all("recreate the worker" in o for o in outs)


def _different_settings(rank: int, world: int) -> str:
    # a symmetric buffer of another size, a lock-step check the peer does not run: caught at
    # the agreement, before any weight collective
    cfg = _cfg(num_slots=3 if rank == 1 else 2, verify_block_sequence=rank != 2)
    _, e = _refused_enable(ToyDiT(3), cfg, world)
    return "enabled" if e is None else str(e).split("]", 1)[1]


def test_ranks_with_different_settings_fail_everywhere_naming_them() -> None:
    msgs = assert_all_ok(run_ranks(_different_settings, 3, timeout_s=120))
    assert len(set(msgs)) == 1, msgs
    assert "different settings" in msgs[0]
    assert "num_slots: rank 0=2, rank 1=3, rank 2=2" in msgs[0]
    assert "verify_block_sequence: rank 0=True, rank 1=True, rank 2=False" in msgs[0]
    assert "chunk_mb" not in msgs[0]


def _different_resident(rank: int, world: int) -> str:
    # resident blocks are gathered once at enable: a rank keeping one resident while its peer
    # streams it would issue a gather the peer never joins (or compute with the wrong weights
    # without the lock-step check); the manifest digest does not see it
    cfg = _cfg(resident_layers=1 if rank == 0 else 0, verify_block_sequence=False)
    _, e = _refused_enable(ToyDiT(3), cfg, world)
    return "enabled" if e is None else str(e).split("]", 1)[1]


def test_ranks_with_different_resident_layers_fail_at_the_agreement() -> None:
    msgs = assert_all_ok(run_ranks(_different_resident, 2, timeout_s=120))
    assert len(set(msgs)) == 1, msgs
    assert "different settings" in msgs[0]
    assert "resident_layers: rank 0='blocks=1', rank 1='blocks=0'" in msgs[0]


def _pin_vote(rank: int, world: int, case: str) -> str:
    model = ToyDiT(3)
    before = snapshot(model)
    if case == "fail_one":
        platform: CpuPlatform = FakePinPlatform(fail=rank == 1)
        cfg = _cfg()
    elif case == "budget_one":
        platform = FakePinPlatform()
        cfg = _cfg(pin_budget_gb=1e-9 if rank == 0 else None)
    else:  # fallback
        platform = FakePinPlatform(fail=rank == 1)
        cfg = _cfg(pin_failure_policy="whole_block_fallback")
    backend = LayerwiseBackend(cfg, _par(world), platform)
    try:
        backend.enable(model)
    except dlo.OffloadError as e:
        assert_same(before, model)
        assert LEDGER.host_nbytes == 0 and LEDGER.pinned_nbytes == 0
        return "error: " + str(e).split("]", 1)[1]
    ok = all(
        torch.equal(a, b) for a, b in zip(_steps(clone(ToyDiT(3)), rank, 2), _steps(model, rank, 2))
    )
    st = backend.stats()
    backend.disable()
    return (
        f"enabled same={ok} pageable={len(st['pageable_blocks'])} pinned={st['host_pinned_nbytes']}"
    )


def test_pin_failure_on_one_rank_is_a_group_vote() -> None:
    outs = assert_all_ok(run_ranks(_pin_vote, 2, "fail_one", timeout_s=120))
    assert all(o.startswith("error") for o in outs) and len(set(outs)) == 1
    assert "rank(s) [1]" in outs[0]


def test_pin_budget_exceeded_on_one_rank_is_a_group_vote() -> None:
    outs = assert_all_ok(run_ranks(_pin_vote, 2, "budget_one", timeout_s=120))
    assert all(o.startswith("error") for o in outs) and len(set(outs)) == 1
    assert "pin_budget_gb" in outs[0] and "rank(s) [0]" in outs[0]


def test_whole_block_fallback_is_taken_by_every_rank() -> None:
    outs = assert_all_ok(run_ranks(_pin_vote, 2, "fallback", timeout_s=120))
    # rank 1 could pin nothing: every rank keeps all blocks pageable (pinned=0 everywhere)
    assert all(o == "enabled same=True pageable=3 pinned=0" for o in outs), outs


def _missing_peer(rank: int, world: int) -> str:
    if rank == 1:
        return "skipped enable"
    model = ToyDiT(2)
    backend = LayerwiseBackend(_cfg(collective_timeout_s=3.0), _par(world), CpuPlatform())
    try:
        backend.enable(model)
    except dlo.OffloadError as e:
        return str(e)
    return "enabled"


def test_rank_that_never_enables_is_named_within_the_timeout() -> None:
    outs = assert_all_ok(run_ranks(_missing_peer, 2, timeout_s=60))
    assert "rank(s) [1] never reached enable" in outs[0]


def _local_failure(rank: int, world: int, point: str) -> str:
    model = ToyDiT(3)
    before = snapshot(model)
    backend = LayerwiseBackend(_cfg(), _par(world), CpuPlatform())
    try:
        if rank == world - 1:
            with faults.inject(point):
                backend.enable(model)
        else:
            backend.enable(model)
    except dlo.OffloadError as e:
        assert_same(before, model)
        assert LEDGER.host_nbytes == 0
        return "error: " + str(e).split("]", 1)[1]
    return "enabled"


@pytest.mark.parametrize(
    "point", ["manifest_build", "host_allocation", "host_fill", "slot_allocation"]
)
def test_local_failure_before_agreement_fails_every_rank(point: str) -> None:
    outs = assert_all_ok(run_ranks(_local_failure, 3, point, timeout_s=120))
    assert all(o.startswith("error") for o in outs) and len(set(outs)) == 1
    assert "rank(s) [2]" in outs[0] and point in outs[0]


def _exception_everywhere(rank: int, world: int) -> bool:
    model = ToyDiT(5)
    ref = _steps(clone(model), rank, 3)
    backend = LayerwiseBackend(_cfg(), _par(world), CpuPlatform())
    backend.enable(model)
    err = RuntimeError(f"bug on {rank}")

    def boom(module: torch.nn.Module, args: tuple) -> None:
        raise err

    h = model.blocks[2].register_forward_pre_hook(boom)
    try:
        with torch.no_grad():
            model(_x(rank, 0))
    except RuntimeError as e:
        assert e is err
    h.remove()
    ok = all(torch.equal(a, b) for a, b in zip(ref, _steps(model, rank, 3)))
    backend.disable()
    return ok


def test_same_exception_on_every_rank_keeps_group_aligned() -> None:
    assert all(assert_all_ok(run_ranks(_exception_everywhere, 2, timeout_s=120)))


def _diverge(rank: int, world: int) -> str:
    model = ToyDiT(5)
    backend = LayerwiseBackend(_cfg(num_slots=1), _par(world), CpuPlatform())
    backend.enable(model)
    if rank == 1:
        model.skip = {2}  # rank-dependent branch: rank 1 skips block 2
    try:
        with torch.no_grad():
            model(_x(rank, 0))
    except dlo.OffloadError as e:
        backend.disable()
        try:
            backend.enable(ToyDiT(5))
        except dlo.BackendPoisonedError as e2:
            return f"{e} || {e2}"
        return f"{e} || re-enable allowed"
    return "no error"


def test_diverging_block_sequence_is_reported_naming_the_block() -> None:
    outs = assert_all_ok(run_ranks(_diverge, 2, timeout_s=60))
    for o in outs:
        assert "different blocks" in o, outs
        assert "blocks.2" in o and "blocks.3" in o
        assert "recreate the worker" in o.split("||")[1]  # the backend is poisoned


def _reenable_after_allgather(rank: int, world: int, mode: str) -> str:
    model = ToyDiT(3)
    backend = LayerwiseBackend(_cfg(), _par(world), CpuPlatform())
    backend.enable(model)
    backend.disable()
    fresh = dlo.get_offload_backend(dlo.OffloadConfig(mode=mode), _par(world), "cpu")
    assert fresh is not None
    try:
        fresh.enable(model)
    except dlo.OffloadError as e:
        assert not fresh.is_enabled()
        return str(e)
    return "enabled"


@pytest.mark.parametrize("mode", ["layer", "module"])
def test_enable_after_allgather_disable_refuses_the_released_model(mode: str) -> None:
    outs = assert_all_ok(run_ranks(_reenable_after_allgather, 2, mode, timeout_s=60))
    assert all("lost their weights" in o and "reload the model" in o for o in outs), outs


def _copy_engine_on_cpu(rank: int, world: int) -> str:
    model = ToyDiT(3)
    before = snapshot(model)
    backend = LayerwiseBackend(_cfg(gather_engine="copy"), _par(world), CpuPlatform())
    try:
        backend.enable(model)
    except ValueError as e:
        assert_same(before, model)
        assert LEDGER.host_nbytes == 0 and not backend.is_enabled()
        return str(e)
    return "enabled"


def test_copy_engine_gather_refused_on_cpu_naming_the_field() -> None:
    for o in assert_all_ok(run_ranks(_copy_engine_on_cpu, 2, timeout_s=60)):
        assert "gather_engine='copy'" in o and "cpu" in o


def _slot_mismatch(rank: int, world: int) -> str:
    import torch.distributed as dist

    from dlo.runtime.sequence import SequenceCheck

    check = SequenceCheck(CpuPlatform(), dist.group.WORLD, rank, world, ["a", "b"])
    try:
        check.issue(1, None, slot=rank)  # same block, a different slot on each rank
    except dlo.OffloadError as e:
        return str(e)
    return "no error"


def test_lock_step_check_compares_slots() -> None:
    for o in assert_all_ok(run_ranks(_slot_mismatch, 2, timeout_s=60)):
        assert "different blocks or slots" in o and "b (slot 0)" in o and "b (slot 1)" in o


def _order_mismatch(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from dlo.runtime.sequence import SequenceCheck

    check = SequenceCheck(CpuPlatform(), dist.group.WORLD, rank, world, ["a", "b"])
    out = []
    check.agree(7, None, "a, b (2 blocks)")  # the same digest: nothing to say
    out.append("agreed")
    try:
        check.agree(100 + rank, None, f"order {rank} (2 blocks)")
    except dlo.OffloadError as e:
        out.append(str(e))
    return out


def test_a_learned_order_that_differs_across_ranks_is_reported_naming_it() -> None:
    """[Note: prefetch chain]: the learned order's digest is compared once."""
    for rank, o in enumerate(assert_all_ok(run_ranks(_order_mismatch, 2, timeout_s=60))):
        assert o[0] == "agreed" and len(o) == 2, o
        assert "ran a component's blocks in different orders" in o[1]
        assert f"which ran order {rank} (2 blocks)" in o[1] and f"ranks [{1 - rank}]" in o[1]


def _auto_engine_on_cpu(rank: int, world: int) -> dict[str, Any]:
    model = ToyDiT(4)
    ref = _steps(clone(model), rank, 3)
    backend = LayerwiseBackend(_cfg(gather_engine="auto"), _par(world), CpuPlatform())
    backend.enable(model)
    got = _steps(model, rank, 3)
    st = backend.stats()
    backend.disable()
    return {"same": all(torch.equal(a, b) for a, b in zip(ref, got)), "engine": st["gather_engine"]}


def test_auto_gather_engine_on_cpu_is_nccl_path_and_bitwise() -> None:
    for r in assert_all_ok(run_ranks(_auto_engine_on_cpu, 2, timeout_s=90)):
        assert r == {"same": True, "engine": "nccl"}


def _interrupted_load(rank: int, world: int) -> list[str]:
    import dlo.runtime.transport as transport

    model = ToyDiT(4)
    cfg = _cfg(num_slots=3, collective_timeout_s=5.0)
    backend = LayerwiseBackend(cfg, _par(world), CpuPlatform())
    backend.enable(model)
    real, calls = transport.all_gather_into, [0]

    def gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
        real(out, inp, group)
        calls[0] += 1
        if rank == 0 and calls[0] == 3:
            raise KeyboardInterrupt  # Ctrl-C lands inside dlo's loading, mid-prefetch

    transport.all_gather_into = gather  # type: ignore[assignment]
    inputs = [torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    log = forward_outcomes(model, inputs)
    backend.disable()
    return log


def test_interrupt_inside_a_gathering_load_poisons_the_backend() -> None:
    # the interrupted rank left the group's collective sequence midway: its next forward must
    # be refused clearly (it crashed gloo with mismatched sizes before), and its peer ends in
    # an error within the bound, never a wrong result or a hang
    r0, r1 = assert_all_ok(run_ranks(_interrupted_load, 2, timeout_s=90))
    assert r0[0] == "interrupted", r0
    assert r0[1].startswith("BackendPoisonedError") and "recreate the worker" in r0[1], r0
    assert "ok" not in r1[1:] and r1[-1].startswith(("OffloadError", "BackendPoisonedError")), r1


def _encoder_gathers_only(rank: int, world: int) -> dict[str, Any]:
    from tests.toys import ToyPipeline

    pipe = ToyPipeline()
    cfg = dlo.OffloadConfig(
        mode="layer",
        components=("dit", "encoder"),
        transfer="rank-local",
        layer_options={"encoder": {"weight_transfer": "allgather"}},
        collective_timeout_s=20.0,
    )
    backend = LayerwiseBackend(cfg, _par(world), CpuPlatform())
    backend.enable(pipe)
    with torch.no_grad():
        pipe(torch.randn(2, 3, 16))
    st = backend.stats()
    backend.disable()
    return {k: st[k] for k in ("transfer", "group_size", "group_rank")}


def test_stats_group_is_the_gathering_stacks() -> None:
    # the DiT streams rank-local, the encoder gathers: "transfer" says allgather, so the group
    # reported beside it is the encoder's (it said size 1, rank 0 on both ranks before)
    res = assert_all_ok(run_ranks(_encoder_gathers_only, 2, timeout_s=90))
    assert res == [
        {"transfer": "allgather", "group_size": 2, "group_rank": 0},
        {"transfer": "allgather", "group_size": 2, "group_rank": 1},
    ]


@pytest.mark.parametrize("policy", ["fail", "whole_block_fallback"])
def test_resident_blocks_take_no_pin_budget(policy: str) -> None:
    # a resident block crosses the link once, at enable: a budget of exactly the streamed
    # blocks pins all of them (the resident block took one block's share before)
    model = ToyDiT(5)
    probe = LayerwiseBackend(dlo.OffloadConfig(mode="layer"), _par(1), CpuPlatform())
    probe.enable(ToyDiT(5))
    block_nbytes = probe.stats()["host_nbytes"] // 5
    probe.disable()
    cfg = dlo.OffloadConfig(
        mode="layer",
        resident_layers=1,
        pin_budget_gb=4 * block_nbytes / (1 << 30),
        pin_failure_policy=policy,
    )
    backend = LayerwiseBackend(cfg, _par(1), FakePinPlatform())
    backend.enable(model)
    st = backend.stats()
    assert st["num_resident_blocks"] == 1
    assert st["host_pinned_nbytes"] == 4 * block_nbytes
    assert st["pageable_blocks"] == []  # no streamed block left pageable
    backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
