"""diffusers transformers stream with no declaration of their own (dlo.plan.adapters).

Each transformer (Flux, Wan, SD3, Qwen-Image) is built from a tiny config with random weights
(``torch.manual_seed``; nothing is downloaded) and must (a) resolve to its registered block
stacks without a warning, (b) run bit for bit like a resident copy under the single-rank
ring, with ``disable`` restoring every tensor, and (c) do the same under DLO (AllGather, 2
gloo ranks). diffusers comes with the ``test`` extra: these tests import it and never skip.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
)
from torch import nn

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.plan.adapters import MODEL_ADAPTERS, PIPELINE_ADAPTERS, class_path, model_adapter
from dlo.platform.device import CpuPlatform
from tests.harness import assert_all_ok, run_ranks
from tests.toys import assert_same, snapshot

Inputs = dict[str, Any]


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], Inputs]
    stacks: dict[str, int]  # container attr -> number of blocks, in execution order


def _flux() -> nn.Module:
    # inner dim 128: a double-stream block is 2.3 MiB, so chunk_mb=1 gives it 3 chunks
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=64,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(16, 24, 24),
    )


def _flux_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": torch.randn(1, 16, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.rand(1, generator=g),
        "img_ids": torch.randn(16, 3, generator=g),
        "txt_ids": torch.zeros(8, 3),
    }


def _wan(num_attention_heads: int = 2) -> nn.Module:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=num_attention_heads,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=256,
        ffn_dim=32,
        num_layers=3,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def _wan_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g),
        "timestep": torch.randint(0, 1000, (1,), generator=g),
        "encoder_hidden_states": torch.randn(1, 8, 16, generator=g),
    }


def _sd3() -> nn.Module:
    # bf16 weights and activations: the ring must not care about the dtype. nn.Module.to, not
    # ModelMixin.to, which warns about fp32-pinned modules even when the class has none
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=16,
    )
    return nn.Module.to(model, torch.bfloat16)


def _sd3_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g).bfloat16(),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g).bfloat16(),
        "pooled_projections": torch.randn(1, 64, generator=g).bfloat16(),
        "timestep": torch.randint(0, 1000, (1,), generator=g),
    }


def _qwen() -> nn.Module:
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4),
    )


def _qwen_inputs(g: torch.Generator) -> Inputs:
    mask = torch.ones(1, 7)
    mask[:, 5:] = 0  # padded text tokens take the masked attention path
    return {
        "hidden_states": torch.randn(1, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, 7, 16, generator=g),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(1, generator=g),
        "img_shapes": [(1, 4, 4)],
    }


CASES = {
    "flux": Case(_flux, _flux_inputs, {"transformer_blocks": 2, "single_transformer_blocks": 3}),
    "wan": Case(_wan, _wan_inputs, {"blocks": 3}),
    "sd3": Case(_sd3, _sd3_inputs, {"transformer_blocks": 3}),
    "qwenimage": Case(_qwen, _qwen_inputs, {"transformer_blocks": 3}),
}
NAMES = list(CASES)


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)  # every rank builds the same weights
    return CASES[name].build().eval()


def _forwards(model: nn.Module, name: str, rank: int, num_steps: int = 2) -> list[torch.Tensor]:
    out = []
    for step in range(num_steps):
        inputs = CASES[name].inputs(torch.Generator().manual_seed(1000 * rank + step))
        with torch.no_grad():
            out.append(model(**inputs, return_dict=False)[0].clone())
    return out


def _dlo_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.split(".")[0] == "dlo"]


# ----------------------------------------------------------------------------- registry
@pytest.mark.parametrize("name", NAMES)
def test_resolves_registered_stacks_without_warnings(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = _build(name)
    assert type(model).__module__.startswith("diffusers.")  # a real diffusers class
    with caplog.at_level(logging.WARNING, logger="dlo"), warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = dlo.resolve_offload_plan(model, dlo.OffloadConfig(mode="layer", components=("dit",)))
    assert plan.warnings == () and not _dlo_records(caplog)
    assert plan.dits == ("",)
    stacks = CASES[name].stacks
    assert [s.container_path for s in plan.stacks] == list(stacks)
    assert [len(s.block_paths) for s in plan.stacks] == list(stacks.values())


def test_lookup_walks_the_mro() -> None:
    class MyFlux(FluxTransformer2DModel):
        pass

    class FSDPModule:  # FSDP2's fully_shard swaps in a dynamic FSDP<Class>(FSDPModule, Class)
        pass

    fsdp_cls = type("FSDPWanTransformer3DModel", (FSDPModule, WanTransformer3DModel), {})
    assert model_adapter(MyFlux) is MODEL_ADAPTERS[class_path(FluxTransformer2DModel)]
    assert model_adapter(fsdp_cls) is MODEL_ADAPTERS[class_path(WanTransformer3DModel)]
    assert model_adapter(nn.Linear) is None


def test_a_declaration_wins_over_the_registry() -> None:
    class FirstStackOnly(FluxTransformer2DModel):
        _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["transformer_blocks"]

    with torch.device("meta"):  # the resolver never looks at tensor data
        model = FirstStackOnly(num_layers=1, num_single_layers=1, num_attention_heads=1)
    plan = dlo.resolve_offload_plan(model, dlo.OffloadConfig(mode="layer"))
    assert [s.container_path for s in plan.stacks] == ["transformer_blocks"]


@pytest.mark.parametrize("key", sorted(PIPELINE_ADAPTERS))
def test_pipeline_entries_match_the_installed_diffusers_source(key: str) -> None:
    # diffusers pipelines import transformers, which the test extra does not install: read
    # the source instead of importing the class
    module, _, qualname = key.rpartition(".")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, key
    source = Path(spec.origin).read_text()
    assert f"\nclass {qualname}(" in source, key
    adapter = PIPELINE_ADAPTERS[key]
    for attr in adapter.dits + adapter.encoders + adapter.vaes:
        assert f"{attr}={attr}," in source, (key, attr)  # self.register_modules(attr=attr, ...)


class FluxPipeline(DiffusionPipeline):
    """Stands in for diffusers' FluxPipeline (the real one needs transformers' encoders)."""

    __module__ = "diffusers.pipelines.flux.pipeline_flux"

    def __init__(self, transformer: nn.Module, vae: nn.Module) -> None:
        super().__init__()
        self.register_modules(
            transformer=transformer,
            vae=vae,
            text_encoder=None,
            text_encoder_2=None,
            image_encoder=None,
        )


class WanPipeline:
    """Stands in for diffusers' WanPipeline (Wan 2.2: two DiTs take turns)."""

    __module__ = "diffusers.pipelines.wan.pipeline_wan"

    def __init__(self) -> None:
        self.transformer = _build("wan")
        self.transformer_2 = _build("wan")
        self.text_encoder = None
        self.vae = None


