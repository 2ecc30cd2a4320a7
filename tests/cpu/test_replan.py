"""Re-plans between forwards on the CPU ([Note: re-plan between forwards] in dlo.plan.replan):
blocks pinned into measured room and unpinned before a larger input, bitwise against the
resident model; a forward that cannot fit refused before any block runs; the ranks that gather
together take one plan. The allocator is :class:`tests.fake_memory.FakeMemory`, with the
planner's margins set to zero so its arithmetic is exact."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.commands.pipeline_calls import resident_reference
from dlo.errors import ForwardRefused, OffloadError
from dlo.host.region import LEDGER
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder
from dlo.plan import replan
from tests.cpu.test_compile import Counter, _compile
from tests.cpu.test_streamed_writes import _CachingDiT as CachingDiT
from tests.cpu.test_streamed_writes import _x as caching_input
from tests.fake_memory import FakeMemory, x
from tests.harness import assert_all_ok, run_ranks
from tests.toys import ToyDiT, ToyPipeline, TwoStackDiT, clone

FIXED = 1 << 20
PER_ELEMENT = 64
BLOCK = 2816  # padded bytes of a ToyDiT block of width 16 (read from the layout below)


def _exact() -> dict[str, float]:
    return {"REPLAN_MARGIN": 0.0, "REPLAN_MARGIN_MIN": 0, "INPUT_RESERVE": 0.0, "HYSTERESIS": 0.0}


@pytest.fixture
def exact(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in _exact().items():
        monkeypatch.setattr(replan, k, v)


def _limit(batch: int, room: int, dim: int = 16) -> int:
    """The limit that leaves ``room`` movable bytes before a forward of ``batch`` rows."""
    return FIXED + PER_ELEMENT * batch * dim + room


def _fake(monkeypatch: pytest.MonkeyPatch, limit: int) -> FakeMemory:
    fake = FakeMemory(limit=limit, fixed=FIXED, per_element=PER_ELEMENT)
    fake.install(monkeypatch)
    return fake


@contextlib.contextmanager
def _enabled(model: Any, cfg: dlo.OffloadConfig, fake: FakeMemory) -> Iterator[Any]:
    """``model`` enabled with ``cfg`` on the CPU under ``fake``'s allocator; disabled after,
    nothing left in host memory."""
    backend = dlo.enable_offload(model, cfg, device="cpu")
    fake.backend = backend
    try:
        yield backend
    finally:
        backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def _run(model: Any, ref: Any, inp: torch.Tensor) -> None:
    with torch.inference_mode():
        assert torch.equal(model(inp), ref(inp))


def _stats(backend: Any) -> tuple[int, int, int, int]:
    s = backend.stats()
    return s["num_pinned_blocks"], s["num_slots"], s["device_slot_nbytes"], s["num_loads"]


def test_blocks_are_pinned_into_room_and_unpinned_before_a_larger_input(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    fake = _fake(monkeypatch, _limit(2, 8 * BLOCK))
    model = ToyDiT(8)
    ref = clone(model)
    fake.watch(list(model.blocks))
    with _enabled(model, dlo.OffloadConfig(), fake) as backend:
        assert backend._state.pool.slot_nbytes == BLOCK
        _run(model, ref, x(2, seed=0))  # measured; nothing changes inside the first forward
        assert _stats(backend)[:2] == (0, 2)
        _run(model, ref, x(2, seed=1))  # every block fits: pinned, and no slot is left
        pinned, slots, slot_nbytes, loads = _stats(backend)
        assert (pinned, slots, slot_nbytes) == (8, 0, 0)
        _run(model, ref, x(2, seed=2))
        assert _stats(backend)[3] == loads  # a pinned block loads nothing
        # 10 more rows need 10 * 16 * 64 bytes more: the room left holds p blocks + 2 slots
        _run(model, ref, x(12, seed=3))
        pinned, slots, slot_nbytes, loads = _stats(backend)
        room = fake.limit - FIXED - PER_ELEMENT * 12 * 16
        assert pinned == room // BLOCK - 2 and slots == 2 and slot_nbytes == 2 * BLOCK
        assert 0 < pinned < 8
        _run(model, ref, x(12, seed=4))
        assert _stats(backend)[3] - loads == 8 - pinned  # only the streamed blocks load
        # a smaller input again: the larger forward's growth is kept, nothing is pinned back
        _run(model, ref, x(2, seed=5))
        assert _stats(backend)[0] == pinned
        records = backend.stats()["policy"]["replans"]
        assert [r["action"] for r in records] == ["pin", "unpin"]
        assert records[0]["ms"] >= 0  # the time to apply it (its pins' loads issued)
        assert records[0] | {"movable_room_nbytes": 0, "ms": 0} == {
            "component": "",
            "forward": 2,
            "elements": 32,
            "pinned": 8,
            "streamed": 0,
            "num_slots": 0,
            "slot_nbytes": 0,
            "movable_room_nbytes": 0,
            "limit_nbytes": fake.limit,
            "action": "pin",
            "ms": 0,
        }
        assert records[1]["elements"] == 12 * 16 and records[1]["pinned"] == pinned
    _run(model, ref, x(3, seed=6))  # the model is whole again


def test_a_forward_that_cannot_fit_is_refused_before_any_block_runs(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    fake = _fake(monkeypatch, _limit(2, 8 * BLOCK))
    model = ToyDiT(8)
    ref = clone(model)
    ran: list[int] = []
    fake.watch(list(model.blocks))
    for b in model.blocks:
        b.register_forward_pre_hook(lambda m, a: ran.append(1))
    with _enabled(model, dlo.OffloadConfig(), fake) as backend:
        _run(model, ref, x(2, seed=0))
        _run(model, ref, x(2, seed=1))
        assert _stats(backend)[0] == 8
        ran.clear()
        # 2 + 100 rows: 100 * 16 * 64 bytes more than the limit leaves, with one slot; its
        # input and prologue raise the peak before the first block (as on a device)
        fake.peak = max(fake.peak, fake.limit - 1)
        with pytest.raises(ForwardRefused) as e, torch.inference_mode():
            model(x(102))
        assert not ran  # no block ran
        msg = str(e.value)
        assert "blocks.0" in msg and "with every block streamed through the least slots" in msg
        assert "MiB is available" in msg and "smaller input" in msg
        _run(model, ref, x(2, seed=2))  # the ring is sound: the next forward runs
        _run(model, ref, x(2, seed=3))
        # the refused forward's peak is no evidence: the pins stay
        assert _stats(backend)[0] == 8


def test_an_explicit_resident_count_is_never_replanned(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    fake = _fake(monkeypatch, 1 << 40)
    model = ToyDiT(4)
    ref = clone(model)
    with _enabled(model, dlo.OffloadConfig(resident_layers=1), fake) as backend:
        for s in range(3):
            _run(model, ref, x(2, seed=s))
        assert _stats(backend)[:2] == (0, 2) and fake.calls == 0
        assert backend.stats()["policy"] is None


def test_other_rings_keep_the_shared_slots_they_need(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    """Two DiTs and a streamed text encoder share one pool: each DiT pins its blocks, and
    the slots stay, sized for the encoder's blocks."""
    fake = _fake(monkeypatch, 1 << 30)
    pipe = ToyPipeline()
    ref = clone(pipe)
    cfg = dlo.OffloadConfig(components=("dit", "encoder"))
    with _enabled(pipe, cfg, fake) as backend:
        encoder = max(
            b.layout.padded_nbytes for b in backend._state.blocks if b.stack.component == "encoder"
        )
        for s in range(4):
            inp = x(2, seed=s)
            with torch.inference_mode():
                assert torch.equal(pipe(inp, steps=4), ref(inp, steps=4))
        pinned, slots, slot_nbytes, _ = _stats(backend)
        assert pinned == 4 + 3 and slots == 2 and slot_nbytes == 2 * encoder
        rings = {r["component"] for r in backend.stats()["policy"]["replans"]}
        assert rings == {"transformer", "transformer_2"}


