"""Zoo cases, diffusers DiT classes (part b): Bria .. HunyuanVideo15, each at a tiny size.

Every block stack gets at least two blocks, and the inputs make every stack run (the optional
control / reference / history inputs are given). Parameters that the library initialises to
zero (gates, output projections, learnable positions) are redrawn at random in ``_finish`` so
that every block changes the output.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_bria import BriaTransformer2DModel
from diffusers.models.transformers.transformer_bria_fibo import BriaFiboTransformer2DModel
from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2Transformer2DModel
from diffusers.models.transformers.transformer_chroma import ChromaTransformer2DModel
from diffusers.models.transformers.transformer_chronoedit import ChronoEditTransformer3DModel
from diffusers.models.transformers.transformer_cogview3plus import CogView3PlusTransformer2DModel
from diffusers.models.transformers.transformer_cogview4 import CogView4Transformer2DModel
from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
from diffusers.models.transformers.transformer_easyanimate import EasyAnimateTransformer3DModel
from diffusers.models.transformers.transformer_ernie_image import ErnieImageTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.models.transformers.transformer_flux3 import Flux3Transformer2DModel
from diffusers.models.transformers.transformer_glm_image import GlmImageTransformer2DModel
from diffusers.models.transformers.transformer_helios import HeliosTransformer3DModel
from diffusers.models.transformers.transformer_hidream_image import HiDreamImageTransformer2DModel
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformer3DModel
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15Transformer3DModel,
)
from torch import nn

from tests.zoo import Case

Inputs = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# helpers


def _finish(model: nn.Module) -> nn.Module:
    """Redraw all-zero parameters (zero-initialised gates / heads) so every block matters."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.normal_(0.0, 0.02)
    return model.float().eval()


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _timestep(g: torch.Generator, scale: float = 1000.0) -> torch.Tensor:
    return torch.rand(1, generator=g) * scale


def _grid_ids(h: int, w: int, n_axes: int = 3, first: float = 0.0) -> torch.Tensor:
    """``(h * w, n_axes)`` position ids: axis 0 = ``first``, axes 1 and 2 = row and column."""
    ids = torch.zeros(h, w, n_axes)
    ids[..., 0] = first
    ids[..., 1] = torch.arange(h)[:, None].float()
    ids[..., 2] = torch.arange(w)[None, :].float()
    return ids.reshape(h * w, n_axes)


def _mask(n: int, valid: int) -> torch.Tensor:
    """A ``(1, n)`` int mask with the first ``valid`` entries set."""
    m = torch.zeros(1, n, dtype=torch.long)
    m[:, :valid] = 1
    return m


# ---------------------------------------------------------------------------------------------
# Bria


def _bria() -> nn.Module:
    return _finish(
        BriaTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=[4, 6, 6],
        )
    )


def _bria_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 32),
        "timestep": _timestep(g),
        "img_ids": _grid_ids(4, 4),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": False,
    }


def _bria_fibo() -> nn.Module:
    return _finish(
        BriaFiboTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=[4, 6, 6],
            text_encoder_dim=16,
        )
    )


def _bria_fibo_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 32),
        # one text-encoder layer per block (2 double + 2 single), each through caption_projection
        "text_encoder_layers": [_randn(g, 1, 8, 16) for _ in range(4)],
        "timestep": _timestep(g),
        "img_ids": _grid_ids(4, 4),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": False,
    }


def _bria_fibo2() -> nn.Module:
    return _finish(
        BriaFibo2Transformer2DModel(
            in_channels=4,
            patch_size=2,
            dim=32,
            n_layers=3,
            n_refiner_layers=2,
            n_heads=2,
            cap_feat_dim=16,
            injection_layer_ids=(1,),
            perceiver_num_layers=2,
            min_num_gist_tokens=4,
            max_num_gist_tokens=8,
            gist_step=4,
            gist_min_text_len=4,
            gist_max_text_len=16,
            axes_dims=(4, 6, 6),
            axes_lens=(16, 8, 8),
        )
    )


def _bria_fibo2_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.rand(1, generator=g),
        # bundle 0 feeds the perceiver, bundle 1 the injection block (layer 1)
        "encoder_hidden_states": _randn(g, 1, 2, 8, 16),
        # a context image gives the noise refiner its per-token (noisy / clean) modulation
        "context_latents": [_randn(g, 1, 4, 4, 4)],
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------
# Chroma, ChronoEdit


