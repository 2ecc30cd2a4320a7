"""diffusers' step caches on a DiT dlo streams ([Note: loads inside step caches] in
:mod:`dlo.hooks.step_caches`): attached before or after enable, bitwise against the same model
resident with the same cache; a block the cache skips is not loaded (load counts); the cache
outlives dlo's disable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import dlo
from dlo.bench.like import _tiny_flux_inputs
from dlo.host.region import LEDGER
from dlo.pipelines.layouts import TINY_FLUX_TRANSFORMER
from tests.harness import assert_all_ok, run_ranks

diffusers = pytest.importorskip("diffusers")
hooks = pytest.importorskip("diffusers.hooks")

STEPS = 8


def _fbc() -> Any:
    return hooks.FirstBlockCacheConfig(threshold=0.5)


def _mag() -> Any:  # skip steps 3..6 with retention 2 (its ratios: a flat schedule)
    return hooks.MagCacheConfig(
        threshold=10.0,
        max_skip_steps=3,
        retention_ratio=0.25,
        num_inference_steps=STEPS,
        mag_ratios=[1.0] * STEPS,
    )


def _taylor() -> Any:
    return hooks.TaylorSeerCacheConfig(cache_interval=3, max_order=1, use_lite_mode=True)


def _pab() -> Any:
    return hooks.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(0, 1000),
        current_timestep_callback=lambda: 500,
    )


def _sea() -> Any:
    def frames(module: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        h = kwargs["hidden_states"]  # FLUX's packed tokens as one frame (B, C, 1, H, W)
        b, n, c = h.shape
        side = int(n**0.5)
        return [h.transpose(1, 2).reshape(b, c, 1, side, side)]

    return hooks.SeaCacheConfig(threshold=1.0, max_consecutive_cached=3, raw_vision_callback=frames)


_TIMESTEP = [1000]
"""The timestep of the step :func:`_steps` runs (FasterCache's ``current_timestep_callback``)."""


def _faster() -> Any:
    """FasterCache skipping attention every other step after the first: the first step is
    outside its skip range, so its attention fills the cache (diffusers 0.42.1 would skip at
    iteration 0 otherwise, and find no cache)."""
    return hooks.FasterCacheConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 900),
        current_timestep_callback=lambda: _TIMESTEP[0],
        attention_weight_callback=lambda _: 0.5,
        is_guidance_distilled=True,
    )


CACHES: dict[str, Callable[[], Any]] = {
    "faster": _faster,
    "first-block": _fbc,
    "mag": _mag,
    "taylorseer-lite": _taylor,
    "pab": _pab,
    "sea": _sea,
}


def _model() -> Any:
    torch.manual_seed(0)
    cfg = {**TINY_FLUX_TRANSFORMER, "num_layers": 2, "num_single_layers": 6}
    return diffusers.FluxTransformer2DModel(**cfg).eval()


