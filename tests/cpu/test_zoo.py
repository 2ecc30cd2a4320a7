"""Every diffusers transformer class and the pipelines' text encoders, at tiny sizes
(:mod:`tests.zoo`), streamed with no declaration of their own.

For each class: the ring and the model swap (``mode="module"``) are bitwise equal to a
resident copy over two forwards, the second forward issues no demand load (the ring learned
the order the blocks ran in, across stacks: [Note: prefetch chain]), and after ``disable``
every tensor is back and the model still gives the same output. Text encoders run as the
encoder of a pipeline, discovered from their ``_no_split_modules``. AllGather at world 2
(gloo) runs a set of classes: multi-stack, out of declared order, interleaved stacks.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.platform.device import CpuPlatform
from tests.harness import assert_all_ok, run_ranks
from tests.toys import assert_same, snapshot
from tests.zoo import DIT_MODULES, ENCODER_MODULE, Case, cases, tensors_of

DITS = {c.name: c for m in DIT_MODULES for c in cases(m)}
ENCODERS = {c.name: c for c in cases(ENCODER_MODULE)}

# multi-stack (Flux, HunyuanVideo), out of declared order (Lumina2, WanVACE), interleaved
# (Latte), and a plain one (Wan)
ALLGATHER = (
    "FluxTransformer2DModel",
    "HunyuanVideoTransformer3DModel",
    "Lumina2Transformer2DModel",
    "WanVACETransformer3DModel",
    "LatteTransformer3DModel",
    "WanTransformer3DModel",
)


class EncoderPipeline:
    """A pipeline whose one component is a text encoder (declared as such, no blocks)."""

    _dit_modules: ClassVar[list[str]] = []
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self, encoder: nn.Module) -> None:
        self.text_encoder = encoder


def _build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return case.build()


def _forwards(case: Case, model: nn.Module, n: int = 2, seed: int = 1) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for i in range(n):
            g = torch.Generator().manual_seed(seed + i)
            out += [t.clone() for t in tensors_of(case.run(model, case.inputs(g)))]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _check(case: Case, model: nn.Module, target: Any, cfg: dlo.OffloadConfig) -> dict[str, Any]:
    """Enable on ``target`` (the model or a pipeline holding it), compare, disable.

    Stats are taken after two forwards (the warm-up: a stack that does not run in the first
    forward fixes the learned order only when the second begins) and after two more."""
    ref = copy.deepcopy(model)
    held = dict(_named_tensors(ref))  # held: a rebound tensor's id is never reused meanwhile
    want = _forwards(case, ref, 4)
    # tensors the model rebinds itself in forward (OmniGen's rope.inv_freq): compared by
    # value against the resident copy, not by identity against the state before enable
    rebound = _rebound(held, ref)
    before = snapshot(model)
    backend = dlo.enable_offload(target, cfg, device="cpu")
    assert backend is not None
    try:
        first = _forwards(case, model, 2)
        stats_first = backend.stats()
        rest = _forwards(case, model, 2, seed=3)
        stats = backend.stats()
    finally:
        backend.disable()
    assert _same(want, first + rest), "offloaded forwards differ from the resident model"
    assert_same({k: v for k, v in before.items() if k not in rebound}, _without(model, rebound))
    ref_tensors = dict(_named_tensors(ref))
    for name, t in _named_tensors(model):
        if name in rebound:
            assert torch.equal(t, ref_tensors[name]), name
    assert _same(want[: len(first) // 2], _forwards(case, model, 1)), "after disable"
    return {"first": stats_first, "last": stats}


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())


def _rebound(held: dict[str, torch.Tensor], model: nn.Module) -> set[str]:
    """The names whose tensor is no longer the object ``held`` (the objects themselves, not
    their ids: a freed tensor's id may be reused by its replacement)."""
    after = dict(_named_tensors(model))
    return {k for k, t in held.items() if after.get(k) is not t}


class _Without(nn.Module):
    """``model``'s tensors but those named in ``skip`` (for :func:`assert_same`)."""

    def __init__(self, model: nn.Module, skip: set[str]) -> None:
        super().__init__()
        self.items = [(k, t) for k, t in _named_tensors(model) if k not in skip]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return iter(self.items)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return iter(())


def _without(model: nn.Module, skip: set[str]) -> nn.Module:
    return _Without(model, skip)


@pytest.mark.parametrize("name", sorted(DITS))
def test_dit_ring_without_declarations(name: str) -> None:
    case = DITS[name]
    model = _build(case)
    plan = dlo.resolve_offload_plan(model, dlo.OffloadConfig(mode="layer"))
    assert plan.dits == ("",) and plan.stacks, plan
    cfg = dlo.OffloadConfig(mode="layer", num_slots=2, **(case.needs or {}))
    st = _check(case, model, model, cfg)
    streamed = st["last"]["num_streamed_blocks"] + st["last"]["num_resident_blocks"]
    assert streamed == len(plan.all_block_paths)
    assert st["last"]["h2d_nbytes"] > 0
    # steady state: no demand load after the first forward taught the ring the order
    assert st["last"]["num_demand_loads"] == st["first"]["num_demand_loads"], st


@pytest.mark.parametrize("name", sorted(DITS))
def test_dit_module_swap_without_declarations(name: str) -> None:
    case = DITS[name]
    model = _build(case)
    st = _check(case, model, model, dlo.OffloadConfig(mode="module"))
    assert list(st["last"]["components"]) == [""]


ENCODERS_SELECTED = dlo.OffloadConfig(mode="layer", components=("encoder",), num_slots=2)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_text_encoder_streams_from_its_no_split_modules(name: str) -> None:
    """Streamed when ``components`` selects encoders; kept whole (and told once) under
    ``components=None``."""
    case = ENCODERS[name]
    model = _build(case)
    pipe = EncoderPipeline(model)
    assert dlo.resolve_offload_plan(pipe, dlo.OffloadConfig(mode="layer")).stacks == ()
    plan = dlo.resolve_offload_plan(pipe, ENCODERS_SELECTED)
    assert plan.encoders == ("text_encoder",) and plan.stacks, plan
    assert all(s.component == "encoder" for s in plan.stacks)
    st = _check(case, model, pipe, ENCODERS_SELECTED)
    assert st["last"]["num_streamed_blocks"] == len(plan.all_block_paths)
    assert st["last"]["num_demand_loads"] == st["first"]["num_demand_loads"], st
    _check(case, model, pipe, dlo.OffloadConfig(mode="module"))


def _allgather(rank: int, world: int, name: str) -> dict[str, Any]:
    case = DITS[name]
    model = _build(case)
    want = _forwards(case, copy.deepcopy(model), 4, seed=1 + 10 * rank)
    cfg = dlo.OffloadConfig(
        mode="layer", transfer="allgather", num_slots=2, collective_timeout_s=30
    )
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    backend.enable(model)
    try:
        first = _forwards(case, model, 2, seed=1 + 10 * rank)
        loads = backend.stats()["num_demand_loads"]
        rest = _forwards(case, model, 2, seed=3 + 10 * rank)
        st = backend.stats()
    finally:
        backend.disable()
    return {
        "same": _same(want, first + rest),
        "group_size": st["group_size"],
        "allgather_nbytes": st["allgather_nbytes"],
        "steady": st["num_demand_loads"] == loads,
    }


@pytest.mark.parametrize("name", ALLGATHER)
def test_dit_allgather_two_ranks_without_declarations(name: str) -> None:
    for r in assert_all_ok(run_ranks(_allgather, 2, name, timeout_s=180)):
        assert r["same"] and r["steady"], r
        assert r["group_size"] == 2 and r["allgather_nbytes"] > 0, r


def test_the_compatibility_table_is_current() -> None:
    """docs/compatibility.md's model table is what the zoo gives now (regenerate:
    ``python -m tests.zoo.table``), whatever versions pip resolved within the test extras:
    with other versions than the table's, every row both have must agree."""
    from tests.zoo import table

    mismatches, notes = table.compare(table.current(), table.table())
    assert not mismatches, "regenerate: python -m tests.zoo.table\n" + "\n".join(mismatches)
    if notes:
        warnings.warn("compatibility table: " + "; ".join(notes), stacklevel=1)


def test_the_table_check_holds_across_versions() -> None:
    """The check compares rows, not the versions line: another transformers (a fresh
    install's newest) passes, a changed row of a shared class fails, a new class is a note."""
    from tests.zoo import table

    doc = table.current()
    d, t = table.recorded_versions(doc)
    newer = doc.replace(table.versions_line(d, t), table.versions_line(d, t + ".post1"), 1)
    assert table.recorded_versions(newer) == (d, t + ".post1")
    assert table.compare(doc, newer) == ([], [])
    rows = [ln for ln in doc.splitlines() if ln.startswith("| `")]
    changed = newer.replace(rows[0], rows[0].replace("out of the box", "needs a declaration"))
    assert table.compare(doc, changed)[0], "a changed row must fail"
    added = newer.replace(rows[0], rows[0] + "\n| `NewModel` | - | - | out of the box |")
    mismatches, notes = table.compare(doc, added)
    assert not mismatches and notes == ["only in the installed versions: `NewModel`"]
    # the same versions: any difference fails, as before
    assert table.compare(doc, doc + "x")[0]


def test_the_test_extras_are_bounded_and_installed_within_bounds() -> None:
    """A fresh install resolves the test extras' third-party packages within tested bounds
    (each has an upper bound), and the ones installed here satisfy them."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    # the installed dlo's metadata: pyproject's extras as pip read them
    extras = [Requirement(r) for r in requires("dlo") or []]
    reqs = {r.name: r for r in extras if r.marker and r.marker.evaluate({"extra": "test"})}
    bounded = {"diffusers", "transformers", "accelerate", "peft", "torchao"}
    for name in sorted(bounded):
        spec = reqs[name].specifier
        assert any(s.operator in ("<", "<=", "==", "~=") for s in spec), f"{name}: {spec} is open"
        assert spec.contains(version(name), prereleases=True), (name, version(name), str(spec))
    from tests.zoo import table

    d, t = table.recorded_versions(table.current())
    assert reqs["diffusers"].specifier.contains(d) and reqs["transformers"].specifier.contains(t)


def test_a_diffusers_pipeline_without_an_adapter_resolves_by_component_classes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real diffusers pipeline class dlo has no adapter for (LTX-Video): its registered
    components are classified by their classes, with no fallback-scan warning, and the
    DiT's and the T5 encoder's blocks stream bit for bit."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, LTXPipeline

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4)
    vae.spatial_compression_ratio, vae.temporal_compression_ratio = 8, 1  # what LTX reads
    transformer = _build(DITS["LTXVideoTransformer3DModel"])
    encoder = _build(ENCODERS["T5EncoderModel"])
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=encoder,
        tokenizer=None,
        transformer=transformer,
    )
    both = dlo.OffloadConfig(mode="layer", components=("dit", "encoder"))
    with caplog.at_level("WARNING", logger="dlo"):
        plan = dlo.resolve_offload_plan(pipe, both)
    assert not [r for r in caplog.records if "declares no components" in r.getMessage()]
    assert (plan.dits, plan.encoders, plan.vaes) == (("transformer",), ("text_encoder",), ("vae",))
    assert [s.container_path for s in plan.stacks] == [
        "transformer.transformer_blocks",
        "text_encoder.encoder.block",
    ]
    assert [s.found_by for s in plan.stacks] == ["_repeated_blocks", "_no_split_modules"]
    ref_dit, ref_encoder = copy.deepcopy(transformer), copy.deepcopy(encoder)
    backend = dlo.enable_offload(pipe, both, device="cpu")
    assert backend is not None
    try:
        for case, model, ref in (
            (DITS["LTXVideoTransformer3DModel"], transformer, ref_dit),
            (ENCODERS["T5EncoderModel"], encoder, ref_encoder),
        ):
            assert _same(_forwards(case, ref, 2), _forwards(case, model, 2)), case.name
    finally:
        backend.disable()