def _chroma() -> nn.Module:
    return _finish(
        ChromaTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
            approximator_num_channels=16,
            approximator_hidden_dim=32,
            approximator_layers=2,
        )
    )


def _chroma_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 32),
        "timestep": torch.rand(1, generator=g),
        "img_ids": _grid_ids(4, 4),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": False,
    }


def _chronoedit() -> nn.Module:
    return _finish(
        ChronoEditTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,  # a multiple of 6 keeps the t / h / w RoPE splits consistent
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=32,
            ffn_dim=48,
            num_layers=2,
            image_dim=16,
            added_kv_proj_dim=24,
            rope_max_seq_len=32,
        )
    )


def _chronoedit_inputs(g: torch.Generator) -> Inputs:
    return {
        # two frames: ChronoEdit's temporal-skip RoPE path
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": _timestep(g),
        # the image-attention processor takes the text context as the last 512 tokens
        "encoder_hidden_states": _randn(g, 1, 512, 16),
        "encoder_hidden_states_image": _randn(g, 1, 4, 16),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------
# CogView


def _cogview3plus() -> nn.Module:
    return _finish(
        CogView3PlusTransformer2DModel(
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            out_channels=4,
            text_embed_dim=16,
            time_embed_dim=32,
            condition_dim=8,
            pos_embed_max_size=8,
            sample_size=8,
        )
    )


def _cogview_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "timestep": _timestep(g),
        "original_size": torch.tensor([[64.0, 64.0]]),
        "target_size": torch.tensor([[64.0, 64.0]]),
        "crop_coords": torch.tensor([[0.0, 0.0]]),
        "return_dict": False,
    }


def _cogview4() -> nn.Module:
    return _finish(
        CogView4Transformer2DModel(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            text_embed_dim=16,
            time_embed_dim=32,
            condition_dim=8,
            pos_embed_max_size=8,
            sample_size=8,
            rope_axes_dim=(8, 8),
        )
    )


# ---------------------------------------------------------------------------------------------
# Cosmos


def _cosmos() -> nn.Module:
    return _finish(
        CosmosTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=2,
            mlp_ratio=2.0,
            text_embed_dim=16,
            adaln_lora_dim=8,
            max_size=(4, 16, 16),
            patch_size=(1, 2, 2),
            concat_padding_mask=False,  # the padding-mask resize needs torchvision
        )
    )


def _cosmos_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.rand(1, generator=g),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "fps": 24,
        "return_dict": False,
    }


def _cosmos3() -> nn.Module:
    return _finish(
        Cosmos3OmniTransformer(
            head_dim=16,
            hidden_size=32,
            intermediate_size=64,
            latent_channel=4,
            latent_patch_size=2,
            num_attention_heads=2,
            num_hidden_layers=2,
            num_key_value_heads=1,
            patch_latent_dim=16,  # latent_patch_size**2 * latent_channel
            vocab_size=64,
            rope_axes_dim=(4, 2, 2),  # sums to head_dim // 2
        )
    )


def _cosmos3_inputs(g: torch.Generator) -> Inputs:
    # joint sequence: 4 text tokens (the causal "und" prefix), then 2x2x2 = 8 vision patches
    n_text, n_vis = 4, 8
    seq = n_text + n_vis
    return {
        "input_ids": torch.randint(0, 64, (n_text,), generator=g),
        "text_indexes": torch.arange(n_text),
        "position_ids": torch.arange(seq).unsqueeze(0).expand(3, -1).contiguous(),
        "und_len": n_text,
        "sequence_length": seq,
        "vision_tokens": [_randn(g, 1, 4, 2, 4, 4)],
        "vision_token_shapes": [(2, 2, 2)],
        "vision_sequence_indexes": torch.arange(n_text, seq),
        "vision_mse_loss_indexes": torch.arange(n_text, seq),
        "vision_timesteps": torch.rand(n_vis, generator=g) * 1000,
        "vision_noisy_frame_indexes": [torch.arange(2)],
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------
# EasyAnimate, ErnieImage


def _easyanimate() -> nn.Module:
    return _finish(
        EasyAnimateTransformer3DModel(
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            patch_size=2,
            sample_width=8,
            sample_height=8,
            num_layers=2,
            mmdit_layers=2,
            time_embed_dim=32,
            text_embed_dim=16,
            text_embed_dim_t5=16,
        )
    )


def _easyanimate_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": _timestep(g),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "encoder_hidden_states_t5": _randn(g, 1, 6, 16),
        "return_dict": False,
    }


