"""The single-rank ring on the CPU platform: parity, identity, rollback, failure paths."""

from __future__ import annotations

import gc
import weakref
from typing import ClassVar

import pytest
import torch

import dlo
from dlo import faults
from dlo.errors import InjectedFault, OffloadError
from dlo.hooks.registry import HookRegistry
from dlo.host.region import LEDGER
from tests.toys import ToyDiT, ToyPipeline, TwoStackDiT, assert_same, clone, snapshot


def _x(seed: int = 0, dim: int = 16) -> torch.Tensor:
    return torch.randn(2, 5, dim, generator=torch.Generator().manual_seed(seed))


def _run(model: torch.nn.Module, steps: int = 3, *, mode: str = "no_grad") -> list[torch.Tensor]:
    outs = []
    for s in range(steps):
        ctx = (
            torch.inference_mode()
            if (mode == "inference" or (mode == "alt" and s % 2))
            else torch.no_grad()
        )
        with ctx:
            outs.append(model(_x(s)).clone())
    return outs


def _enable(model: torch.nn.Module, **kw: object) -> dlo.OffloadBackend:
    cfg = dlo.OffloadConfig(mode="layer", **kw)  # type: ignore[arg-type]
    backend = dlo.enable_offload(model, cfg, device="cpu")
    assert backend is not None
    return backend


def _no_dlo_hooks(model: torch.nn.Module) -> bool:
    return all(not HookRegistry.owners_on(m) for m in model.modules())


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_parity_identity_and_restore(num_blocks: int, num_slots: int) -> None:
    model = ToyDiT(num_blocks)
    ref = _run(clone(model), 4, mode="alt")
    before = snapshot(model)
    backend = _enable(model, num_slots=num_slots)
    assert LEDGER.host_nbytes > 0
    out = _run(model, 4, mode="alt")
    for a, b in zip(ref, out):
        assert torch.equal(a, b)
    st = backend.stats()
    # never more slots than streamed blocks (issue 26 item 6)
    assert st["num_streamed_blocks"] == num_blocks and st["num_slots"] == min(num_slots, num_blocks)
    assert st["group_size"] == 1 and st["transfer"] == "rank-local"
    assert st["h2d_nbytes"] > 0 and st["allgather_nbytes"] == 0
    assert st["host_pinned_nbytes"] == 0  # CPU platform never pins
    backend.disable()
    backend.disable()
    assert_same(before, model)
    assert LEDGER.host_nbytes == 0 and LEDGER.pinned_nbytes == 0
    assert _no_dlo_hooks(model)
    for a, b in zip(ref, _run(model, 4, mode="alt")):
        assert torch.equal(a, b)


def test_num_slots_beyond_the_streamed_blocks_allocates_one_slot_per_block() -> None:
    model = ToyDiT(3)
    ref = _run(clone(model), 2)
    backend = _enable(model, num_slots=1000, resident_layers=1)
    assert backend.config.num_slots == 1000  # what was asked stays what the config says
    pool = backend._state.pool  # type: ignore[attr-defined]
    assert pool is not None and len(pool.slots) == 2 == backend.stats()["num_slots"]
    for a, b in zip(ref, _run(model, 2)):
        assert torch.equal(a, b)
    backend.disable()


def test_two_containers_resident_and_skipped_blocks() -> None:
    model = TwoStackDiT(5, num_blocks2=3)
    ref_model = clone(model)
    backend = _enable(model, resident_layers=2, num_slots=2)
    st = backend.stats()
    assert st["num_resident_blocks"] == 2 and st["num_streamed_blocks"] == 6
    for skip in ({3}, {2, 4}, set(), {4}):  # producer of a block skipped, last block skipped
        model.skip = ref_model.skip = skip
        for a, b in zip(_run(ref_model, 2), _run(model, 2)):
            assert torch.equal(a, b)
    assert backend.stats()["num_demand_loads"] > 0
    backend.disable()