def test_registered_pipelines_resolve_without_the_fallback_scan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4)
    flux_pipe = FluxPipeline(_build("flux"), vae)
    wan_pipe = WanPipeline()
    explicit = dlo.OffloadConfig(mode="layer", components=("dit",))
    with caplog.at_level(logging.WARNING, logger="dlo"), warnings.catch_warnings():
        warnings.simplefilter("error")
        flux = dlo.resolve_offload_plan(flux_pipe, explicit)
        wan = dlo.resolve_offload_plan(wan_pipe, explicit)
    assert flux.warnings == () and wan.warnings == () and not _dlo_records(caplog)
    # optional components that are None are skipped, not problems
    assert (flux.dits, flux.encoders, flux.vaes) == (("transformer",), (), ("vae",))
    assert [s.container_path for s in flux.stacks] == [
        "transformer.transformer_blocks",
        "transformer.single_transformer_blocks",
    ]
    assert wan.dits == ("transformer", "transformer_2")
    assert [s.container_path for s in wan.stacks] == ["transformer.blocks", "transformer_2.blocks"]

    # both Wan experts share the ring's slots, bit for bit
    ref = copy.deepcopy(wan_pipe)
    backend = dlo.enable_offload(wan_pipe, dlo.OffloadConfig(mode="layer"), device="cpu")
    assert backend is not None
    try:
        for dit in ("transformer", "transformer_2", "transformer"):
            want = _forwards(getattr(ref, dit), "wan", 0, 1)
            got = _forwards(getattr(wan_pipe, dit), "wan", 0, 1)
            assert torch.equal(want[0], got[0]), dit
    finally:
        backend.disable()


# ----------------------------------------------------------------------------- single rank
@pytest.mark.parametrize("name", NAMES)
def test_ring_single_rank_bitwise(name: str) -> None:
    model = _build(name)
    ref = copy.deepcopy(model)
    before = snapshot(model)
    backend = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer", chunk_mb=1), device="cpu")
    assert backend is not None
    try:
        want, got = _forwards(ref, name, 0), _forwards(model, name, 0)
        st = backend.stats()
    finally:
        backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert st["num_streamed_blocks"] == sum(CASES[name].stacks.values())
    assert st["h2d_nbytes"] > 0
    assert_same(before, model)


# ----------------------------------------------------------------------------- DLO, 2 ranks
def _dlo_parity(rank: int, world: int, name: str) -> dict[str, Any]:
    model = _build(name)
    want = _forwards(copy.deepcopy(model), name, rank)
    cfg = dlo.OffloadConfig(mode="layer", transfer="allgather", chunk_mb=1, collective_timeout_s=30)
    backend = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    backend.enable(model)
    try:
        got = _forwards(model, name, rank)
        st = backend.stats()
        max_chunks = max(b.layout.num_chunks for b in backend._blocks)
    finally:
        backend.disable()
    return {
        "same": all(torch.equal(a, b) for a, b in zip(want, got, strict=True)),
        "group_size": st["group_size"],
        "allgather_nbytes": st["allgather_nbytes"],
        "max_chunks": max_chunks,
    }


@pytest.mark.parametrize("name", NAMES)
def test_dlo_allgather_two_ranks_bitwise(name: str) -> None:
    results = assert_all_ok(run_ranks(_dlo_parity, 2, name, timeout_s=120))
    for r in results:
        assert r["same"] and r["group_size"] == 2 and r["allgather_nbytes"] > 0, r
    if name == "flux":
        assert all(r["max_chunks"] > 1 for r in results)  # a block moved as several chunks
