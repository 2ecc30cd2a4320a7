"""Zoo cases, part C of the diffusers DiT classes (HunyuanVideoFramepack .. NucleusMoEImage).

Each :class:`Case` builds one ``diffusers.models.transformers`` class from a tiny config with
random weights and draws forward inputs that make every block stack run.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_hunyuan_video_framepack import (
    HunyuanVideoFramepackTransformer3DModel,
)
from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageTransformer2DModel
from diffusers.models.transformers.transformer_ideogram4 import Ideogram4Transformer2DModel
from diffusers.models.transformers.transformer_joyimage import JoyImageEditTransformer3DModel
from diffusers.models.transformers.transformer_joyimage_edit_plus import (
    JoyImageEditPlusTransformer3DModel,
)
from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Transformer3DModel
from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6Transformer3DModel
from diffusers.models.transformers.transformer_kandinsky6_sr import (
    Kandinsky6SRTransformer3DModel,
)
from diffusers.models.transformers.transformer_krea2 import Krea2Transformer2DModel
from diffusers.models.transformers.transformer_longcat_audio_dit import LongCatAudioDiTTransformer
from diffusers.models.transformers.transformer_longcat_image import LongCatImageTransformer2DModel
from diffusers.models.transformers.transformer_ltx import LTXVideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel
from diffusers.models.transformers.transformer_lumina2 import Lumina2Transformer2DModel
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel
from diffusers.models.transformers.transformer_minimax_music3 import (
    MiniMaxMusic3Transformer1DModel,
)
from diffusers.models.transformers.transformer_mochi import MochiTransformer3DModel
from diffusers.models.transformers.transformer_motif_video import MotifVideoTransformer3DModel
from diffusers.models.transformers.transformer_nucleusmoe_image import (
    NucleusMoEImageTransformer2DModel,
)
from torch import nn

from tests.zoo import Case

G = torch.Generator


def _randn(g: G, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _t(g: G, n: int = 1, scale: float = 1000.0) -> torch.Tensor:
    """Timesteps in [0, scale)."""
    return torch.rand(n, generator=g) * scale


# ----------------------------------------------------------------------------------------------
# HunyuanVideoFramepack


def _framepack() -> nn.Module:
    return HunyuanVideoFramepackTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=2,
        num_refiner_layers=2,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=16,
        rope_axes_dim=(4, 6, 6),
        has_image_proj=True,
        image_proj_dim=16,
        has_clean_x_embedder=True,
    ).eval()


def _framepack_inputs(g: G) -> dict[str, Any]:
    # The forward needs all three history latents (clean, 2x, 4x) with their frame indices:
    # it reads their rotary embeddings unconditionally.
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": _t(g),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "encoder_attention_mask": torch.ones(1, 6, dtype=torch.long),
        "pooled_projections": _randn(g, 1, 16),
        "image_embeds": _randn(g, 1, 3, 16),
        "indices_latents": torch.arange(4, 6),
        "guidance": torch.full((1,), 6000.0),
        "latents_clean": _randn(g, 1, 4, 2, 8, 8),
        "indices_latents_clean": torch.arange(0, 2),
        "latents_history_2x": _randn(g, 1, 4, 2, 8, 8),
        "indices_latents_history_2x": torch.arange(0, 2),
        "latents_history_4x": _randn(g, 1, 4, 4, 8, 8),
        "indices_latents_history_4x": torch.arange(0, 4),
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# HunyuanImage


def _hunyuanimage() -> nn.Module:
    # text_embed_2_dim stays None: the ByT5 projection has a fixed 2048 hidden width (~4.3 M).
    return HunyuanImageTransformer2DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=2,
        num_refiner_layers=2,
        patch_size=(1, 1),
        guidance_embeds=True,
        text_embed_dim=16,
        rope_axes_dim=(8, 8),
        use_meanflow=True,  # with timestep_r: runs the second (meanflow) timestep embedder
    ).eval()


def _hunyuanimage_inputs(g: G) -> dict[str, Any]:
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # one padded prompt, so the refiner and joint attention masks matter
    return {
        "hidden_states": _randn(g, 2, 8, 4, 4),
        "timestep": _t(g, 2),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "encoder_attention_mask": mask,
        "timestep_r": _t(g, 2),
        "guidance": torch.full((2,), 3500.0),
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# Ideogram4


def _ideogram4() -> nn.Module:
    return Ideogram4Transformer2DModel(
        in_channels=8,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        intermediate_size=64,
        adaln_dim=32,
        llm_features_dim=24,
        mrope_section=(4, 2, 2),
    ).eval()


def _ideogram4_inputs(g: G) -> dict[str, Any]:
    # One packed sequence: 6 text tokens (indicator 3) then a 4x4 image grid (indicator 2).
    n_txt, h, w = 6, 4, 4
    n = n_txt + h * w
    indicator = torch.cat([torch.full((n_txt,), 3), torch.full((h * w,), 2)])[None]
    txt_pos = torch.arange(n_txt)[:, None].expand(n_txt, 3)
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_pos = torch.stack([torch.zeros(h * w, dtype=torch.long), hh.flatten(), ww.flatten()], -1)
    position_ids = torch.cat([txt_pos, img_pos + 65536])[None]
    return {
        "hidden_states": _randn(g, 1, n, 8),
        "timestep": torch.rand(1, generator=g),
        "encoder_hidden_states": _randn(g, 1, n, 24),
        "position_ids": position_ids,
        "segment_ids": torch.zeros(1, n, dtype=torch.long),
        "indicator": indicator,
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# JoyImageEdit / JoyImageEditPlus


def _joyimage() -> nn.Module:
    return JoyImageEditTransformer3DModel(
        patch_size=[1, 2, 2],
        in_channels=4,
        hidden_size=32,
        num_attention_heads=2,
        text_dim=16,
        num_layers=2,
        rope_dim_list=[4, 6, 6],
    ).eval()


def _joyimage_inputs(g: G) -> dict[str, Any]:
    # 6-D multi-item input (target + one reference image), as the edit pipeline passes.
    return {
        "hidden_states": _randn(g, 1, 2, 4, 1, 8, 8),
        "timestep": _t(g),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "return_dict": False,
    }


def _joyimage_plus() -> nn.Module:
    return JoyImageEditPlusTransformer3DModel(
        patch_size=[1, 2, 2],
        in_channels=4,
        hidden_size=32,
        num_attention_heads=2,
        text_dim=16,
        num_layers=2,
        rope_dim_list=[4, 6, 6],
    ).eval()


def _joyimage_plus_inputs(g: G) -> dict[str, Any]:
    # Padded patch sequences: sample 0 has a 4x4 target + 2x3 reference (22 patches), sample 1
    # only the target (16 patches, 6 padding).
    shape_list = [[(1, 4, 4), (1, 2, 3)], [(1, 4, 4)]]
    txt_mask = torch.ones(2, 5, dtype=torch.long)
    txt_mask[1, 3:] = 0
    return {
        "hidden_states": _randn(g, 2, 22, 4, 1, 2, 2),
        "timestep": _t(g, 2),
        "encoder_hidden_states": _randn(g, 2, 5, 16),
        "encoder_hidden_states_mask": txt_mask,
        "shape_list": shape_list,
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# Kandinsky 5 / 6 / 6-SR


def _kandinsky5() -> nn.Module:
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=4,
        in_text_dim=16,
        in_text_dim2=16,
        time_dim=32,
        out_visual_dim=4,
        patch_size=(1, 2, 2),
        model_dim=32,
        ff_dim=64,
        num_text_blocks=2,
        num_visual_blocks=2,
        axes_dims=(4, 6, 6),
        visual_cond=True,
    )
    # Every Kandinsky5Modulation projection is zero-initialised (all gates 0: the blocks would
    # be identities); redraw them so each block changes the stream.
    for name, sub in model.named_modules():
        if name.endswith("modulation.out_layer"):
            nn.init.normal_(sub.weight, std=0.1)
            nn.init.normal_(sub.bias, std=0.1)
    return model.eval()


def _kandinsky5_inputs(g: G) -> dict[str, Any]:
    # visual_cond: latent, conditioning latent and mask concatenated (2 * 4 + 1 channels), BTHWC.
    return {
        "hidden_states": _randn(g, 1, 2, 8, 8, 9),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": _t(g),
        "pooled_projections": _randn(g, 1, 16),
        "visual_rope_pos": (torch.arange(2), torch.arange(4), torch.arange(4)),
        "text_rope_pos": torch.arange(6),
        "return_dict": False,
    }


def _kandinsky6() -> nn.Module:
    return Kandinsky6Transformer3DModel(
        in_visual_dim=4,
        out_visual_dim=4,
        in_text_dim=16,
        in_text_dim2=16,
        time_dim=32,
        patch_size=(1, 2, 2),
        model_dim=32,
        ff_dim=64,
        num_text_blocks=2,
        num_visual_blocks=2,
        axes_dims=(4, 6, 6),
        visual_cond=True,
        in_audio_dim=6,
        out_audio_dim=6,
        text_token_padding=True,
        ca_rope=True,
        cross_gates=True,
        fix_modulation=True,
    ).eval()


def _kandinsky6_inputs(g: G) -> dict[str, Any]:
    # audio_hidden_states makes the fused blocks run their audio path too.
    return {
        "hidden_states": _randn(g, 1, 2, 8, 8, 9),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "pooled_projections": _randn(g, 1, 16),
        "timestep": _t(g),
        "audio_hidden_states": _randn(g, 1, 10, 6),
        "encoder_attention_mask": torch.tensor([[True] * 5 + [False]]),
        "return_dict": False,
    }


def _kandinsky6_sr() -> nn.Module:
    return Kandinsky6SRTransformer3DModel(
        in_visual_dim=4,
        out_visual_dim=8,
        time_dim=32,
        patch_size=(1, 1, 1),
        model_dim=32,
        ff_dim=64,
        num_visual_blocks=2,
        axes_dims=(4, 6, 6),
        nabla_window=(3, 3, 3),
    ).eval()


def _kandinsky6_sr_inputs(g: G) -> dict[str, Any]:
    # NABLA attention needs the token grid divisible by 8 (one 8x8 block, two frames).
    return {
        "hidden_states": _randn(g, 1, 2, 8, 8, 9),
        "timestep": _t(g),
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# Krea2


def _krea2() -> nn.Module:
    return Krea2Transformer2DModel(
        in_channels=8,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        timestep_embed_dim=32,
        text_hidden_dim=32,
        num_text_layers=3,
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=64,
        num_layerwise_text_blocks=2,
        num_refiner_text_blocks=2,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def _krea2_inputs(g: G) -> dict[str, Any]:
    n_txt, h, w = 5, 4, 4
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_pos = torch.stack([torch.zeros(h * w, dtype=torch.long), hh.flatten(), ww.flatten()], -1)
    position_ids = torch.cat([torch.zeros(n_txt, 3, dtype=torch.long), img_pos])
    mask = torch.ones(2, n_txt, dtype=torch.bool)
    mask[1, 3:] = False
    return {
        "hidden_states": _randn(g, 2, h * w, 8),
        "encoder_hidden_states": _randn(g, 2, n_txt, 3, 32),
        "timestep": torch.rand(2, generator=g),
        "position_ids": position_ids,
        "encoder_attention_mask": mask,
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# LongCat audio / image


def _longcat_audio() -> nn.Module:
    model = LongCatAudioDiTTransformer(
        dit_dim=32,
        dit_depth=2,
        dit_heads=2,
        dit_text_dim=16,
        latent_dim=8,
    )
    # The constructor zero-initialises the global AdaLN MLP, the final norm and proj_out, so
    # the output would be all zeros: redraw them to get a non-trivial output.
    for mod in (model.adaln_global_mlp.mlp[-1], model.norm_out.linear, model.proj_out):
        nn.init.normal_(mod.weight, std=0.1)
        nn.init.normal_(mod.bias, std=0.1)
    return model.eval()


def _longcat_audio_inputs(g: G) -> dict[str, Any]:
    # latent_cond makes the latent-condition embedders run.
    text_mask = torch.ones(1, 6, dtype=torch.bool)
    text_mask[0, 5:] = False
    return {
        "hidden_states": _randn(g, 1, 12, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "encoder_attention_mask": text_mask,
        "timestep": torch.rand(1, generator=g),
        "latent_cond": _randn(g, 1, 12, 8),
        "return_dict": False,
    }


def _longcat_image() -> nn.Module:
    return LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        axes_dims_rope=[4, 6, 6],
    ).eval()


def _longcat_image_inputs(g: G) -> dict[str, Any]:
    h = w = 4
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_ids = torch.stack([torch.zeros(h * w), hh.flatten(), ww.flatten()], -1).float()
    txt_ids = torch.zeros(6, 3)
    return {
        "hidden_states": _randn(g, 1, h * w, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": torch.rand(1, generator=g),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# LTX-Video / LTX-2


def _ltx() -> nn.Module:
    return LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        num_layers=2,
        caption_channels=16,
    ).eval()


def _ltx_inputs(g: G) -> dict[str, Any]:
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    return {
        "hidden_states": _randn(g, 2, 2 * 4 * 4, 8),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "timestep": _t(g, 2),
        "encoder_attention_mask": mask,
        "num_frames": 2,
        "height": 4,
        "width": 4,
        "rope_interpolation_scale": (8 / 25, 32, 32),
        "return_dict": False,
    }


def _ltx2() -> nn.Module:
    # LTX-2.3 flavour (gated attention, prompt cross-attention modulation) so every submodule
    # of the blocks has weights in play; needs `sigma` in the forward.
    return LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        gated_attn=True,
        cross_attn_mod=True,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=2,
        audio_attention_head_dim=16,
        audio_cross_attention_dim=32,
        audio_gated_attn=True,
        audio_cross_attn_mod=True,
        num_layers=2,
        caption_channels=16,
    ).eval()


def _ltx2_inputs(g: G) -> dict[str, Any]:
    t = torch.rand(1, generator=g)
    return {
        "hidden_states": _randn(g, 1, 2 * 4 * 4, 8),
        "audio_hidden_states": _randn(g, 1, 6, 8),
        "encoder_hidden_states": _randn(g, 1, 5, 16),
        "audio_encoder_hidden_states": _randn(g, 1, 5, 16),
        "timestep": t * 1000,
        "sigma": t,
        "encoder_attention_mask": torch.ones(1, 5),
        "audio_encoder_attention_mask": torch.ones(1, 5),
        "num_frames": 2,
        "height": 4,
        "width": 4,
        "audio_num_frames": 6,
        "use_cross_timestep": True,
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# Lumina2


def _lumina2() -> nn.Module:
    return Lumina2Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=2,
        num_refiner_layers=2,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),
        axes_lens=(64, 32, 32),
        cap_feat_dim=16,
    ).eval()


def _lumina2_inputs(g: G) -> dict[str, Any]:
    # Prompts of different lengths, so the joint blocks run with an attention mask.
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return {
        "hidden_states": _randn(g, 2, 4, 8, 8),
        "timestep": torch.rand(2, generator=g),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "encoder_attention_mask": mask,
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# MiniMax H3 / Music3


def _minimax_h3() -> nn.Module:
    return MiniMaxH3Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        hidden_size=24,
        num_layers=2,
        num_refiner_layers=2,
        ffn_dim=48,
        in_channels=4,
        audio_in_channels=6,
        patch_size=(1, 2, 2),
        text_dim=16,
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,
    ).eval()


def _minimax_h3_inputs(g: G) -> dict[str, Any]:
    # Packed sequence [5 text | 6 audio | 2x2x2 video rows]; two noise levels: text and audio
    # rows at timestep 0, video rows at timestep 1.
    n_txt, n_aud, t, h, w = 5, 6, 2, 2, 2
    n_vid = t * h * w
    seq = n_txt + n_aud + n_vid
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    vid_pos = torch.stack([tt.flatten() + 1, hh.flatten(), ww.flatten()], -1)
    txt_pos = torch.zeros(n_txt, 3, dtype=torch.long)
    aud_pos = torch.arange(n_aud)[:, None].expand(n_aud, 3)
    tags = torch.cat(
        [torch.full((n_txt,), 1), torch.full((n_aud,), 2), torch.full((n_vid,), 0)]
    ).long()
    t_idx = torch.cat([torch.zeros(n_txt + n_aud), torch.ones(n_vid)]).long()
    return {
        "hidden_states": _randn(g, 1, n_vid, 4 * 2 * 2),
        "audio_hidden_states": _randn(g, 1, n_aud, 6),
        "encoder_hidden_states": _randn(g, 1, n_txt, 16),
        "timestep": torch.rand(2, generator=g),
        "timestep_indices": t_idx,
        "token_tags": tags,
        "position_ids": torch.cat([txt_pos, aud_pos, vid_pos]),
        "video_indices": torch.arange(n_txt + n_aud, seq),
        "audio_indices": torch.arange(n_txt, n_txt + n_aud),
        "text_indices": torch.arange(n_txt),
        "return_dict": False,
    }


def _minimax_music3() -> nn.Module:
    return MiniMaxMusic3Transformer1DModel(
        in_channels=8,
        condition_dim=16,
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=16,
        ff_inner_dim=64,
        rotary_dim=8,
        fourier_embedding_dim=32,
    ).eval()


def _minimax_music3_inputs(g: G) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, 1, 8, 12),
        "timestep": torch.rand(1, generator=g),
        "encoder_hidden_states": _randn(g, 1, 12, 16),
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# Mochi


def _mochi() -> nn.Module:
    model = MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        pooled_projection_dim=16,
        in_channels=4,
        text_embed_dim=16,
        time_embed_dim=32,
        max_sequence_length=8,
    )
    # pos_frequencies is created all-zero (identity RoPE); draw it so the rotary path matters.
    nn.init.normal_(model.pos_frequencies)
    return model.eval()


def _mochi_inputs(g: G) -> dict[str, Any]:
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return {
        "hidden_states": _randn(g, 2, 4, 2, 8, 8),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "timestep": _t(g, 2),
        "encoder_attention_mask": mask,
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# MotifVideo


def _motif() -> nn.Module:
    # The last 2 of the 4 single blocks are "decoder" blocks (no text stream).
    return MotifVideoTransformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=4,
        num_decoder_layers=2,
        text_embed_dim=16,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
        enable_text_cross_attention_dual=True,
        enable_text_cross_attention_single=True,
    ).eval()


def _motif_inputs(g: G) -> dict[str, Any]:
    # image_embeds runs the first-frame image embedder.
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    return {
        "hidden_states": _randn(g, 2, 9, 2, 8, 8),
        "timestep": _t(g, 2),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "encoder_attention_mask": mask,
        "image_embeds": _randn(g, 2, 3, 16),
        "return_dict": False,
    }


# ----------------------------------------------------------------------------------------------
# NucleusMoEImage


def _nucleus() -> nn.Module:
    model = NucleusMoEImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
        mlp_ratio=6.0,  # the dense FFN width is rounded down to a multiple of 128: 32 * 6 * 2/3
        dense_moe_strategy="leave_first_block_dense",
        num_experts=4,
        moe_intermediate_dim=32,
        capacity_factors=2.0,
    )
    # The routed expert weights are created with torch.empty (filled by the checkpoint).
    for block in model.transformer_blocks:
        experts = getattr(getattr(block, "img_mlp", None), "experts", None)
        if experts is not None:
            nn.init.normal_(experts.gate_up_proj, std=0.1)
            nn.init.normal_(experts.down_proj, std=0.1)
    return model.eval()


def _nucleus_inputs(g: G) -> dict[str, Any]:
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return {
        "hidden_states": _randn(g, 2, 16, 16),
        "img_shapes": [[(1, 4, 4)], [(1, 4, 4)]],
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(2, generator=g),
        "return_dict": False,
    }


CASES: list[Case] = [
    Case("HunyuanVideoFramepackTransformer3DModel", _framepack, _framepack_inputs),
    Case(
        "HunyuanImageTransformer2DModel",
        _hunyuanimage,
        _hunyuanimage_inputs,
        note="context_embedder_2 (ByT5 projection, fixed 2048 width) not built",
    ),
    Case("Ideogram4Transformer2DModel", _ideogram4, _ideogram4_inputs),
    Case("JoyImageEditTransformer3DModel", _joyimage, _joyimage_inputs),
    Case("JoyImageEditPlusTransformer3DModel", _joyimage_plus, _joyimage_plus_inputs),
    Case("Kandinsky5Transformer3DModel", _kandinsky5, _kandinsky5_inputs),
    Case("Kandinsky6Transformer3DModel", _kandinsky6, _kandinsky6_inputs),
    Case(
        "Kandinsky6SRTransformer3DModel",
        _kandinsky6_sr,
        _kandinsky6_sr_inputs,
        note="NABLA attention always dispatches to the flex backend (eager on CPU)",
    ),
    Case("Krea2Transformer2DModel", _krea2, _krea2_inputs),
    Case(
        "LongCatAudioDiTTransformer",
        _longcat_audio,
        _longcat_audio_inputs,
        note="text_conv_layer is a fixed nn.Sequential of 4 ConvNeXt blocks, run before blocks",
    ),
    Case("LongCatImageTransformer2DModel", _longcat_image, _longcat_image_inputs),
    Case("LTXVideoTransformer3DModel", _ltx, _ltx_inputs),
    Case("LTX2VideoTransformer3DModel", _ltx2, _ltx2_inputs),
    Case(
        "Lumina2Transformer2DModel",
        _lumina2,
        _lumina2_inputs,
        note="context_refiner runs before noise_refiner (registered after it)",
    ),
    Case("MiniMaxH3Transformer3DModel", _minimax_h3, _minimax_h3_inputs),
    Case("MiniMaxMusic3Transformer1DModel", _minimax_music3, _minimax_music3_inputs),
    Case("MochiTransformer3DModel", _mochi, _mochi_inputs),
    Case(
        "MotifVideoTransformer3DModel",
        _motif,
        _motif_inputs,
        note="last num_decoder_layers single blocks run on a copy of the embedded latents",
    ),
    Case("NucleusMoEImageTransformer2DModel", _nucleus, _nucleus_inputs),
]

NOT_BUILT: dict[str, str] = {}