def test_pipeline_with_two_dits_and_encoder_ring_sharing_slots() -> None:
    pipe = ToyPipeline()
    ref = clone(pipe)
    before = snapshot(pipe)
    backend = _enable(pipe, num_slots=2)
    assert backend.stats()["num_streamed_blocks"] == 4 + 3 + 3
    x = _x(3)
    with torch.no_grad():
        for steps in (3, 4, 1):
            assert torch.equal(ref(x, steps), pipe(x, steps))
    backend.disable()
    assert_same(before, pipe)


def test_exception_in_block_reraised_unchanged_and_next_forward_correct() -> None:
    model = ToyDiT(4)
    ref = _run(clone(model), 2)
    backend = _enable(model)
    err = RuntimeError("user bug")

    def boom(module: torch.nn.Module, args: tuple) -> None:
        raise err

    h = model.blocks[2].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError) as info, torch.no_grad():
        model(_x(0))
    assert info.value is err
    h.remove()
    for a, b in zip(ref, _run(model, 2)):
        assert torch.equal(a, b)
    backend.disable()


def test_reentrant_forward_refused_and_ring_intact() -> None:
    model = ToyDiT(3)
    ref = _run(clone(model), 2)
    backend = _enable(model)
    inner = model.blocks[0]

    def reenter(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inner(args[0])

    h = model.blocks[1].register_forward_pre_hook(reenter, with_kwargs=True)
    with pytest.raises(OffloadError, match="still running"), torch.no_grad():
        model(_x(0))
    h.remove()
    for a, b in zip(ref, _run(model, 2)):
        assert torch.equal(a, b)
    backend.disable()


def test_grad_enabled_forward_is_refused() -> None:
    model = ToyDiT(2)
    backend = _enable(model)
    with pytest.raises(OffloadError, match="inference runtime"):
        model(_x(0))
    backend.disable()


def test_state_dict_is_real_and_load_is_refused() -> None:
    model = ToyDiT(3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    backend = _enable(model)
    got = model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    with pytest.raises(OffloadError, match="load_state_dict"):
        model.load_state_dict(want)
    backend.disable()


class _TiedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.b.weight = self.a.weight  # one tensor, two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class _TiedDiT(torch.nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([_TiedBlock(), _TiedBlock()])
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x * self.scale


class _TiedPipeline(torch.nn.Module):
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _TiedDiT()


@pytest.mark.parametrize("mode", ["layer", "module"])
def test_state_dict_serves_every_name_of_a_tied_tensor_and_what_the_user_rebound(
    mode: str,
) -> None:
    pipe = _TiedPipeline()
    want = {k: v.clone() for k, v in pipe.state_dict().items()}
    backend = dlo.enable_offload(pipe, dlo.OffloadConfig(mode=mode), device="cpu")
    assert backend is not None
    got = pipe.state_dict()
    assert want.keys() == got.keys()
    for k in want:  # never a placeholder, under either name of the tied weight
        assert torch.equal(want[k], got[k]), k
    block = pipe.transformer.blocks[1]
    block.a.bias = torch.nn.Parameter(torch.full((8,), 7.0))  # the user rebinds a name
    assert torch.equal(pipe.state_dict()["transformer.blocks.1.a.bias"], block.a.bias)
    backend.disable()


@pytest.mark.parametrize("mode", ["layer", "module"])
def test_refused_load_state_dict_changes_nothing(mode: str) -> None:
    # torch loads the root's own tensors and earlier children before it reaches a block:
    # the refusal must come first
    pipe = _TiedPipeline()
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    backend = dlo.enable_offload(pipe, dlo.OffloadConfig(mode=mode), device="cpu")
    assert backend is not None
    new = {k: v + 1 for k, v in before.items()}
    new_dit = {k.removeprefix("transformer."): v for k, v in new.items()}
    for target, state in ((pipe, new), (pipe.transformer, new_dit)):
        with pytest.raises(OffloadError, match="load_state_dict"):
            target.load_state_dict(state)
        assert all(torch.equal(before[k], v) for k, v in pipe.state_dict().items())
    backend.disable()
    assert all(torch.equal(before[k], v) for k, v in pipe.state_dict().items())
    pipe.load_state_dict(new)  # disabled: an ordinary module again
    assert torch.equal(pipe.transformer.embed.weight, new["transformer.embed.weight"])


@pytest.mark.parametrize("mode", ["layer", "module"])
def test_block_tensor_shared_with_an_unmanaged_component_is_refused(mode: str) -> None:
    # the VAE is neither streamed nor swapped: it would compute with a placeholder
    pipe = _TiedPipeline()
    pipe.vae = torch.nn.Linear(8, 8)
    pipe._vae_modules = ["vae"]  # type: ignore[misc]
    pipe.vae.weight = pipe.transformer.blocks[1].b.weight
    before = snapshot(pipe)
    with pytest.raises(
        OffloadError, match=r"transformer\.blocks\.1\.a\.weight and non-block vae\.weight"
    ):
        dlo.enable_offload(pipe, dlo.OffloadConfig(mode=mode), device="cpu")
    assert_same(before, pipe)
    assert _no_dlo_hooks(pipe)


def test_enable_twice_and_second_backend_refused() -> None:
    model = ToyDiT(2)
    backend = _enable(model)
    with pytest.raises(OffloadError, match="already enabled"):
        backend.enable(model)
    other = dlo.get_offload_backend(dlo.OffloadConfig(mode="layer"), device="cpu")
    assert other is not None
    before_hooks = [HookRegistry.owners_on(m) for m in model.modules()]
    with pytest.raises(OffloadError, match="one strategy"):
        other.enable(model)
    assert [HookRegistry.owners_on(m) for m in model.modules()] == before_hooks
    backend.disable()


def test_no_blocks_and_meta_models_refused_with_nothing_installed() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises((OffloadError, ValueError)):
        _enable(plain, components=("dit",))
    with torch.device("meta"):
        meta = ToyDiT(3)
    with pytest.raises(OffloadError, match="meta") as info:
        _enable(meta)
    assert "blocks.0.lin.weight" in str(info.value) and "blocks.2.rope" in str(info.value)
    assert _no_dlo_hooks(meta) and LEDGER.host_nbytes == 0


def _points_of_enable() -> dict[str, int]:
    with faults.count_points() as seen:
        b = _enable(ToyPipeline(), resident_layers=1)
        b.disable()
    return dict(seen)


def test_rollback_at_every_fault_point_leaves_model_exactly_as_before() -> None:
    points = _points_of_enable()
    assert {
        "host_allocation",
        "host_fill",
        "slot_allocation",
        "hook_install",
        "device_placement",
        "first_transfer",
        "commit",
    } <= set(points)
    for point, count in points.items():
        for after in sorted({0, count - 1}):
            pipe = ToyPipeline()
            before = snapshot(pipe)
            with faults.inject(point, after=after), pytest.raises(InjectedFault):
                _enable(pipe, resident_layers=1)
            assert_same(before, pipe)
            assert LEDGER.host_nbytes == 0 and LEDGER.pinned_nbytes == 0, point
            assert _no_dlo_hooks(pipe), point
            # and it can be retried
            b = _enable(pipe, resident_layers=1)
            b.disable()
            assert_same(before, pipe)


def test_backend_and_slot_views_are_freed_at_disable_without_the_garbage_collector() -> None:
    # reference counting alone frees them: no cycle keeps a view of a slot (device memory on a
    # GPU) alive until the collector happens to run
    model = ToyDiT(3)
    gc.collect()
    gc.disable()
    try:
        backend = _enable(model)
        _run(model, 1)
        ref = weakref.ref(backend)
        views = [
            weakref.ref(v)
            for ring in backend._scheduler.rings  # type: ignore[attr-defined]
            for b in ring.blocks
            for per_slot in b.views
            for v in per_slot
        ]
        assert views
        backend.disable()
        del backend
        assert ref() is None
        assert not [r for r in views if r() is not None]
    finally:
        gc.enable()


def test_state_dict_views_stay_valid_after_disable() -> None:
    model = ToyDiT(3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    backend = _enable(model)
    got = model.state_dict()
    backend.disable()
    del backend
    gc.collect()
    for k in want:  # reading them must neither crash nor differ
        assert torch.equal(want[k], got[k]), k


class OutOfOrderDiT(TwoStackDiT):
    """Declares ``blocks`` then ``blocks2`` but runs ``blocks2`` first (as Lumina2 runs its
    context refiner before the noise refiner), and optionally interleaves them."""

    interleave = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.interleave:
            for a, b in zip(self.blocks, self.blocks2):
                h = a(b(h))
            return self.head(h)
        for b in self.blocks2:
            h = b(h)
        for i, b in enumerate(self.blocks):
            h = b(h, scale=1.0 + i)
        return self.head(h)


@pytest.mark.parametrize("num_slots", [2, 3])
@pytest.mark.parametrize("kind", ["in order", "out of order", "interleaved"])
def test_one_ring_across_stacks_has_no_demand_loads_after_the_first_forward(
    kind: str, num_slots: int
) -> None:
    """[Note: prefetch chain]: the last block of one stack prefetches the first of the next,
    in the order the blocks ran on the first forward, so steady state never demand-loads."""
    model = (TwoStackDiT if kind == "in order" else OutOfOrderDiT)(4, num_blocks2=4)
    model.interleave = kind == "interleaved"  # type: ignore[assignment]
    ref_model = clone(model)
    backend = _enable(model, num_slots=num_slots)
    first = _run(model, 1)
    warm = backend.stats()["num_demand_loads"]
    if kind == "in order":
        assert warm == 0  # block 0 preloaded, the seam prefetched
    out = first + _run(model, 3)
    for a, b in zip(_run(ref_model, 1) + _run(ref_model, 3), out, strict=True):
        assert torch.equal(a, b)
    assert backend.stats()["num_demand_loads"] == warm
    backend.disable()


@pytest.mark.parametrize("num_slots", [2, 3])
def test_a_block_that_ran_keeps_its_slot_so_a_step_caches_skips_load_nothing(
    num_slots: int,
) -> None:
    """[Note: kept after exit]: a step cache that runs block 0 and skips the rest (diffusers'
    FirstBlockCache) loads block 0 once, not once a step; a prefetch the skips leave unused
    is counted as wasted once its slot is taken; bitwise throughout."""
    model = ToyDiT(6)
    ref_model = clone(model)
    backend = _enable(model, num_slots=num_slots, resident_layers=0)

    def step(skip: set[int], seed: int) -> None:
        model.skip = ref_model.skip = skip
        with torch.no_grad():
            assert torch.equal(model(_x(seed)), ref_model(_x(seed)))

    step(set(), 0)
    st = backend.stats()
    loads, demand = st["num_loads"], st["num_demand_loads"]
    for s in range(4):  # skip steps: only block 0 runs
        step({1, 2, 3, 4, 5}, 1 + s)
    st = backend.stats()
    # the first skip step's window (block 0's next) is loaded once; nothing after
    assert st["num_loads"] - loads <= num_slots - 1
    assert st["num_demand_loads"] == demand and st["num_wasted_loads"] == 0
    step(set(), 9)  # a full step runs what the skip steps prefetched: nothing wasted
    assert backend.stats()["num_wasted_loads"] == 0
    assert backend.stats()["num_demand_loads"] == demand
    step({1, 2}, 10)  # blocks 1 and 2 prefetched, then skipped: their loads are wasted
    step(set(), 11)
    assert backend.stats()["num_wasted_loads"] >= 1
    backend.disable()


def test_a_ring_no_longer_than_its_slots_loads_once() -> None:
    model = ToyDiT(3)
    ref = _run(clone(model), 4)
    backend = _enable(model, num_slots=3, resident_layers=0)
    out = _run(model, 1)
    loads = backend.stats()["num_loads"]
    out += _run(model, 4)[1:]
    assert backend.stats()["num_loads"] == loads
    for a, b in zip(ref, out, strict=True):
        assert torch.equal(a, b)
    backend.disable()
