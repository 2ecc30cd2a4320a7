"""Zoo cases for the transformers text and image encoders that diffusers pipelines load.

Each class is built from a tiny config (2 layers per stack, hidden size 32, vocab 64) and run the
way its pipeline calls it: ``input_ids`` plus an ``attention_mask`` where the pipeline passes one,
``output_hidden_states=True`` where the pipeline reads ``hidden_states``, and ``pixel_values`` for
the image encoders.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
    Gemma2Config,
    Gemma2Model,
    Gemma3TextConfig,
    Gemma3TextModel,
    LlamaConfig,
    LlamaModel,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2Model,
    Qwen3Config,
    Qwen3Model,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from tests.zoo import Case

VOCAB = 64
BATCH = 2
SEQ = 8
IMAGE = 32  # pixel side for the image encoders (patch 8 -> 16 patches)

# Shared decoder-only sizes: hidden 32 = 2 heads x 16, one KV head group of 2 (GQA off).
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
)


def _ids(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _mask() -> torch.Tensor:
    """Right padding: row 0 is full, row 1 has its last 3 tokens padded."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3 :] = 0
    return mask


def clip_ids(g: torch.Generator) -> dict[str, Any]:
    """Prompt tokens then the end token, whose position the CLIP pooler reads."""
    ids = torch.randint(1, VOCAB - 2, (BATCH, SEQ), generator=g)
    ids[:, -1] = VOCAB - 1
    return {"input_ids": ids}


def ids_and_mask(g: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(g), "attention_mask": _mask()}


def pixels(g: torch.Generator) -> dict[str, Any]:
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)}


def with_hidden_states(model: nn.Module, inputs: dict[str, Any]) -> Any:
    """The pipeline reads ``.hidden_states`` (e.g. the second to last layer)."""
    return model(**inputs, output_hidden_states=True)


def build_t5() -> nn.Module:
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu",  # as in T5 v1.1 / the Flux and SD3 checkpoints
        dropout_rate=0.0,
    )
    return T5EncoderModel(config).eval()


def build_umt5() -> nn.Module:
    config = UMT5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
    )
    return UMT5EncoderModel(config).eval()


def _clip_text_config() -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=SEQ,
        projection_dim=16,
        bos_token_id=VOCAB - 2,
        eos_token_id=VOCAB - 1,  # the highest id, as in CLIP; the pooler takes its position
        pad_token_id=0,
    )


def build_clip_text() -> nn.Module:
    return CLIPTextModel(_clip_text_config()).eval()


def build_clip_text_projection() -> nn.Module:
    return CLIPTextModelWithProjection(_clip_text_config()).eval()


def build_qwen2_5_vl() -> nn.Module:
    # mrope_section splits head_dim / 2 = 8 rotary frequencies over (time, height, width)
    mrope = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    text = dict(_DECODER, rope_parameters=mrope, bos_token_id=1, eos_token_id=2)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=32,
        out_hidden_size=32,
        fullatt_block_indexes=[1],
    )
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_llama() -> nn.Module:
    return LlamaModel(LlamaConfig(**_DECODER)).eval()


def build_qwen2() -> nn.Module:
    return Qwen2Model(Qwen2Config(**_DECODER)).eval()


def build_qwen3() -> nn.Module:
    return Qwen3Model(Qwen3Config(**_DECODER, head_dim=16)).eval()


def build_gemma2() -> nn.Module:
    # sliding_window 4 < SEQ so the sliding layer (layer 0) really masks differently from layer 1
    config = Gemma2Config(**_DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=4)
    return Gemma2Model(config).eval()


def build_gemma3() -> nn.Module:
    config = Gemma3TextConfig(
        **_DECODER,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],  # one layer of each rope / mask kind
    )
    return Gemma3TextModel(config).eval()


def build_mistral3() -> nn.Module:
    text = MistralConfig(**_DECODER, head_dim=16)
    vision = PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=8,
    )
    config = Mistral3Config(text_config=text, vision_config=vision)
    return Mistral3ForConditionalGeneration(config).eval()


def build_siglip_vision() -> nn.Module:
    config = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=8,
    )
    return SiglipVisionModel(config).eval()


def build_clip_vision_projection() -> nn.Module:
    config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=8,
        projection_dim=16,
    )
    return CLIPVisionModelWithProjection(config).eval()


CASES: list[Case] = [
    Case("T5EncoderModel", build_t5, ids_and_mask),
    Case("UMT5EncoderModel", build_umt5, ids_and_mask),
    Case("CLIPTextModel", build_clip_text, clip_ids),
    Case("CLIPTextModelWithProjection", build_clip_text_projection, clip_ids),
    Case(
        "Qwen2_5_VLForConditionalGeneration",
        build_qwen2_5_vl,
        ids_and_mask,
        call=with_hidden_states,
        note="text-only, as Qwen-Image calls it: the vision tower (model.visual.blocks) is unused",
    ),
    Case("LlamaModel", build_llama, ids_and_mask, call=with_hidden_states),
    Case("Qwen2Model", build_qwen2, ids_and_mask),
    Case("Qwen3Model", build_qwen3, ids_and_mask, call=with_hidden_states),
    Case("Gemma2Model", build_gemma2, ids_and_mask),
    Case("Gemma3TextModel", build_gemma3, ids_and_mask, call=with_hidden_states),
    Case(
        "Mistral3ForConditionalGeneration",
        build_mistral3,
        ids_and_mask,
        call=with_hidden_states,
        note="text-only, as Flux2 calls it: the Pixtral vision tower and projector are unused",
    ),
    Case("SiglipVisionModel", build_siglip_vision, pixels),
    Case(
        "CLIPVisionModelWithProjection",
        build_clip_vision_projection,
        pixels,
        call=with_hidden_states,  # Wan I2V takes hidden_states[-2]
    ),
]

NOT_BUILT: dict[str, str] = {}
