"""diffusers' step caches on tiny FLUX and Wan 2.1 *pipelines* (their own ``__call__``,
``cache_context`` per branch) with dlo: bitwise against the resident pipeline with the same
cache, on the ring (cache enabled before and after enable; skipped blocks not loaded) and
under AllGather at world 2 with a different prompt per rank (every rank's own reference)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.commands.pipeline_calls import dits_of, resident_reference
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder
from tests.harness import assert_all_ok, run_ranks

hooks = pytest.importorskip("diffusers.hooks")
STEPS = 6

CACHES: dict[str, Callable[[], Any]] = {
    "first-block": lambda: hooks.FirstBlockCacheConfig(threshold=10.0),  # skips when it can
    "taylorseer-lite": lambda: hooks.TaylorSeerCacheConfig(
        cache_interval=2, max_order=1, use_lite_mode=True
    ),
    "pab": lambda: hooks.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(0, 1000),
        current_timestep_callback=lambda: 500,
    ),
}
NAMES = ("tiny-flux", "tiny-wan2.1")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cache-pipelines")
    for name in NAMES:
        save_folder(FOLDERS[name], out / name, max_shard_size=40_000)
    return out


def _call(pipe: Any, name: str, prompt: str) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    call: dict[str, Any] = {**FOLDERS[name].call, "output_type": "pt"}
    call.update(prompt=prompt, num_inference_steps=STEPS)
    out = pipe(**call, generator=torch.Generator().manual_seed(0))
    return out.images if hasattr(out, "images") else out.frames  # type: ignore[no-any-return]


def _enable_cache(pipe: Any, cache: str) -> None:
    for dit in dits_of(pipe):
        dit.enable_cache(CACHES[cache]())


@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("name", NAMES)
def test_ring_bitwise_with_each_cache(root: Path, name: str, cache: str, when: str) -> None:
    folder = str(root / name)
    ref = resident_reference(folder, torch.float32, torch.device("cpu"))
    _enable_cache(ref, cache)
    want = _call(ref, name, "a red fox")

    def prepare(p: Any) -> None:
        if when == "before":
            _enable_cache(p, cache)

    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0, num_slots=2)
    pipe, backend = dlo.load_pipeline(folder, cfg, device="cpu", prepare=prepare)
    assert backend is not None
    try:
        if when == "after":
            _enable_cache(pipe, cache)
        before = backend.stats()["num_loads"]
        assert torch.equal(_call(pipe, name, "a red fox"), want)
        st = backend.stats()
        assert st["num_cache_inner_blocks"] == st["num_streamed_blocks"] > 0
        if cache != "pab":  # whole blocks skipped: they loaded nothing
            assert st["num_skipped_blocks"] > 0
            forwards = STEPS * (2 if name == "tiny-wan2.1" else 1)  # Wan: CFG, two branches
            assert st["num_loads"] - before < forwards * st["num_streamed_blocks"]
    finally:
        backend.disable()


def _gathering_rank(rank: int, world: int, folder: str, name: str, cache: str) -> bool:
    prompt = ["a red fox", "a blue bird"][rank]
    ref = resident_reference(folder, torch.float32, torch.device("cpu"))
    _enable_cache(ref, cache)
    want = _call(ref, name, prompt)
    cfg = dlo.OffloadConfig(
        mode="layer", transfer="allgather", resident_layers=0, collective_timeout_s=30
    )
    par = dlo.ParallelConfig(data_parallel_size=world)
    pipe, backend = dlo.load_pipeline(folder, cfg, parallel=par, device="cpu")
    assert backend is not None
    try:
        _enable_cache(pipe, cache)
        got = _call(pipe, name, prompt)
        assert backend.stats()["num_cache_inner_blocks"] == 0  # loads outside: every block
    finally:
        backend.disable(restore=True)
    return bool(torch.equal(got, want))


@pytest.mark.parametrize("cache", ["first-block", "taylorseer-lite"])
@pytest.mark.parametrize("name", NAMES)
def test_allgather_two_ranks_own_prompts_bitwise(root: Path, name: str, cache: str) -> None:
    res = assert_all_ok(run_ranks(_gathering_rank, 2, str(root / name), name, cache, timeout_s=240))
    assert all(res)