def _ernie_image() -> nn.Module:
    return _finish(
        ErnieImageTransformer2DModel(
            hidden_size=32,
            num_attention_heads=2,
            num_layers=2,
            ffn_hidden_size=64,
            in_channels=4,
            out_channels=4,
            patch_size=2,
            text_in_dim=16,
            rope_axes_dim=(4, 6, 6),
        )
    )


def _ernie_image_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": _timestep(g),
        "text_bth": _randn(g, 1, 6, 16),
        "text_lens": torch.tensor([5]),  # one padded text token, masked out
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------
# Flux


def _flux() -> nn.Module:
    return _finish(
        FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
    )


def _flux_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 32),
        "pooled_projections": _randn(g, 1, 16),
        "timestep": torch.rand(1, generator=g),
        "img_ids": _grid_ids(4, 4),
        "txt_ids": torch.zeros(8, 3),
        "guidance": torch.tensor([3.5]),
        "return_dict": False,
    }


def _flux2() -> nn.Module:
    return _finish(
        Flux2Transformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=True,
        )
    )


def _flux2_inputs(g: torch.Generator) -> Inputs:
    txt_ids = torch.zeros(8, 4)
    txt_ids[:, 3] = torch.arange(8).float()
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 32),
        "timestep": torch.rand(1, generator=g),
        "img_ids": _grid_ids(4, 4, n_axes=4),
        "txt_ids": txt_ids,
        "guidance": torch.tensor([4.0]),
        "return_dict": False,
    }


def _flux3() -> nn.Module:
    return _finish(
        Flux3Transformer2DModel(
            in_channels=16,
            cond_in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            timestep_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
            flow_map=True,
        )
    )


def _flux3_inputs(g: torch.Generator) -> Inputs:
    txt_ids = torch.zeros(8, 4)
    txt_ids[:, 3] = torch.arange(8).float()
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 32),
        "timestep": torch.rand(1, generator=g),
        "img_ids": _grid_ids(4, 4, n_axes=4),
        "txt_ids": txt_ids,
        # a reference image makes mode_blocks["image_cond"] run
        "image_cond_hidden_states": _randn(g, 1, 4, 16),
        "image_cond_ids": _grid_ids(2, 2, n_axes=4, first=1.0),
        "target_timestep": torch.rand(1, generator=g),  # flow-map model
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------
# GlmImage, Helios, HiDream


def _glm_image() -> nn.Module:
    return _finish(
        GlmImageTransformer2DModel(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            text_embed_dim=16,
            time_embed_dim=32,
            condition_dim=8,
            prior_vq_quantizer_codebook_size=64,
        )
    )


def _glm_image_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "prior_token_id": torch.randint(0, 64, (1, 16), generator=g),  # one per image token
        "prior_token_drop": torch.zeros(1, 16, dtype=torch.bool),
        "timestep": _timestep(g),
        "target_size": torch.tensor([[64.0, 64.0]]),
        "crop_coords": torch.tensor([[0.0, 0.0]]),
        "return_dict": False,
    }


def _helios() -> nn.Module:
    return _finish(
        HeliosTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            rope_dim=(4, 6, 6),
            is_amplify_history=True,
        )
    )


def _helios_inputs(g: torch.Generator) -> Inputs:
    # the short / mid / long history latents make patch_short / patch_mid / patch_long run
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": _timestep(g),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "indices_hidden_states": torch.tensor([[7, 8]]),
        "indices_latents_history_short": torch.tensor([[6]]),
        "indices_latents_history_mid": torch.tensor([[4, 5]]),
        "indices_latents_history_long": torch.tensor([[0, 1, 2, 3]]),
        "latents_history_short": _randn(g, 1, 4, 1, 8, 8),
        "latents_history_mid": _randn(g, 1, 4, 2, 8, 8),
        "latents_history_long": _randn(g, 1, 4, 4, 8, 8),
        "return_dict": False,
    }


