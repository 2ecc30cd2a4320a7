"""Context (sequence) parallelism with dlo's AllGather on the same ranks (issue 38): a
diffusers transformer under ``enable_parallelism(ContextParallelConfig(ulysses_degree=N))``,
its blocks streamed and rebuilt by AllGather over the same N ranks (one prompt: every rank
runs the same block at the same time on its slice of the sequence, DLO's lock step), bit for
bit against the resident context-parallel run on the same ranks; ``disable(restore=True)``
gives the model back. gloo, worlds 2 and 4, tiny Wan and FLUX with 4 heads (Ulysses splits
heads). diffusers 0.42.1 divides by ``torch.accelerator.device_count()`` (0 on a CPU) when it
builds its mesh: the ranks patch it to 1 around ``enable_parallelism``. Ring attention needs
an attention backend that returns the log-sum-exp, which the CPU's native one does not: it
is not run here."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder
from tests.cpu.test_cli import _torchrun
from tests.cpu.test_diffusers_adapters import _flux_inputs, _wan, _wan_inputs
from tests.cpu.test_pipeline_folders import _call_flags, _reports
from tests.harness import assert_all_ok, run_ranks

diffusers = pytest.importorskip("diffusers")


def _flux() -> torch.nn.Module:
    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


MODELS = {"wan": (functools.partial(_wan, 4), _wan_inputs), "flux": (_flux, _flux_inputs)}


def _ulysses(model: torch.nn.Module, world: int) -> None:
    """diffusers' Ulysses over every rank (its mesh built on the CPU: see the module doc)."""
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: max(count(), 1)  # type: ignore[assignment]
    try:
        model.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=world))
    finally:
        torch.accelerator.device_count = count  # type: ignore[assignment]


def _rank(rank: int, world: int, name: str) -> dict[str, Any]:
    build, inputs = MODELS[name]
    torch.manual_seed(0)
    ref = build().eval()
    model = copy.deepcopy(ref)
    _ulysses(ref, world)
    _ulysses(model, world)
    steps = [inputs(torch.Generator().manual_seed(s)) for s in range(3)]
    with torch.no_grad():
        want = [ref(**x, return_dict=False)[0] for x in steps]
    cfg = dlo.OffloadConfig(
        mode="layer", transfer="allgather", num_slots=2, collective_timeout_s=30
    )
    backend = dlo.enable_offload(model, cfg, device="cpu")
    try:
        with torch.no_grad():
            got = [model(**x, return_dict=False)[0] for x in steps]
        st = backend.stats()
    finally:
        backend.disable(restore=True)
    with torch.no_grad():
        after = model(**steps[0], return_dict=False)[0]
    return {
        "same": all(torch.equal(a, b) for a, b in zip(want, got, strict=True)),
        "restored": torch.equal(after, want[0]),
        "group_size": st["group_size"],
        "streamed": st["num_streamed_blocks"],
        "gathered": st["allgather_nbytes"],
        "host": st["host_nbytes"],
        "context_parallel": ref._parallel_config is not None,
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_ulysses_with_allgather_on_the_same_ranks_is_bitwise(name: str, world: int) -> None:
    res = assert_all_ok(run_ranks(_rank, world, name, timeout_s=240))
    assert all(r["same"] and r["restored"] and r["context_parallel"] for r in res), res
    assert all(r["group_size"] == world and r["streamed"] > 0 for r in res)
    # each rank holds 1/N of every streamed block and gathered them whole
    assert len({r["host"] for r in res}) == 1 and all(r["gathered"] > 0 for r in res)


# ----------------------------------------------------------------------------- dlo run
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan2.1"])
def test_dlo_run_context_parallel_under_torchrun_is_bitwise(tmp_path: Path, name: str) -> None:
    """``torchrun --nproc-per-node=2 dlo run --pipeline DIR --context-parallel ulysses
    --transfer allgather --check``: both ranks run rank 0's request split along the
    sequence, each holding half of every block; the output is the resident context-parallel
    run's bit for bit, and rank 0 alone writes it."""
    folder = tmp_path / name
    save_folder(FOLDERS[name], folder, max_shard_size=40_000)
    out = tmp_path / "out" / "result.png"
    proc = _torchrun(
        "run", "--pipeline", str(folder), "--steps", "2", "--check", "--json",
        "--context-parallel", "ulysses", "--transfer", "allgather", "--dtype", "float32",
        "--prompt", "a red fox", "--prompt", "a blue bird", *_call_flags(name),
        *(["--output", str(out)] if name == "tiny-flux" else []),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = _reports(proc.stdout)
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["parity"] is True and r["transfer"] == "allgather" for r in reports), reports
    assert [r["prompt"] for r in reports] == ["a red fox"] * 2  # one request, split
    assert [r["seed"] for r in reports] == [0, 0]
    assert all(r["context_parallel"] == "ulysses" for r in reports)
    if name == "tiny-flux":
        assert [len(r["output"]) for r in reports] == [1, 0]
        assert sorted(p.name for p in out.parent.iterdir()) == ["result.png"]


def test_context_parallel_bad_input_is_named() -> None:
    from dlo.pipelines.context_parallel import check_context_parallel

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="--context-parallel='tensor'"):
        check_context_parallel("tensor", 2, cpu)
    with pytest.raises(ValueError, match="needs 2 or more ranks"):
        check_context_parallel("ulysses", 1, cpu)
    with pytest.raises(ValueError, match="ring needs an attention backend"):
        check_context_parallel("ring", 2, cpu)


def test_ulysses_over_a_head_count_it_does_not_divide_is_named() -> None:
    from dlo.pipelines.context_parallel import enable_context_parallel

    with pytest.raises(ValueError, match="has 4 attention heads, which 3 does not divide"):
        enable_context_parallel([_wan(4)], "ulysses", 3, torch.device("cpu"))


def test_ring_over_heads_cudnn_cannot_take_is_named() -> None:
    """cuDNN's attention (ring's backend) needs a head width 8 divides: refused by name
    before diffusers' hooks go on (the check runs before any device work)."""
    from dlo.pipelines.context_parallel import enable_context_parallel

    first, dit = _flux(), _wan(2)  # heads 16 wide (fine), then 12 wide
    with pytest.raises(ValueError, match=r"heads are 12 wide.*use ulysses"):
        enable_context_parallel([first, dit], "ring", 2, torch.device("cuda"))
    from dlo.pipelines.context_parallel import _default_backend

    assert _default_backend(first) and _default_backend(dit)  # neither changed