def _steps(model: Any, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = _tiny_flux_inputs(16, torch.device("cpu"), torch.float32, g)
    base["hidden_states"] = base["hidden_states"] * scale
    outs = []
    for s in range(STEPS):
        _TIMESTEP[0] = 1000 if s == 0 else 500
        inp = dict(base)
        inp["hidden_states"] = base["hidden_states"] * (1 + 0.01 * s)
        inp["timestep"] = torch.full((1,), 1.0 - 0.1 * s)
        where = {"step_index": s, "sigma": 1.0 - 0.1 * s, "num_inference_steps": STEPS}
        with torch.no_grad(), model.cache_context("cond", **where):
            outs.append(model(**inp)[0].clone())
    return outs


def _reference(make: Callable[[], Any]) -> tuple[list[torch.Tensor], int]:
    """The resident model's outputs with the cache, and how many block bodies ran."""
    model = _model()
    ran = _count_bodies(model)
    model.enable_cache(make())
    return _steps(model), sum(ran)


def _count_bodies(model: Any) -> list[int]:
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    ran = [0]
    for b in blocks:  # the block's first child runs only when its body runs
        next(iter(b.children())).register_forward_hook(lambda *_: ran.__setitem__(0, ran[0] + 1))
    return ran


@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_each_cache_is_bitwise_and_skipped_blocks_are_not_loaded(cache: str, when: str) -> None:
    make = CACHES[cache]
    ref, ref_bodies = _reference(make)
    model = _model()
    bodies = _count_bodies(model)
    if when == "before":
        model.enable_cache(make())
    backend = dlo.enable_offload(model, dlo.OffloadConfig(num_slots=2), device="cpu")
    try:
        _check(backend, model, make, when, cache, ref, ref_bodies, bodies)
    finally:
        backend.disable()
    assert model.is_cache_enabled  # the user's cache outlives dlo
    assert not any("dlo" in n for b in model.transformer_blocks for n in b._diffusers_hook.hooks)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    again = _steps(model)  # the cache still works on the plain model
    model.disable_cache()
    assert len(again) == STEPS


def _check(
    backend: Any,
    model: Any,
    make: Callable[[], Any],
    when: str,
    cache: str,
    ref: list[torch.Tensor],
    ref_bodies: int,
    bodies: list[int],
) -> None:
    if when == "after":
        model.enable_cache(make())
    st = backend.stats()
    loads0 = st["num_loads"]
    assert st["num_cache_inner_blocks"] == 8
    out = _steps(model)
    assert all(torch.equal(a, b) for a, b in zip(ref, out, strict=True))
    assert bodies[0] == ref_bodies  # the cache skipped what it skips without dlo
    st = backend.stats()
    calls = STEPS * 8
    runs = sum(b.num_runs for r in backend._state.scheduler.rings for b in r.blocks)
    assert st["num_skipped_blocks"] == calls - runs
    loads = st["num_loads"] - loads0
    if cache in ("pab", "faster"):  # attention skipped, every block runs: every block loads
        assert st["num_skipped_blocks"] == 0
    else:
        assert st["num_skipped_blocks"] > 0, st
        # a skipped block costs no load: loads follow the blocks that ran, plus at most
        # one prefetch left unused per skip decision
        assert loads <= runs + STEPS, (loads, runs)
        assert loads < calls


def test_first_block_cache_skip_steps_load_nothing() -> None:
    """FirstBlockCache runs block 0 every step: it keeps its slot ([Note: kept after exit]),
    so a step that skips the rest loads nothing."""
    model = _model()
    backend = dlo.enable_offload(model, dlo.OffloadConfig(num_slots=2), device="cpu")
    model.enable_cache(hooks.FirstBlockCacheConfig(threshold=10.0))  # skips whenever it can
    _steps(model)
    st = backend.stats()
    runs = sum(b.num_runs for r in backend._state.scheduler.rings for b in r.blocks)
    # step 0 runs all 8 blocks; the others run block 0 alone
    assert runs == 8 + (STEPS - 1) and st["num_skipped_blocks"] == 7 * (STEPS - 1)
    assert st["num_demand_loads"] == 0
    assert st["num_loads"] <= 1 + 8 + 2  # preload, step 0, the window after it
    model.disable_cache()  # dlo's hooks back outside: every block loads again
    assert backend.stats()["num_cache_inner_blocks"] == 0
    before = backend.stats()["num_loads"]
    _steps(model)
    assert backend.stats()["num_loads"] - before >= STEPS * 7
    backend.disable()


def _rank_cache(cache: str, rank: int) -> Any:
    """Rank 0 never skips, rank 1 skips what it can: the ranks' decisions differ."""
    if cache == "first-block":
        return hooks.FirstBlockCacheConfig(threshold=[0.0, 10.0][rank])
    return hooks.MagCacheConfig(  # its error is 0 with flat ratios: below 0 never skips
        threshold=[-1.0, 10.0][rank],
        max_skip_steps=3,
        retention_ratio=0.25,
        num_inference_steps=STEPS,
        mag_ratios=[1.0] * STEPS,
    )


def _gathering_rank(rank: int, world: int, cache: str) -> dict[str, Any]:
    """A rank's tiny FLUX under AllGather with its own cache decisions."""
    ref_model = _model()
    ref_model.enable_cache(_rank_cache(cache, rank))
    ref = _steps(ref_model)
    model = _model()
    bodies = _count_bodies(model)
    backend = dlo.enable_offload(
        model, dlo.OffloadConfig(transfer="allgather", num_slots=2), device="cpu"
    )
    try:
        model.enable_cache(_rank_cache(cache, rank))
        out = _steps(model)
        st = backend.stats()
        return {
            "same": all(torch.equal(a, b) for a, b in zip(ref, out, strict=True)),
            "inner": st["num_cache_inner_blocks"],
            "loads": st["num_loads"],
            "group_size": st["group_size"],
            "bodies": bodies[0],
        }
    finally:
        backend.disable()


@pytest.mark.parametrize("cache", ["first-block", "mag"])
def test_gathering_ranks_load_every_block_whatever_each_cache_skips(cache: str) -> None:
    """Under AllGather each rank's cache decides for itself (here rank 0 never skips, rank 1
    skips what it can); dlo's loads stay outside the caches, so every rank gathers every
    block in the same order: bitwise per rank, never a collective out of step."""
    res = assert_all_ok(run_ranks(_gathering_rank, 2, cache, timeout_s=240))
    assert res[0]["bodies"] > res[1]["bodies"]  # the decisions differ
    assert all(r["same"] and r["group_size"] == 2 and r["inner"] == 0 for r in res)
    assert res[0]["loads"] == res[1]["loads"]


@pytest.mark.parametrize("cache", ["first-block"])
def test_compiled_blocks_keep_working_with_a_cache(cache: str) -> None:
    """Blocks compiled (each its own ``compile``, as diffusers' ``compile_repeated_blocks``)
    after enable, then a cache: dlo's inner hooks stay out of the compiled frames, bitwise,
    and skipped blocks still load nothing."""
    ref, _ = _reference(CACHES[cache])
    model = _model()
    backend = dlo.enable_offload(model, dlo.OffloadConfig(num_slots=2), device="cpu")
    try:
        for b in [*model.transformer_blocks, *model.single_transformer_blocks]:
            b.compile(backend="aot_eager")
        model.enable_cache(CACHES[cache]())
        out = _steps(model)
        st = backend.stats()
        assert all(torch.equal(a, b) for a, b in zip(ref, out, strict=True))
        assert st["num_skipped_blocks"] > 0 and st["num_cache_inner_blocks"] == 8
        runs = sum(b.num_runs for r in backend._state.scheduler.rings for b in r.blocks)
        assert st["num_loads"] <= 1 + runs + STEPS
    finally:
        backend.disable()


def test_a_dit_with_other_diffusers_hooks_enables_as_before() -> None:
    """A DiT whose root carries a diffusers hook that is no step cache (context parallelism's,
    say) is not followed (its ``enable_cache`` is left alone) and enables as before."""
    model = _model()
    registry = hooks.HookRegistry.check_if_exists_or_initialize(model)
    registry.register_hook(hooks.ModelHook(), "user_hook")
    backend = dlo.enable_offload(model, dlo.OffloadConfig(num_slots=2), device="cpu")
    try:
        assert "enable_cache" not in vars(model)
        assert backend.stats()["num_cache_inner_blocks"] == 0
    finally:
        backend.disable()
    registry.remove_hook("user_hook", recurse=False)


def test_a_cache_call_after_an_interrupted_forward_is_not_refused() -> None:
    """A forward interrupted inside a block leaves a stale claim: ``enable_cache`` drops it
    and goes ahead (nothing runs), as the next forward would."""
    model = _model()
    backend = dlo.enable_offload(model, dlo.OffloadConfig(num_slots=2), device="cpu")
    try:
        sched = backend._state.scheduler
        block = sched.rings[0].blocks[0]
        g = torch.Generator().manual_seed(0)
        inputs = _tiny_flux_inputs(16, torch.device("cpu"), torch.float32, g)

        def interrupt(*_: Any) -> None:
            raise KeyboardInterrupt

        handle = next(iter(block.module.children())).register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(**inputs)
        handle.remove()
        model.enable_cache(_fbc())
        assert backend.stats()["num_cache_inner_blocks"] == 8
        model.disable_cache()
    finally:
        backend.disable()
