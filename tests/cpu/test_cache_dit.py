"""cache-dit (DBCache) on a pipeline dlo streams: on a ring of its own the blocks it skips
are never called, so never loaded, and the output is bitwise the resident pipeline's with the
same cache; where blocks gather, each rank would skip by its own residuals, so cache-dit is
refused by name, at enable or at the first forward after it was applied, on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.commands.pipeline_calls import resident_reference
from dlo.host.region import LEDGER
from dlo.pipelines.layouts import FOLDERS
from tests.cpu.test_bench_pipeline_budgets import folder
from tests.harness import assert_all_ok, run_ranks

__all__ = ["folder"]  # fixture

cache_dit = pytest.importorskip("cache_dit")
STEPS, WARMUP = 12, 2


def _config() -> Any:
    """First block computed, the rest cached once the two warm-up steps ran (a threshold
    the tiny model's residual differences always stay under)."""
    return cache_dit.DBCacheConfig(
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        residual_diff_threshold=10.0,
        max_warmup_steps=WARMUP,
    )


def _call(pipe: Any) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    call: dict[str, Any] = {**FOLDERS["tiny-flux"].call, "output_type": "pt"}
    call.update(prompt="a red fox", num_inference_steps=STEPS)
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images  # type: ignore[no-any-return]


@pytest.mark.parametrize("when", ["after", "before"])
def test_cache_dit_skipped_blocks_load_nothing_and_the_bits_are_residents(
    folder: Path, when: str
) -> None:
    ref = resident_reference(str(folder), torch.float32, torch.device("cpu"))
    base = _call(ref)
    cache_dit.enable_cache(ref, cache_config=_config())
    want = _call(ref)
    assert not torch.equal(want, base)  # the cache changed the result: it skipped

    def prepare(p: Any) -> None:
        if when == "before":
            cache_dit.enable_cache(p, cache_config=_config())

    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0, num_slots=2)
    pipe, backend = dlo.load_pipeline(folder, cfg, device="cpu", prepare=prepare)
    assert backend is not None
    try:
        if when == "after":
            cache_dit.enable_cache(pipe, cache_config=_config())
        before = backend.stats()["num_loads"]
        assert torch.equal(_call(pipe), want)
        st = backend.stats()
        blocks = st["num_streamed_blocks"]
        assert blocks == 5
        # the warm-up steps load every block; later steps run block 0 alone, kept in its
        # slot ([Note: kept after exit]): it loads once, the skipped blocks never
        assert st["num_loads"] - before <= WARMUP * blocks + 1 < STEPS * blocks
    finally:
        backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def _gathering_rank(rank: int, world: int, folder: str, when: str) -> str:
    cfg = dlo.OffloadConfig(
        mode="layer", transfer="allgather", resident_layers=0, collective_timeout_s=30
    )

    def prepare(p: Any) -> None:
        if when == "before":
            cache_dit.enable_cache(p, cache_config=_config())

    par = dlo.ParallelConfig(data_parallel_size=world)
    try:
        pipe, backend = dlo.load_pipeline(folder, cfg, parallel=par, device="cpu", prepare=prepare)
    except dlo.OffloadError as e:
        return "enable: " + str(e)
    assert backend is not None
    try:
        cache_dit.enable_cache(pipe, cache_config=_config())
        try:
            _call(pipe)
        except dlo.OffloadError as e:
            return "call: " + str(e)
        return "ran"
    finally:
        backend.disable(restore=True)


@pytest.mark.parametrize("when", ["after", "before"])
def test_cache_dit_where_blocks_gather_is_refused_on_every_rank(folder: Path, when: str) -> None:
    res = assert_all_ok(run_ranks(_gathering_rank, 2, str(folder), when, timeout_s=180))
    where = "enable" if when == "before" else "call"
    assert all(r.startswith(f"{where}: ") and "cache-dit is enabled" in r for r in res), res
