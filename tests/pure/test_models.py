"""The embedded default pipeline: it runs, it is deterministic, and its counts are right.

Only ``tiny`` (and tiny variants) is ever materialized; ``medium`` and ``wan14b-like`` are
built on the ``meta`` device to check the arithmetic counts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.models import (
    PRESETS,
    DemoPipeline,
    DiT,
    DiTBlock,
    Preset,
    build_pipeline,
    get_preset,
    make_inputs,
)
from dlo.plan.declarations import OffloadPlan, SupportsComponentDiscovery
from dlo.plan.topology import resolve_offload_plan

TINY = PRESETS["tiny"]
TINY_DIT_STYLE = dataclasses.replace(
    TINY, name="tiny-dit", modulation="linear", cross_attention=False
)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones included), by name."""
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().flatten().view(torch.uint8).numpy())


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _block_tensors(block: torch.nn.Module) -> list[torch.Tensor]:
    return [*block.parameters(), *block.buffers()]


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", [TINY, TINY_DIT_STYLE], ids=["tiny", "tiny-dit"])
def test_generate_end_to_end(preset: Preset, dtype: torch.dtype) -> None:
    pipe = build_pipeline(preset, dtype=dtype, seed=0)
    ids, latents = make_inputs(preset, batch=2, seed=0, dtype=dtype)
    assert ids.shape == (2, preset.text_len) and ids.dtype == torch.int64
    assert latents.shape == (2, 64, preset.latent_channels) and latents.dtype == dtype

    image = pipe.generate(ids, latents, steps=6)
    side = 8 * 2**preset.vae_upsamples
    assert image.shape == (2, 3, side, side)
    assert image.dtype == dtype
    assert torch.isfinite(image).all()
    assert image.float().std() > 0


def test_generate_video_grid() -> None:
    pipe = build_pipeline("tiny", dtype=torch.float32)
    ids, latents = make_inputs("tiny", tokens=2 * 4 * 8, dtype=torch.float32)
    video = pipe.generate(ids, latents, steps=2, grid=(2, 4, 8))
    assert video.shape == (1, 3, 2, 16, 32)
    with pytest.raises(ValueError, match="grid"):
        pipe.decode(latents, grid=(3, 5))
    _, odd = make_inputs("tiny", tokens=10, dtype=torch.float32)
    with pytest.raises(ValueError, match="square"):
        pipe.decode(odd)


