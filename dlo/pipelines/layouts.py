"""The pipeline folders ``dlo save-pipeline --like`` writes: a diffusers pipeline class and
its components at their published configs (each from the model's ``config.json``), or at a
tiny size CPU tests run (the shapes of diffusers' own tests), with the ``__call__`` sizes
``dlo run --pipeline`` runs them at. :mod:`dlo.pipelines.synth` builds and writes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

FLUX_DEV_TRANSFORMER: dict[str, Any] = {  # black-forest-labs/FLUX.1-dev
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}

WAN_14B_TRANSFORMER: dict[str, Any] = {  # Wan-AI/Wan2.1-T2V-14B-Diffusers
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}

_XXL_T5: dict[str, Any] = {  # google/t5-v1_1-xxl and google/umt5-xxl (vocab aside)
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "tie_word_embeddings": False,
}

_TINY_T5: dict[str, Any] = {
    "d_model": 32,
    "d_ff": 37,
    "d_kv": 8,
    "num_heads": 4,
    "num_layers": 2,
    "vocab_size": 128,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 8,
    "tie_word_embeddings": False,
}

_TINY_WAN: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 256,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}

_FLOW_MATCH = ("FlowMatchEulerDiscreteScheduler", {"shift": 3.0, "use_dynamic_shifting": True})
_UNIPC_FLOW = (
    "UniPCMultistepScheduler",
    {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0},
)


@dataclass(frozen=True)
class Part:
    """One ``nn.Module`` component: ``library.cls(**config)`` (transformers: a config class)."""

    library: str
    cls: str
    config: Mapping[str, Any]


@dataclass(frozen=True)
class FolderLike:
    """A pipeline folder to write: its class, modules, tokenizers and scheduler."""

    name: str
    pipeline: str
    modules: Mapping[str, Part]
    tokenizers: Mapping[str, int]
    """Tokenizer component -> ``model_max_length``."""
    scheduler: tuple[str, Mapping[str, Any]]
    dtype: torch.dtype
    """The dtype the weights are written in unless the caller asks for another."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Other ``__init__`` arguments of the pipeline (Wan 2.2's ``boundary_ratio``)."""
    call: Mapping[str, Any] = field(default_factory=dict)
    """Default ``__call__`` arguments of ``dlo run --pipeline`` (sizes it runs at)."""


def _flux(name: str, transformer: Mapping[str, Any], clip: Part, t5: Part, vae: Part, **kw: Any):
    return FolderLike(
        name,
        "FluxPipeline",
        {
            "transformer": Part("diffusers", "FluxTransformer2DModel", transformer),
            "text_encoder": clip,
            "text_encoder_2": t5,
            "vae": vae,
        },
        {"tokenizer": 77, "tokenizer_2": kw.pop("t5_length", 512)},
        _FLOW_MATCH,
        **kw,
    )


def _wan(name: str, transformers: int, transformer: Mapping[str, Any], t5: Part, vae: Part, **kw):
    modules = {"transformer": Part("diffusers", "WanTransformer3DModel", transformer)}
    if transformers == 2:
        modules["transformer_2"] = modules["transformer"]
    modules.update(text_encoder=t5, vae=vae)
    return FolderLike(
        name, "WanPipeline", modules, {"tokenizer": kw.pop("t5_length", 512)}, _UNIPC_FLOW, **kw
    )