def _hidream() -> nn.Module:
    return _finish(
        HiDreamImageTransformer2DModel(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            caption_channels=[16, 16],  # [t5, llama]
            text_emb_dim=16,
            num_routed_experts=4,
            num_activated_experts=2,
            axes_dims_rope=(4, 6, 6),
            max_resolution=(16, 16),
            llama_layers=[0, 1, 2, 3],  # one llama layer per block (2 double + 2 single)
        )
    )


def _hidream_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timesteps": _timestep(g),
        "encoder_hidden_states_t5": _randn(g, 1, 8, 16),
        "encoder_hidden_states_llama3": _randn(g, 4, 1, 6, 16),
        "pooled_embeds": _randn(g, 1, 16),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------
# HunyuanVideo


def _hunyuan_video() -> nn.Module:
    return _finish(
        HunyuanVideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=2,
            mlp_ratio=2.0,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=16,
            pooled_projection_dim=16,
            rope_axes_dim=(4, 6, 6),
        )
    )


def _hunyuan_video_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": _timestep(g),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "encoder_attention_mask": _mask(8, 6),
        "pooled_projections": _randn(g, 1, 16),
        "guidance": torch.tensor([6000.0]),
        "return_dict": False,
    }


def _hunyuan_video15() -> nn.Module:
    # context_embedder_2 (ByT5 projection) has a hard-coded 2048 hidden width: ~4.3 M of the params
    return _finish(
        HunyuanVideo15Transformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=2,
            num_refiner_layers=2,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            text_embed_dim=16,
            text_embed_2_dim=16,
            image_embed_dim=16,
            rope_axes_dim=(4, 6, 6),
            use_meanflow=True,
        )
    )


def _hunyuan_video15_inputs(g: torch.Generator) -> Inputs:
    return {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "timestep": _timestep(g),  # float: the time embedding casts to the timestep's dtype
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "encoder_attention_mask": _mask(8, 6),
        "timestep_r": _timestep(g),
        "encoder_hidden_states_2": _randn(g, 1, 6, 16),
        "encoder_attention_mask_2": _mask(6, 4),
        "image_embeds": _randn(g, 1, 4, 16),  # nonzero: the image-to-video path
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------

CASES: list[Case] = [
    Case("BriaTransformer2DModel", _bria, _bria_inputs),
    Case("BriaFiboTransformer2DModel", _bria_fibo, _bria_fibo_inputs),
    Case("BriaFibo2Transformer2DModel", _bria_fibo2, _bria_fibo2_inputs),
    Case("ChromaTransformer2DModel", _chroma, _chroma_inputs),
    Case("ChronoEditTransformer3DModel", _chronoedit, _chronoedit_inputs),
    Case("CogView3PlusTransformer2DModel", _cogview3plus, _cogview_inputs),
    Case("CogView4Transformer2DModel", _cogview4, _cogview_inputs),
    Case("CosmosTransformer3DModel", _cosmos, _cosmos_inputs),
    Case("Cosmos3OmniTransformer", _cosmos3, _cosmos3_inputs),
    Case("EasyAnimateTransformer3DModel", _easyanimate, _easyanimate_inputs),
    Case("ErnieImageTransformer2DModel", _ernie_image, _ernie_image_inputs),
    Case("FluxTransformer2DModel", _flux, _flux_inputs),
    Case("Flux2Transformer2DModel", _flux2, _flux2_inputs),
    Case("Flux3Transformer2DModel", _flux3, _flux3_inputs),
    Case("GlmImageTransformer2DModel", _glm_image, _glm_image_inputs),
    Case("HeliosTransformer3DModel", _helios, _helios_inputs),
    Case("HiDreamImageTransformer2DModel", _hidream, _hidream_inputs),
    Case("HunyuanVideoTransformer3DModel", _hunyuan_video, _hunyuan_video_inputs),
    Case("HunyuanVideo15Transformer3DModel", _hunyuan_video15, _hunyuan_video15_inputs),
]

NOT_BUILT: dict[str, str] = {}