def test_many_steps_stay_finite_in_bf16() -> None:
    pipe = build_pipeline("tiny", dtype=torch.bfloat16)
    ids, latents = make_inputs("tiny", batch=1, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = pipe.denoise(latents, pipe.encode(ids), steps=50)
    assert torch.isfinite(out).all()


def test_text_conditions_the_output() -> None:
    for preset in (TINY, TINY_DIT_STYLE):
        pipe = build_pipeline(preset, dtype=torch.float32)
        ids, latents = make_inputs(preset, dtype=torch.float32, seed=0)
        other_ids, _ = make_inputs(preset, dtype=torch.float32, seed=1)
        a = pipe.generate(ids, latents, steps=2)
        b = pipe.generate(other_ids, latents, steps=2)
        assert not torch.equal(a, b), preset.name


def test_denoise_calls_transformer_once_per_step() -> None:
    pipe = build_pipeline("tiny", dtype=torch.float32)
    ids, latents = make_inputs("tiny", batch=3, dtype=torch.float32)
    seen: list[torch.Tensor] = []

    def record(module, args):
        seen.append(args[1].clone())

    handle = pipe.transformer.register_forward_pre_hook(record)
    try:
        with torch.inference_mode():
            pipe.denoise(latents, pipe.encode(ids), steps=4)
    finally:
        handle.remove()
    assert [t.tolist() for t in seen] == [[v] * 3 for v in (1000.0, 750.0, 500.0, 250.0)]
    with pytest.raises(ValueError, match="steps"):
        pipe.denoise(latents, pipe.encode(ids), steps=0)


# ----------------------------------------------------------------------------- determinism
def test_same_seed_same_bits_different_seed_differs() -> None:
    a = _tensors(build_pipeline("tiny", seed=3))
    # an unrelated build in between, and another thread count, change nothing
    build_pipeline(dataclasses.replace(TINY, name="other", dim=32, num_heads=2), seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b = _tensors(build_pipeline("tiny", seed=3))
    finally:
        torch.set_num_threads(threads)
    c = _tensors(build_pipeline("tiny", seed=4))

    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype
        assert _bytes(a[name]) == _bytes(b[name]), name
    random = [n for n, t in a.items() if t.float().std() > 0 and not n.endswith("rope_freqs")]
    assert random
    for name in random:
        assert _bytes(a[name]) != _bytes(c[name]), name


def test_state_dict_bytes_identical() -> None:
    a = build_pipeline("tiny", seed=0).state_dict()
    b = build_pipeline("tiny", seed=0).state_dict()
    assert [_bytes(t) for t in a.values()] == [_bytes(t) for t in b.values()]


def test_make_inputs_deterministic() -> None:
    ids_a, lat_a = make_inputs("tiny", batch=2, seed=5, dtype=torch.bfloat16)
    ids_b, lat_b = make_inputs("tiny", batch=2, seed=5, dtype=torch.bfloat16)
    ids_c, _ = make_inputs("tiny", batch=2, seed=6, dtype=torch.bfloat16)
    assert torch.equal(ids_a, ids_b) and _bytes(lat_a) == _bytes(lat_b)
    assert not torch.equal(ids_a, ids_c)
    assert ids_a.max() < TINY.vocab


def test_initial_scales_are_sensible() -> None:
    pipe = build_pipeline("tiny", dtype=torch.float32)
    block = pipe.transformer.blocks[0]
    assert torch.count_nonzero(block.attn.qkv.bias) == 0
    assert 0.015 < block.attn.qkv.weight.std() < 0.025
    assert torch.equal(block.norm_cross.weight, torch.ones_like(block.norm_cross.weight))
    assert block.modulation.abs().max() < 0.2


# ----------------------------------------------------------------------------- counts
@pytest.mark.parametrize("preset", [TINY, TINY_DIT_STYLE], ids=["tiny", "tiny-dit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_counts_match_a_built_model(preset: Preset, dtype: torch.dtype) -> None:
    pipe = build_pipeline(preset, dtype=dtype)
    for component in ("text_encoder", "transformer", "vae"):
        numel = sum(p.numel() for p in getattr(pipe, component).parameters())
        assert numel == preset.num_params(component), component
    assert sum(p.numel() for p in pipe.parameters()) == preset.num_params()
    for block in pipe.transformer.blocks:
        assert sum(p.numel() for p in block.parameters()) == preset.block_num_params()
        assert _nbytes(_block_tensors(block)) == preset.block_nbytes(dtype)
    assert len(pipe.transformer.blocks) == preset.num_blocks


@pytest.mark.parametrize("name", ["medium", "wan14b-like"])
def test_counts_match_a_meta_skeleton(name: str) -> None:
    preset = PRESETS[name]
    pipe = build_pipeline(name, device="meta")
    assert all(t.is_meta for t in _tensors(pipe).values())
    for component in ("text_encoder", "transformer", "vae"):
        numel = sum(p.numel() for p in getattr(pipe, component).parameters())
        assert numel == preset.num_params(component), component
    block = pipe.transformer.blocks[0]
    assert len(pipe.transformer.blocks) == preset.num_blocks
    assert sum(p.numel() for p in block.parameters()) == preset.block_num_params()
    assert _nbytes(_block_tensors(block)) == preset.block_nbytes(torch.bfloat16)


def test_medium_block_is_about_340_mb_in_bf16() -> None:
    medium = PRESETS["medium"]
    assert medium.dim == 3072 and medium.num_blocks == 24 and not medium.cross_attention
    assert abs(medium.block_num_params() - 18 * medium.dim**2) / (18 * medium.dim**2) < 0.001
    assert abs(medium.block_nbytes(torch.bfloat16) - 340e6) / 340e6 < 0.05


def test_wan14b_like_is_about_14b_params() -> None:
    pipe = build_pipeline("wan14b-like", device="meta")
    total = sum(p.numel() for p in pipe.parameters())
    assert total == PRESETS["wan14b-like"].num_params()
    assert 13.5e9 <= total <= 14.5e9
    assert 13.5e9 <= PRESETS["wan14b-like"].num_params("transformer") <= 14.5e9


# ----------------------------------------------------------------------------- block contents
def test_dit_block_holds_mixed_dtypes() -> None:
    block = build_pipeline("tiny", dtype=torch.bfloat16).transformer.blocks[0]
    assert block.attn.qkv.weight.dtype == torch.bfloat16
    assert block.mlp.fc1.weight.dtype == torch.bfloat16
    assert block.modulation.dtype == torch.bfloat16
    assert block.norm_cross.weight.dtype == torch.float32
    assert block.norm_cross.bias.dtype == torch.float32
    assert block.rope_freqs.dtype == torch.float32
    assert {t.dtype for t in _block_tensors(block)} == {torch.bfloat16, torch.float32}


def test_non_persistent_buffer_is_present_and_used() -> None:
    pipe = build_pipeline("tiny", dtype=torch.float32)
    block = pipe.transformer.blocks[0]
    assert "rope_freqs" in dict(block.named_buffers())
    assert "rope_freqs" not in block.state_dict()
    assert torch.equal(
        block.rope_freqs, build_pipeline("tiny", seed=9).transformer.blocks[0].rope_freqs
    )

    x = torch.randn(1, 64, TINY.dim)
    t = torch.randn(1, 6, TINY.dim)
    context = torch.randn(1, 16, TINY.dim)
    with torch.inference_mode():
        before = block(x, t, context)
        saved = block.rope_freqs.clone()
        block.rope_freqs.zero_()
        after = block(x, t, context)
        block.rope_freqs.copy_(saved)
        again = block(x, t, context)
    assert not torch.allclose(before, after)
    assert torch.equal(before, again)


# ----------------------------------------------------------------------------- declarations
def test_declarations() -> None:
    assert DemoPipeline._dit_modules == ["transformer"]
    assert DemoPipeline._encoder_modules == ["text_encoder"]
    assert DemoPipeline._vae_modules == ["vae"]
    assert DemoPipeline._resident_modules == []
    plan = DemoPipeline._offload_plan
    assert isinstance(plan, OffloadPlan)
    assert dict(plan.block_attrs) == {"transformer": ("blocks",)}
    assert dict(plan.encoder_block_attrs) == {"text_encoder": ("layers",)}
    assert plan.encoder_dlo_weight_replication == ("text_encoder",)
    assert DiT._layerwise_offload_blocks_attrs == ["blocks"]

    pipe = build_pipeline("tiny", device="meta")
    assert isinstance(pipe, SupportsComponentDiscovery)
    assert all(isinstance(b, DiTBlock) for b in pipe.transformer.blocks)
    assert len(pipe.text_encoder.layers) == TINY.text_layers


def test_offload_plan_resolves_strictly() -> None:
    pipe = build_pipeline("tiny", device="meta")
    cfg = OffloadConfig(mode="layer", components=("dit", "encoder"))
    resolved = resolve_offload_plan(pipe, cfg, ParallelConfig())
    paths = {s.component: s.block_paths for s in resolved.stacks}
    assert paths["dit"] == tuple(f"transformer.blocks.{i}" for i in range(TINY.num_blocks))
    assert paths["encoder"] == tuple(f"text_encoder.layers.{i}" for i in range(TINY.text_layers))


# ----------------------------------------------------------------------------- bad input
def test_unknown_preset_names_value_and_known() -> None:
    with pytest.raises(ValueError, match="huge") as info:
        build_pipeline("huge")
    for name in PRESETS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="huge"):
        make_inputs("huge")
    with pytest.raises(TypeError):
        get_preset(3)  # type: ignore[arg-type]


def test_bad_dtype_and_bad_preset_fields() -> None:
    with pytest.raises(TypeError, match="dtype"):
        build_pipeline("tiny", dtype=torch.int32)
    with pytest.raises(ValueError, match="modulation"):
        dataclasses.replace(TINY, modulation="film")
    with pytest.raises(ValueError, match="num_heads"):
        dataclasses.replace(TINY, num_heads=3)
    with pytest.raises(ValueError, match="text_len"):
        build_pipeline("tiny", dtype=torch.float32).encode(
            torch.zeros(1, TINY.text_len + 1, dtype=torch.long)
        )


# ----------------------------------------------------------------------------- device
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_same_bits_on_cuda_as_on_cpu() -> None:
    cpu = _tensors(build_pipeline("tiny", seed=2))
    cuda = _tensors(build_pipeline("tiny", seed=2, device="cuda"))
    for name, t in cpu.items():
        assert cuda[name].device.type == "cuda"
        assert _bytes(t) == _bytes(cuda[name].cpu()), name