_TINY_VAE = {
    "block_out_channels": (8, 16),
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 8,
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "sample_size": 32,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
_TINY_WAN_VAE = {"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1}
_TINY_CLIP = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 77,
    "projection_dim": 32,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
TINY_FLUX_TRANSFORMER: dict[str, Any] = {  # FLUX's class at a size CPU tests run
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 2,
    "num_single_layers": 3,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "guidance_embeds": True,
    "axes_dims_rope": (4, 6, 6),
}

_TINY_SD3_CLIP = {**_TINY_CLIP, "hidden_act": "gelu", "projection_dim": 32}

FOLDERS: dict[str, FolderLike] = {
    f.name: f
    for f in (
        _flux(
            "flux.1-dev",
            FLUX_DEV_TRANSFORMER,
            Part(
                "transformers",
                "CLIPTextModel",
                {
                    "hidden_size": 768,
                    "intermediate_size": 3072,
                    "num_attention_heads": 12,
                    "num_hidden_layers": 12,
                    "max_position_embeddings": 77,
                    "projection_dim": 768,
                    "hidden_act": "quick_gelu",
                    "vocab_size": 49408,
                    "eos_token_id": 2,
                },
            ),
            Part("transformers", "T5EncoderModel", {**_XXL_T5, "vocab_size": 32128}),
            Part(
                "diffusers",
                "AutoencoderKL",
                {
                    "block_out_channels": (128, 256, 512, 512),
                    "layers_per_block": 2,
                    "latent_channels": 16,
                    "down_block_types": ("DownEncoderBlock2D",) * 4,
                    "up_block_types": ("UpDecoderBlock2D",) * 4,
                    "sample_size": 1024,
                    "scaling_factor": 0.3611,
                    "shift_factor": 0.1159,
                    "use_quant_conv": False,
                    "use_post_quant_conv": False,
                },
            ),
            dtype=torch.bfloat16,
            call={"height": 1024, "width": 1024, "guidance_scale": 3.5},
        ),
        _wan(
            "wan2.1-t2v-14b",
            1,
            WAN_14B_TRANSFORMER,
            Part("transformers", "UMT5EncoderModel", {**_XXL_T5, "vocab_size": 256384}),
            Part("diffusers", "AutoencoderKLWan", {}),  # the class defaults are Wan 2.1's VAE
            dtype=torch.bfloat16,
            call={"height": 480, "width": 832, "num_frames": 81, "guidance_scale": 5.0},
        ),
        _flux(
            "tiny-flux",
            TINY_FLUX_TRANSFORMER,
            Part("transformers", "CLIPTextModel", _TINY_CLIP),
            Part("transformers", "T5EncoderModel", _TINY_T5),
            Part("diffusers", "AutoencoderKL", _TINY_VAE),
            t5_length=16,
            dtype=torch.float32,
            call={"height": 32, "width": 32, "guidance_scale": 3.5, "max_sequence_length": 16},
        ),
        _wan(
            "tiny-wan2.1",
            1,
            _TINY_WAN,
            Part("transformers", "UMT5EncoderModel", _TINY_T5),
            Part("diffusers", "AutoencoderKLWan", _TINY_WAN_VAE),
            t5_length=16,
            dtype=torch.float32,
            call={"height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 16},
        ),
        _wan(
            "tiny-wan2.2",
            2,
            _TINY_WAN,
            Part("transformers", "UMT5EncoderModel", _TINY_T5),
            Part("diffusers", "AutoencoderKLWan", _TINY_WAN_VAE),
            t5_length=16,
            dtype=torch.float32,
            options={"boundary_ratio": 0.875},
            call={"height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 16},
        ),
        FolderLike(
            "tiny-qwen-image",
            "QwenImagePipeline",
            {
                "transformer": Part(
                    "diffusers",
                    "QwenImageTransformer2DModel",
                    {
                        "patch_size": 2,
                        "in_channels": 16,
                        "out_channels": 4,
                        "num_layers": 2,
                        "attention_head_dim": 16,
                        "num_attention_heads": 3,
                        "joint_attention_dim": 16,
                        "guidance_embeds": False,
                        "axes_dims_rope": (8, 4, 4),
                    },
                ),
                "text_encoder": Part(
                    "transformers",
                    "Qwen2_5_VLForConditionalGeneration",
                    {
                        "text_config": {
                            "hidden_size": 16,
                            "intermediate_size": 16,
                            "num_hidden_layers": 2,
                            "num_attention_heads": 2,
                            "num_key_value_heads": 2,
                            "vocab_size": 128,
                            "rope_scaling": {
                                "mrope_section": [1, 1, 2],
                                "rope_type": "default",
                                "type": "default",
                            },
                            "rope_theta": 1000000.0,
                        },
                        "vision_config": {
                            "depth": 2,
                            "hidden_size": 16,
                            "intermediate_size": 16,
                            "num_heads": 2,
                            "out_hidden_size": 16,
                        },
                        "hidden_size": 16,
                        "vocab_size": 128,
                        "vision_start_token_id": 120,
                        "image_token_id": 121,
                        "video_token_id": 122,
                    },
                ),
                "vae": Part(
                    "diffusers",
                    "AutoencoderKLQwenImage",
                    {
                        "base_dim": 24,
                        "z_dim": 4,
                        "dim_mult": [1, 2, 4],
                        "num_res_blocks": 1,
                        "temperal_downsample": [False, True],
                        "latents_mean": [0.0] * 4,
                        "latents_std": [1.0] * 4,
                    },
                ),
            },
            {"tokenizer": 1024},
            _FLOW_MATCH,
            torch.float32,
            call={"height": 32, "width": 32, "max_sequence_length": 16},
        ),
        FolderLike(
            "tiny-hunyuan-video",
            "HunyuanVideoPipeline",
            {
                "transformer": Part(
                    "diffusers",
                    "HunyuanVideoTransformer3DModel",
                    {
                        "in_channels": 4,
                        "out_channels": 4,
                        "num_attention_heads": 2,
                        "attention_head_dim": 10,
                        "num_layers": 2,
                        "num_single_layers": 2,
                        "num_refiner_layers": 1,
                        "patch_size": 1,
                        "patch_size_t": 1,
                        "guidance_embeds": True,
                        "text_embed_dim": 16,
                        "pooled_projection_dim": 8,
                        "rope_axes_dim": (2, 4, 4),
                    },
                ),
                "text_encoder": Part(
                    "transformers",
                    "LlamaModel",
                    {
                        "hidden_size": 16,
                        "intermediate_size": 37,
                        "num_attention_heads": 4,
                        "num_hidden_layers": 2,
                        "vocab_size": 128,
                        "hidden_act": "gelu",
                        "bos_token_id": 0,
                        "eos_token_id": 1,
                        "pad_token_id": 0,
                    },
                ),
                "text_encoder_2": Part(
                    "transformers", "CLIPTextModel", {**_TINY_CLIP, "hidden_size": 8}
                ),
                "vae": Part(
                    "diffusers",
                    "AutoencoderKLHunyuanVideo",
                    {
                        "latent_channels": 4,
                        "down_block_types": ("HunyuanVideoDownBlock3D",) * 4,
                        "up_block_types": ("HunyuanVideoUpBlock3D",) * 4,
                        "block_out_channels": (8, 8, 8, 8),
                        "layers_per_block": 1,
                        "norm_num_groups": 4,
                        "scaling_factor": 0.476986,
                    },
                ),
            },
            {"tokenizer": 512, "tokenizer_2": 77},
            ("FlowMatchEulerDiscreteScheduler", {"shift": 7.0}),
            torch.float32,
            call={"height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 16},
        ),
        FolderLike(
            "tiny-sd3",
            "StableDiffusion3Pipeline",
            {
                "transformer": Part(
                    "diffusers",
                    "SD3Transformer2DModel",
                    {
                        "sample_size": 32,
                        "patch_size": 1,
                        "in_channels": 4,
                        "num_layers": 2,
                        "attention_head_dim": 8,
                        "num_attention_heads": 4,
                        "caption_projection_dim": 32,
                        "joint_attention_dim": 32,
                        "pooled_projection_dim": 64,
                        "out_channels": 4,
                    },
                ),
                "text_encoder": Part("transformers", "CLIPTextModelWithProjection", _TINY_SD3_CLIP),
                "text_encoder_2": Part(
                    "transformers", "CLIPTextModelWithProjection", _TINY_SD3_CLIP
                ),
                "text_encoder_3": Part("transformers", "T5EncoderModel", _TINY_T5),
                "vae": Part(
                    "diffusers",
                    "AutoencoderKL",
                    {
                        "block_out_channels": (4,),
                        "layers_per_block": 1,
                        "latent_channels": 4,
                        "norm_num_groups": 1,
                        "sample_size": 32,
                        "shift_factor": 0.0609,
                        "scaling_factor": 1.5035,
                        "use_quant_conv": False,
                        "use_post_quant_conv": False,
                    },
                ),
            },
            {"tokenizer": 77, "tokenizer_2": 77, "tokenizer_3": 16},
            ("FlowMatchEulerDiscreteScheduler", {"shift": 3.0}),
            torch.float32,
            options={"image_encoder": None, "feature_extractor": None},
            call={"height": 32, "width": 32, "guidance_scale": 5.0, "max_sequence_length": 16},
        ),
    )
}