def test_writes_of_a_pinned_block_are_kept_as_when_it_streams(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    """A block that writes its own buffer in place: pinned, the write goes back to its host
    copy at exit as when it streams, so unpinning it later loses nothing."""
    fake = _fake(monkeypatch, 1 << 30)
    model = CachingDiT(4)
    ref = clone(model)
    with _enabled(model, dlo.OffloadConfig(), fake) as backend:
        for step in range(6):
            if step == 4:  # unpin everything: the next loads come from the host copies
                fake.limit = FIXED
            with torch.inference_mode():
                assert torch.equal(model(caching_input(step), step), ref(caching_input(step), step))
            if step == 2:
                assert _stats(backend)[0] == 4
        assert _stats(backend)[0] == 0
    for name, t in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replan-folders")


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan2.1"])
def test_default_pipeline_folders_are_bitwise_across_replans(
    monkeypatch: pytest.MonkeyPatch, exact: None, folders: Path, name: str
) -> None:
    """A tiny folder with no settings: pinned after the first step, unpinned before a
    larger call, every call the resident pipeline's bits."""
    folder = folders / name
    save_folder(FOLDERS[name], folder, max_shard_size=40_000)
    ref = resident_reference(str(folder), torch.float32, torch.device("cpu"))
    cfg = dlo.OffloadConfig(mode="layer")
    fake = FakeMemory(limit=0, fixed=FIXED, per_element=4)
    fake.install(monkeypatch)
    pipe, backend = dlo.load_pipeline(folder, cfg, device="cpu", dtype=torch.float32)
    assert backend is not None
    blocks = [b.module for b in backend._state.blocks if b.stack.component == "dit"]
    total = sum(b.layout.padded_nbytes for b in backend._state.blocks if b.module in blocks)
    fake.watch(blocks)
    fake.backend = backend
    call: dict[str, Any] = {**FOLDERS[name].call, "output_type": "pt", "prompt": "a red fox"}
    video = "num_frames" in call
    base = call["height"]
    pipe.set_progress_bar_config(disable=True)
    ref.set_progress_bar_config(disable=True)
    key = "frames" if video else "images"
    try:
        for calls, size in enumerate([base, base, 2 * base]):
            if calls == 0:  # room for every block at the first size, not at twice the size
                fake.limit = FIXED + 10 * total
            c = {**call, "num_inference_steps": 2, "height": size, "width": size}
            a = pipe(**c, generator=torch.Generator().manual_seed(calls))
            b = ref(**c, generator=torch.Generator().manual_seed(calls))
            assert torch.equal(getattr(a, key), getattr(b, key)), calls
        records = backend.stats()["policy"]["replans"]
        assert records and records[0]["action"] == "pin"
    finally:
        backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def _gathering_setup(room: Any) -> tuple[Any, Any, Any]:
    """A rank's ToyDiT(6) under AllGather with exact margins and a fake allocator whose
    limit leaves ``room(padded)`` movable bytes at 2 rows; returns (model, ref, backend)."""
    for k, v in _exact().items():
        setattr(replan, k, v)
    fake = FakeMemory(limit=1, fixed=FIXED, per_element=PER_ELEMENT)
    fake.install()
    model = ToyDiT(6)
    ref = clone(model)
    fake.watch(list(model.blocks))
    backend = dlo.enable_offload(model, dlo.OffloadConfig(transfer="allgather"), device="cpu")
    fake.backend = backend
    fake.limit = _limit(2, room(backend._state.pool.slot_nbytes))  # every block's, padded
    return model, ref, backend


def _gathering_rank(rank: int, world: int, spare: list[int]) -> dict[str, Any]:
    model, ref, backend = _gathering_setup(lambda p: 6 * p + spare[rank])  # all pinned
    padded = backend._state.pool.slot_nbytes
    same = []
    try:
        for s, batch in enumerate([2, 2, 2, 6, 6]):
            inp = x(batch, seed=s)
            with torch.inference_mode():
                same.append(torch.equal(model(inp), ref(inp)))
        stats = backend.stats()
        return {
            "same": same,
            "replans": stats["policy"]["replans"],
            "pinned": stats["num_pinned_blocks"],
            "loads": stats["num_loads"],
            "group_size": stats["group_size"],
            "padded": padded,
        }
    finally:
        backend.disable()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_gather_together_take_one_plan(world: int) -> None:
    """Every rank measures a different limit; the plan is the tightest rank's, on all:
    every block pinned at 2 rows; at 6 rows (4 * 16 * 64 bytes more) the last rank, with
    1000 bytes to spare, must stream some, and so do the others, which had room."""
    spare = [100_000 * (r + 1) for r in range(world)]
    spare[-1] = 1000
    res = assert_all_ok(run_ranks(_gathering_rank, world, spare, timeout_s=180))
    assert all(all(r["same"]) for r in res)
    assert all(r["group_size"] == world for r in res)

    def agreed(records: list[dict]) -> list[dict]:  # the time each rank took is its own
        return [{k: v for k, v in r.items() if k != "ms"} for r in records]

    assert all(agreed(r["replans"]) == agreed(res[0]["replans"]) for r in res)
    assert [r["action"] for r in res[0]["replans"]] == ["pin", "unpin"]
    assert all(r["loads"] == res[0]["loads"] and r["pinned"] == res[0]["pinned"] for r in res)
    p = res[0]["padded"]
    room = 6 * p + 1000 - PER_ELEMENT * 4 * 16
    assert res[0]["pinned"] == room // p - 2 and 0 < res[0]["pinned"] < 6


@pytest.mark.parametrize("form", ["repeated", "whole"])
def test_compiled_blocks_stay_bitwise_and_compile_nothing_new_across_replans(
    monkeypatch: pytest.MonkeyPatch, exact: None, form: str
) -> None:
    """Pinned blocks' own buffers are views like the slots': the compiled blocks run on them
    with the graphs they already have, and give the resident compile's bits."""
    torch._dynamo.reset()
    model = TwoStackDiT(3, num_blocks2=2)
    counter = Counter()
    ref = _compile(clone(model), form, counter)
    inputs = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    with torch.inference_mode():
        want = [ref(t).clone() for t in inputs]
    ref_graphs = counter.graphs
    torch._dynamo.reset()
    counter = Counter()
    fake = _fake(monkeypatch, 1 << 30)  # no activation hooks: they would be compiled too
    with _enabled(model, dlo.OffloadConfig(mode="layer"), fake) as backend:
        fn = _compile(model, form, counter)
        for s, t in enumerate(inputs):
            if s == 4:  # unpin everything
                fake.limit = FIXED
            with torch.inference_mode():
                assert torch.equal(fn(t), want[s]), s
            if s == 2:
                assert _stats(backend)[0] == 5
        assert _stats(backend)[0] == 0
        assert [r["action"] for r in backend.stats()["policy"]["replans"]] == ["pin", "unpin"]
        if form == "repeated":
            assert counter.graphs == ref_graphs


def test_the_blocks_the_policy_keeps_are_pins_a_larger_input_may_unpin(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    """Under a budget enable keeps the leading blocks on the device as pins, not resident
    blocks: a refused forward runs none of them, and a larger input that fits only with
    fewer unpins below what enable kept, bitwise."""
    fake = _fake(monkeypatch, _limit(2, 8 * BLOCK))
    model = ToyDiT(8)
    ref = clone(model)
    fake.watch(list(model.blocks))
    ran: list[str] = []
    for i, b in enumerate(model.blocks):
        b.register_forward_pre_hook(lambda m, a, i=i: ran.append(f"blocks.{i}"))
    budget = 6 * BLOCK / 0.8 / 2**30  # about 3 blocks beside 2 slots and the non-block
    cfg = dlo.OffloadConfig(resident_layers="auto", device_budget_gb=budget)
    with _enabled(model, cfg, fake) as backend:
        kept = backend.stats()["num_pinned_blocks"]
        assert 0 < kept < 8 and backend.stats()["num_resident_blocks"] == 0
        _run(model, ref, x(2, seed=0))
        _run(model, ref, x(2, seed=1))
        assert _stats(backend)[0] == 8  # the streamed ones were pinned too
        ran.clear()
        with pytest.raises(OffloadError, match=r"blocks\.0") as e, torch.inference_mode():
            model(x(102))
        assert ran == [] and "this forward needs about" in str(e.value)
        _run(model, ref, x(2, seed=2))
        # 10 more rows need 10 * 16 * 64 bytes, about 3.6 blocks: fewer pins than enable kept
        _run(model, ref, x(12, seed=3))
        pinned = _stats(backend)[0]
        assert pinned < kept, (pinned, kept)
        _run(model, ref, x(12, seed=4))


def test_a_peak_from_before_enable_is_no_evidence(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    """A peak no forward reaches (the whole model once on the device): growth is only a
    bound, so nothing is pinned, and the ring keeps enable's slots (no fall to one slot)."""
    fake = _fake(monkeypatch, _limit(2, 8 * BLOCK))
    fake.peak = fake.limit - 100  # before enable
    model = ToyDiT(8)
    ref = clone(model)
    fake.watch(list(model.blocks))
    with _enabled(model, dlo.OffloadConfig(), fake) as backend:
        for s in range(4):
            _run(model, ref, x(2, seed=s))
        assert _stats(backend)[:3] == (0, 2, 2 * BLOCK)
        assert backend.stats()["policy"] is None  # no re-plan changed anything


@pytest.mark.parametrize("when", ["before", "after"])
def test_compiling_the_dit_itself_keeps_the_blocks_hooks(
    monkeypatch: pytest.MonkeyPatch, exact: None, when: str
) -> None:
    """``dit.compile()`` (a module above the hooked blocks): the re-planner puts no hook on
    the DiT, so its blocks' hooks still run inside the compiled call, pinned or not."""
    fake = _fake(monkeypatch, 1 << 30)
    torch._dynamo.reset()
    model = ToyDiT(4)
    ref = clone(model)
    if when == "before":
        model.compile(backend="aot_eager")
    with _enabled(model, dlo.OffloadConfig(), fake) as backend:
        if when == "after":
            model.compile(backend="aot_eager")
        for s in range(4):
            _run(model, ref, x(2, seed=s))
        assert _stats(backend)[0] == 4


def _refusing_rank(rank: int, world: int, fail_rank: int) -> dict[str, Any]:
    model, ref, backend = _gathering_setup(lambda p: 6 * p)
    if rank == fail_rank:  # this rank cannot allocate its pins, once
        from dlo.runtime.replan import Replanner

        real = Replanner._allocate
        calls: list[int] = []

        def failing(self: Any, new: Any) -> None:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected: out of memory")
            real(self, new)

        Replanner._allocate = failing  # type: ignore[method-assign]
    same, refused = [], []
    try:
        for s, batch in enumerate([2, 2, 200, 2, 2]):
            inp = x(batch, seed=s)
            try:
                with torch.inference_mode():
                    same.append(torch.equal(model(inp), ref(inp)))
            except ForwardRefused:
                refused.append(s)
        st = backend.stats()
        return {"same": same, "refused": refused, "pinned": st["num_pinned_blocks"]}
    finally:
        backend.disable()


@pytest.mark.parametrize("fail_rank", [-1, 1])
def test_a_gathering_group_refuses_together_and_falls_back_together(fail_rank: int) -> None:
    """AllGather at world 2: a forward too large for the tightest rank is refused on both,
    and the backend is not poisoned (the next forwards run); a rank that cannot allocate a
    plan takes both ranks back to enable's plan, with no hang and the same bits."""
    res = assert_all_ok(run_ranks(_refusing_rank, 2, fail_rank, timeout_s=120))
    # after a fallback nothing is re-planned any more, refusals included
    refused = [2] if fail_rank < 0 else []
    assert all(r["refused"] == refused for r in res)
    assert all(all(r["same"]) and len(r["same"]) == 5 - len(refused) for r in res)
    assert {r["pinned"] for r in res} == ({6} if fail_rank < 0 else {0})


def test_encoded_blocks_are_pinned_decoded(monkeypatch: pytest.MonkeyPatch, exact: None) -> None:
    """With the codec, a pinned block is decoded once into its own buffer."""
    fake = _fake(monkeypatch, 1 << 30)
    model = ToyDiT(4)
    ref = clone(model)
    with _enabled(model, dlo.OffloadConfig(codec="ans"), fake) as backend:
        for s in range(3):
            _run(model, ref, x(2, seed=s))
        st = backend.stats()
        assert st["num_pinned_blocks"] == 4 and st["codec"] == "ans"
        decoded = st["decoded_nbytes"]
        _run(model, ref, x(2, seed=3))
        assert backend.stats()["decoded_nbytes"] == decoded  # nothing decoded per forward


def test_a_first_forward_that_raised_teaches_nothing(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    """The last block is learned from a first forward that completed, not from one that
    raised halfway (its sample would miss the rest of the forward's activations)."""
    fake = _fake(monkeypatch, 1 << 30)
    model = ToyDiT(8)
    ref = clone(model)
    fake.watch(list(model.blocks))
    armed = [True]

    def fail_once(m: Any, a: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError("injected: a user error inside block 5")

    model.blocks[5].register_forward_pre_hook(fail_once)
    with _enabled(model, dlo.OffloadConfig(), fake) as backend:
        with pytest.raises(RuntimeError, match="injected"), torch.inference_mode():
            model(x(2))
        for s in range(3):
            _run(model, ref, x(2, seed=s))
        (ring,) = backend._state.scheduler.rings
        assert (ring.replanner.first, ring.replanner.last) == ("blocks.0", "blocks.7")
        assert _stats(backend)[0] == 8


def test_a_lower_limit_unpins_once_without_ratcheting(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    """The limit drops by three blocks (another process took memory): the plan unpins what
    it must once and stays; the old peak (reached with more pinned) is no new evidence."""
    fake = _fake(monkeypatch, _limit(2, 16 * BLOCK))
    model = ToyDiT(16)
    ref = clone(model)
    fake.watch(list(model.blocks))
    with _enabled(model, dlo.OffloadConfig(), fake) as backend:
        for s in range(3):
            _run(model, ref, x(2, seed=s))
        assert _stats(backend)[0] == 16
        fake.limit -= 3 * BLOCK
        pinned = []
        for s in range(3, 8):
            _run(model, ref, x(2, seed=s))
            pinned.append(_stats(backend)[0])
        assert 0 < pinned[0] < 16 and pinned == [pinned[0]] * 5, pinned


@pytest.mark.parametrize("given", [{"num_slots": 4}, {"pin_budget_gb": 1.0}])
def test_where_pins_cannot_work_the_policys_blocks_stay_resident(
    monkeypatch: pytest.MonkeyPatch, exact: None, given: dict[str, Any]
) -> None:
    """With num_slots given the slots cannot follow pins (the pool is sized as if every
    block streamed), and under a host pin budget the kept blocks would take it: the blocks
    the policy keeps stay resident, and the device holds no more than the policy planned."""
    fake = _fake(monkeypatch, _limit(2, 12 * BLOCK))
    model = ToyDiT(8)
    ref = clone(model)
    fake.watch(list(model.blocks))
    cfg = dlo.OffloadConfig(device_budget_gb=12 * BLOCK / 0.8 / 2**30, **given)
    with _enabled(model, cfg, fake) as backend:
        st = backend.stats()
        assert st["num_resident_blocks"] > 0 and st["num_pinned_blocks"] == 0
        held = st["device_slot_nbytes"] + st["device_resident_block_nbytes"]
        assert held <= st["policy"]["capacity_nbytes"]
        _run(model, ref, x(2, seed=0))
        _run(model, ref, x(2, seed=1))


def _sixteen_blocks_tight_room(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[FakeMemory, ToyDiT, ToyDiT, dlo.OffloadConfig]:
    """16 blocks, a budget whose usable room is 6 blocks (slots included) at enable, and a
    measured room of 8 blocks."""
    fake = _fake(monkeypatch, _limit(2, 8 * BLOCK))
    model = ToyDiT(16)
    ref = clone(model)
    fake.watch(list(model.blocks))
    return fake, model, ref, dlo.OffloadConfig(device_budget_gb=6 * BLOCK / 0.8 / 2**30)


def test_pins_are_spread_from_enable_and_a_growing_replan_loads_only_new_ones(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    """enable pins the policy's kept count where a re-plan would pin them (spread over the
    ring, block 0 pinned first), so the first re-plan that pins more keeps every pin and
    loads only the new ones (H200, 2026-12-06: leading pins at enable made the first re-plan
    reload 13 of 26 pins, a 181 ms stall in the first step)."""
    fake, model, ref, cfg = _sixteen_blocks_tight_room(monkeypatch)

    def pinned(backend: Any) -> set[int]:
        ring = backend._state.scheduler.rings[0]
        return {i for i, b in enumerate(ring.blocks) if b.own is not None}

    with _enabled(model, cfg, fake) as backend:
        at_enable = pinned(backend)
        assert 0 < len(at_enable) < 8 and 0 in at_enable  # it runs in every forward
        # spread: no two streamed blocks further apart than the pins allow
        assert max(at_enable) > 16 // 2 and min(at_enable) < 16 // 2
        _run(model, ref, x(2, seed=0))
        loads = _stats(backend)[3]
        _run(model, ref, x(2, seed=1))  # the re-plan pins more into the measured room
        after = pinned(backend)
        assert at_enable < after, (at_enable, after)
        new_pins = len(after) - len(at_enable)
        assert _stats(backend)[3] - loads == new_pins + (16 - len(after))
        assert replan.streaming_order([replan.Block(str(i), 1) for i in range(16)])[-1] == 0


def test_a_forward_that_runs_only_the_first_block_loads_nothing(
    monkeypatch: pytest.MonkeyPatch, exact: None
) -> None:
    """A step cache's skipped step runs the ring's first block and skips the rest: with that
    block pinned first, such a forward loads nothing but prefetches it then wastes (before
    2026-12-07 the first block streamed first: loaded once here, then kept in a slot)."""
    fake, model, ref, cfg = _sixteen_blocks_tight_room(monkeypatch)
    with _enabled(model, cfg, fake) as backend:
        for seed in range(2):  # a full forward, then the re-plan's
            _run(model, ref, x(2, seed=seed))
        ring = backend._state.scheduler.rings[0]
        streamed = [b for b in ring.blocks if b.own is None]
        assert streamed and ring.blocks[0].own is not None
        model.skip = ref.skip = set(range(1, 16))  # the cache's decision: skip the rest
        before = backend.stats()
        for seed in range(2, 6):
            _run(model, ref, x(2, seed=seed))
        after = backend.stats()
        loads = after["num_loads"] - before["num_loads"]
        wasted = after["num_wasted_loads"] - before["num_wasted_loads"]
        assert loads == wasted <= 4, (loads, wasted)  # only prefetches the skip made useless
