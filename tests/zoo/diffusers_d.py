"""Zoo cases, part D: diffusers DiT classes from OmniGen to Z-Image, each at a tiny size.

Every case builds the class from a tiny config (random weights from torch's global generator)
and draws forward inputs that make every block stack of the model run.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_omnigen import OmniGenTransformer2DModel
from diffusers.models.transformers.transformer_ovis_image import OvisImageTransformer2DModel
from diffusers.models.transformers.transformer_prx import PRXTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_rfd4_proteina import RFD4ProteinaTransformer
from diffusers.models.transformers.transformer_sana_video import SanaVideoTransformer3DModel
from diffusers.models.transformers.transformer_sana_wm import SanaWMTransformer3DModel
from diffusers.models.transformers.transformer_sana_wm_refiner import (
    SanaWMLTX2RefinerTransformer3DModel,
)
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2Transformer3DModel
from diffusers.models.transformers.transformer_stable_audio3 import StableAudio3DiTModel
from diffusers.models.transformers.transformer_temporal import TransformerTemporalModel
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan_animate import WanAnimateTransformer3DModel
from diffusers.models.transformers.transformer_wan_animate_2 import (
    WanAnimate2KVCache,
    WanAnimate2Transformer3DModel,
)
from diffusers.models.transformers.transformer_wan_vace import WanVACETransformer3DModel
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
from torch import nn

from tests.zoo import Case

# The Wan-family cross-attention splits image tokens off the front of the context by assuming
# the text part is exactly 512 tokens long (hardcoded in the attention processor).
WAN_TEXT_LEN = 512


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


# --- OmniGen ---------------------------------------------------------------------------------


def _omnigen_build() -> nn.Module:
    return OmniGenTransformer2DModel(
        in_channels=4,
        patch_size=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_layers=2,
        vocab_size=64,
        pad_token_id=0,
        rope_scaling={"short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
        pos_embed_max_size=16,
        time_step_dim=32,
    ).eval()


def _omnigen_inputs(g: torch.Generator) -> dict[str, Any]:
    # 10 text tokens, of which 2..5 are replaced by a 4x4 input-image latent (4 patches),
    # then the time token and 16 output-image patches: 27 tokens in all.
    seq = 10 + 1 + 16
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.rand(1, generator=g),
        "input_ids": torch.randint(1, 64, (1, 10), generator=g),
        "input_img_latents": [_randn(g, 1, 4, 4, 4)],
        "input_image_sizes": {0: [[2, 6]]},
        "attention_mask": torch.ones(1, seq, seq),
        "position_ids": torch.arange(seq)[None],
        "return_dict": False,
    }


# --- Ovis-Image ------------------------------------------------------------------------------


def _ovis_build() -> nn.Module:
    return OvisImageTransformer2DModel(
        patch_size=1,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def _image_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def _ovis_inputs(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "timestep": torch.rand(1, generator=g),
        "img_ids": _image_ids(4, 4),
        "txt_ids": torch.zeros(6, 3),
        "return_dict": False,
    }


# --- PRX -------------------------------------------------------------------------------------


def _prx_build() -> nn.Module:
    return PRXTransformer2DModel(
        in_channels=4,
        patch_size=2,
        context_in_dim=24,
        hidden_size=32,
        mlp_ratio=2.0,
        num_heads=2,
        depth=2,
        axes_dim=[8, 8],
    ).eval()


def _prx_inputs(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.rand(1, generator=g),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "attention_mask": torch.ones(1, 6, dtype=torch.bool),
        "return_dict": False,
    }


# --- Qwen-Image ------------------------------------------------------------------------------


def _qwenimage_build() -> nn.Module:
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def _qwenimage_inputs(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "encoder_hidden_states_mask": torch.ones(1, 6),
        "timestep": torch.rand(1, generator=g),
        "img_shapes": [[(1, 4, 4)]],
        "return_dict": False,
    }


# --- Qwen-Image 2.1 --------------------------------------------------------------------------


def _qwenimage21_build() -> nn.Module:
    return QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=8,
        out_channels=8,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=24,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def _qwenimage21_inputs(g: torch.Generator) -> dict[str, Any]:
    # One condition image (2x2 latent tokens = 1 VLM slot) between text tokens, then the
    # 2x4 target image (2 slots) appended after the text: the VLM sequence is 6 + 2 slots.
    img_mask = torch.tensor([[False, False, False, True, False, False, True, True]])
    return {
        "hidden_states": _randn(g, 1, 4 + 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "timestep": torch.rand(1, generator=g),
        "img_shapes": [[(1, 2, 2), (1, 2, 4)]],
        "img_mask": img_mask,
        "encoder_hidden_states_mask": torch.ones(1, 6, dtype=torch.bool),
        "return_dict": False,
    }


# --- RFD4-Proteina ---------------------------------------------------------------------------


def _rfd4_build() -> nn.Module:
    return RFD4ProteinaTransformer(
        nlayers=4,
        token_dim=32,
        nheads=2,
        dim_cond=16,
        pair_repr_dim=16,
        latent_dim=8,
        token_type_emb_dim=8,
        t_emb_dim=16,
        seq_sep_dim=8,
        xt_pair_dist_dim=8,
        feats_seq=("xt_bb_ca", "xt_local_latents", "token_type"),
        feats_cond_seq=("time_emb_bb_ca", "time_emb_local_latents"),
        feats_pair_repr=("xt_bb_ca_pair_dists", "token_bond_path_length"),
        feats_pair_cond=("time_emb_bb_ca", "time_emb_local_latents"),
        # pair updates follow trunk layers 0 and 2, so that stack has 2 entries
        update_pair_repr_every_n=2,
        tri_mult_c=16,
        num_sequence_classes=16,
    ).eval()


def _rfd4_inputs(g: torch.Generator) -> dict[str, Any]:
    n = 8
    return {
        "bb_ca": _randn(g, 1, n, 3),
        "local_latents": _randn(g, 1, n, 8),
        "bb_ca_time": torch.rand(1, generator=g),
        "local_latents_time": torch.rand(1, generator=g),
        "padding_mask": torch.ones(1, n, dtype=torch.bool),
        "token_type": torch.randint(0, 7, (1, n), generator=g),
        "conditioning": {
            # read unconditionally by the forward (output masks and a pair feature)
            "is_in_context_conditioning": torch.zeros(1, n, dtype=torch.bool),
            "supports_local_latent": torch.ones(1, n, dtype=torch.bool),
            "token_bond_path_length": torch.randint(0, 8, (1, n, n), generator=g),
        },
        "return_dict": False,
    }


# --- Sana-Video ------------------------------------------------------------------------------


def _sana_video_build() -> nn.Module:
    return SanaVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=24,
        mlp_ratio=2.0,
        sample_size=8,
        patch_size=(1, 2, 2),
    ).eval()


def _sana_video_inputs(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "timestep": torch.randint(0, 1000, (1,), generator=g),
        "encoder_attention_mask": torch.ones(1, 6),
        "return_dict": False,
    }


# --- SANA-WM ---------------------------------------------------------------------------------


def _sana_wm_build() -> nn.Module:
    return SanaWMTransformer3DModel(
        in_channels=4,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        # block 1 is a softmax-attention block, block 0 a GDN (linear) one
        softmax_every_n=2,
        linear_head_dim=16,
        chunk_plucker_channels=6,
        chunk_plucker_post_attn_blocks=2,
        caption_channels=24,
        mlp_ratio=2.0,
    ).eval()


def _camera_conditions(g: torch.Generator, frames: int, h: int, w: int) -> torch.Tensor:
    """(1, frames, 20): flattened camera-to-world 4x4 (identity rotation) + fx, fy, cx, cy."""
    c2w = torch.eye(4).repeat(frames, 1, 1)
    c2w[:, :3, 3] = 0.1 * torch.randn(frames, 3, generator=g)
    intrinsics = torch.tensor([float(w), float(w), w / 2, h / 2]).repeat(frames, 1)
    return torch.cat([c2w.reshape(frames, 16), intrinsics], dim=-1)[None]


def _sana_wm_inputs(g: torch.Generator) -> dict[str, Any]:
    t, h, w = 2, 4, 4
    return {
        "hidden_states": _randn(g, 1, 4, t, h, w),
        "timestep": torch.randint(0, 1000, (1, 1, t), generator=g),
        "encoder_hidden_states": _randn(g, 1, 1, 6, 24),
        "encoder_attention_mask": torch.ones(1, 6),
        # drives the camera (UCPE) branch of every block's attention
        "camera_conditions": _camera_conditions(g, t, h, w),
        # feeds each block's post-attention plucker projection
        "chunk_plucker": _randn(g, 1, 6, t, h, w),
        "return_dict": False,
    }


# --- SANA-WM LTX-2 refiner -------------------------------------------------------------------

REFINER_FHW = (2, 4, 4)


def _sana_wm_refiner_build() -> nn.Module:
    return SanaWMLTX2RefinerTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=2,
        caption_channels=24,
    ).eval()


def _sana_wm_refiner_inputs(g: torch.Generator) -> dict[str, Any]:
    f, h, w = REFINER_FHW
    n = f * h * w
    return {
        "hidden_states": _randn(g, 1, n, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "timestep": torch.full((1, n), 500.0),
        "encoder_attention_mask": torch.ones(1, 6),
        "return_dict": False,
    }


def _sana_wm_refiner_call(model: nn.Module, inputs: dict[str, Any]) -> Any:
    # The refiner takes the video RoPE from the caller; build it for frames 0..f-1.
    f, h, w = REFINER_FHW
    rope = model.build_rotary_emb_for_absolute_positions(
        1, list(range(f)), h, w, device=torch.device("cpu"), fps=24.0
    )
    return model(**inputs, video_rotary_emb=rope)


# --- SD3 -------------------------------------------------------------------------------------


def _sd3_build() -> nn.Module:
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
        # SD3.5-style: dual (extra self-) attention in the first two blocks, RMS qk-norm
        dual_attention_layers=(0, 1),
        qk_norm="rms_norm",
    ).eval()


def _sd3_inputs(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "pooled_projections": _randn(g, 1, 16),
        "timestep": torch.randint(0, 1000, (1,), generator=g),
        "return_dict": False,
    }


# --- SkyReels-V2 -----------------------------------------------------------------------------


def _skyreels_build() -> nn.Module:
    return SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=24,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        image_dim=16,
        added_kv_proj_dim=32,
        inject_sample_info=True,
    ).eval()


def _skyreels_inputs(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.randint(0, 1000, (1,), generator=g),
        "encoder_hidden_states": _randn(g, 1, WAN_TEXT_LEN, 24),
        # I2V: image tokens go through the added K/V projections of every block
        "encoder_hidden_states_image": _randn(g, 1, 4, 16),
        "fps": [1],
        "return_dict": False,
    }


# --- Stable Audio 3 --------------------------------------------------------------------------


def _stable_audio3_build() -> nn.Module:
    return StableAudio3DiTModel(
        io_channels=8,
        patch_size=1,
        embed_dim=32,
        depth=2,
        num_heads=2,
        cond_token_dim=24,
        global_cond_dim=16,
        local_add_cond_dim=5,
        timestep_features_dim=32,
        ff_mult=2.0,
        num_memory_tokens=4,
    ).eval()


def _stable_audio3_inputs(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, 1, 8, 16),
        "timestep": torch.rand(1, generator=g),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "global_hidden_states": _randn(g, 1, 16),
        "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]], dtype=torch.bool),
        # inpainting input: runs each block's local-embed projection
        "local_add_cond": _randn(g, 1, 5, 16),
        "return_dict": False,
    }


# --- TransformerTemporalModel ----------------------------------------------------------------


def _temporal_build() -> nn.Module:
    return TransformerTemporalModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=8,
        num_layers=2,
        norm_num_groups=4,
    ).eval()


def _temporal_inputs(g: torch.Generator) -> dict[str, Any]:
    # (batch * frames, channels, h, w) with batch 1 and 4 frames
    return {"hidden_states": _randn(g, 4, 8, 4, 4), "num_frames": 4, "return_dict": False}


# --- Wan -------------------------------------------------------------------------------------


def _wan_config() -> dict[str, Any]:
    return {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "in_channels": 4,
        "out_channels": 4,
        "text_dim": 24,
        "freq_dim": 32,
        "ffn_dim": 64,
        "image_dim": 16,
        "added_kv_proj_dim": 32,
    }


def _wan_build() -> nn.Module:
    return WanTransformer3DModel(num_layers=2, **_wan_config()).eval()


def _wan_inputs(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.randint(0, 1000, (1,), generator=g),
        "encoder_hidden_states": _randn(g, 1, WAN_TEXT_LEN, 24),
        # I2V: image tokens go through the added K/V projections of every block
        "encoder_hidden_states_image": _randn(g, 1, 4, 16),
        "return_dict": False,
    }


# --- Wan-Animate -----------------------------------------------------------------------------


def _wan_animate_build() -> nn.Module:
    return WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=12,
        latent_channels=4,
        out_channels=4,
        text_dim=24,
        freq_dim=32,
        ffn_dim=64,
        num_layers=4,
        image_dim=16,
        added_kv_proj_dim=32,
        # 16x16 face crops: two motion-encoder res blocks (16 -> 8 -> 4)
        motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8},
        motion_encoder_size=16,
        motion_style_dim=16,
        motion_dim=4,
        motion_encoder_dim=16,
        face_encoder_hidden_dim=16,
        face_encoder_num_heads=2,
        # face adapters after blocks 0 and 2
        inject_face_latents_blocks=2,
        motion_encoder_batch_size=8,
    ).eval()


def _wan_animate_inputs(g: torch.Generator) -> dict[str, Any]:
    # 5 face frames -> 2 motion frames after the face encoder's two stride-2 convs, + 1 pad
    # frame = 3, which must match the 3 latent frames (1 reference + 2 pose frames).
    return {
        "hidden_states": _randn(g, 1, 12, 3, 8, 8),
        "timestep": torch.randint(0, 1000, (1,), generator=g),
        "encoder_hidden_states": _randn(g, 1, WAN_TEXT_LEN, 24),
        "encoder_hidden_states_image": _randn(g, 1, 4, 16),
        "pose_hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "face_pixel_values": _randn(g, 1, 3, 5, 16, 16),
        "return_dict": False,
    }


# --- Wan-Animate-2 ---------------------------------------------------------------------------

WAN_ANIMATE2_FHW = (2, 8, 8)


def _wan_animate2_build() -> nn.Module:
    return WanAnimate2Transformer3DModel(
        patch_size=(1, 2, 2),
        text_len=8,
        in_dim=8,
        dim=32,
        ffn_dim=64,
        freq_dim=32,
        text_dim=24,
        out_dim=4,
        num_heads=2,
        num_layers=2,
    ).eval()


def _wan_animate2_inputs(g: torch.Generator) -> dict[str, Any]:
    f, h, w = WAN_ANIMATE2_FHW
    grid = torch.tensor([[f, h // 2, w // 2]])
    # The reference ("extract") pass: dense self-attention that fills a fresh KV cache. The
    # generation ("cached") pass needs flex attention with a compiled block mask.
    return {
        "hidden_states": [_randn(g, 4, f, h, w)],
        "timestep": torch.randint(0, 1000, (1,), generator=g),
        "encoder_hidden_states": [_randn(g, 6, 24)],
        "condition_latents": [_randn(g, 4, f, h, w)],
        "kv_cache": WanAnimate2KVCache(2),
        "kv_cache_mode": "extract",
        "seq_len": f * (h // 2) * (w // 2),
        # the CLIP projection has a fixed 1280 input width
        "encoder_hidden_states_image": _randn(g, 1, 4, 1280),
        "offset_grid_sizes": grid,
        "return_dict": False,
    }


# --- Wan-VACE --------------------------------------------------------------------------------


def _wan_vace_build() -> nn.Module:
    return WanVACETransformer3DModel(
        num_layers=3, vace_layers=[0, 2], vace_in_channels=8, **_wan_config()
    ).eval()


def _wan_vace_inputs(g: torch.Generator) -> dict[str, Any]:
    inputs = _wan_inputs(g)
    # control latents run the VACE blocks, whose hints are added after blocks 0 and 2
    inputs["control_hidden_states"] = _randn(g, 1, 8, 2, 8, 8)
    return inputs


# --- Z-Image ---------------------------------------------------------------------------------


def _z_image_build() -> nn.Module:
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=2,
        n_refiner_layers=2,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=24,
        # enables the SigLIP embedder and refiner stack (omni mode)
        siglip_feat_dim=16,
        axes_dims=[4, 6, 6],
        axes_lens=[256, 64, 64],
    ).eval()


def _z_image_inputs(g: torch.Generator) -> dict[str, Any]:
    # Omni mode (nested lists): a clean condition image with its SigLIP features, then the
    # noisy target image; this runs the noise, context and SigLIP refiners and the main layers.
    return {
        "x": [[_randn(g, 4, 1, 8, 8), _randn(g, 4, 1, 8, 8)]],
        "t": torch.rand(1, generator=g),
        "cap_feats": [[_randn(g, 5, 24), _randn(g, 3, 24)]],
        "siglip_feats": [[_randn(g, 2, 2, 16), None]],
        "image_noise_mask": [[0, 1]],
        "return_dict": False,
    }


CASES: list[Case] = [
    Case("OmniGenTransformer2DModel", _omnigen_build, _omnigen_inputs),
    Case("OvisImageTransformer2DModel", _ovis_build, _ovis_inputs),
    Case("PRXTransformer2DModel", _prx_build, _prx_inputs),
    Case("QwenImageTransformer2DModel", _qwenimage_build, _qwenimage_inputs),
    Case("QwenImage21Transformer2DModel", _qwenimage21_build, _qwenimage21_inputs),
    Case(
        "RFD4ProteinaTransformer",
        _rfd4_build,
        _rfd4_inputs,
        note="pair_update_layers (a ModuleDict) run interleaved with transformer_layers, "
        "after layers 0 and 2; recycle_depth > 1 would rerun the whole trunk",
    ),
    Case("SanaVideoTransformer3DModel", _sana_video_build, _sana_video_inputs),
    Case(
        "SanaWMTransformer3DModel",
        _sana_wm_build,
        _sana_wm_inputs,
        note="the softmax block (blocks.1) leaves its GDN-only parameters unused; "
        "raymap_embedder is unused when chunk-plucker post-attention is on (the default)",
    ),
    Case(
        "SanaWMLTX2RefinerTransformer3DModel",
        _sana_wm_refiner_build,
        _sana_wm_refiner_inputs,
        call=_sana_wm_refiner_call,
        note="video-only forward: the audio and audio/video cross-attention submodules "
        "(in every block and at the top level) are kept for the checkpoint but unused",
    ),
    Case("SD3Transformer2DModel", _sd3_build, _sd3_inputs),
    Case("SkyReelsV2Transformer3DModel", _skyreels_build, _skyreels_inputs),
    Case("StableAudio3DiTModel", _stable_audio3_build, _stable_audio3_inputs),
    Case("TransformerTemporalModel", _temporal_build, _temporal_inputs),
    Case("WanTransformer3DModel", _wan_build, _wan_inputs),
    Case(
        "WanAnimateTransformer3DModel",
        _wan_animate_build,
        _wan_animate_inputs,
        note="face_adapter runs interleaved with blocks (after blocks 0 and 2)",
    ),
    Case(
        "WanAnimate2Transformer3DModel",
        _wan_animate2_build,
        _wan_animate2_inputs,
        note="reference (extract) pass only: the cached generation pass needs flex attention "
        "with a compiled block mask (about 25 s on CPU)",
    ),
    Case(
        "WanVACETransformer3DModel",
        _wan_vace_build,
        _wan_vace_inputs,
        note="all vace_blocks run before blocks (registered after them); "
        "their hints are added after blocks 0 and 2",
    ),
    Case("ZImageTransformer2DModel", _z_image_build, _z_image_inputs),
]

NOT_BUILT: dict[str, str] = {}
