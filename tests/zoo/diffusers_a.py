"""Zoo cases, diffusers part A: AceStep .. AnyFlowFAR (DiT, PixArt, Sana, CogVideoX, audio DiTs, ...).

Each case builds its class from a tiny config (random weights from torch's global RNG) and
draws forward inputs from a generator; see :mod:`tests.zoo` for the :class:`Case` contract.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.embeddings import (
    get_1d_rotary_pos_embed,
    get_2d_rotary_pos_embed,
    get_2d_rotary_pos_embed_lumina,
    get_3d_rotary_pos_embed_allegro,
)
from diffusers.models.transformers.ace_step_transformer import AceStepTransformer1DModel
from diffusers.models.transformers.auraflow_transformer_2d import AuraFlowTransformer2DModel
from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXTransformer3DModel
from diffusers.models.transformers.consisid_transformer_3d import ConsisIDTransformer3DModel
from diffusers.models.transformers.dit_transformer_2d import DiTTransformer2DModel
from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiT2DModel
from diffusers.models.transformers.latte_transformer_3d import LatteTransformer3DModel
from diffusers.models.transformers.lumina_nextdit2d import LuminaNextDiT2DModel
from diffusers.models.transformers.minimax_music3_rvq_depth_decoder import (
    MiniMaxMusic3RVQDepthDecoder,
)
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
from diffusers.models.transformers.prior_transformer import PriorTransformer
from diffusers.models.transformers.sana_transformer import SanaTransformer2DModel
from diffusers.models.transformers.stable_audio_transformer import StableAudioDiTModel
from diffusers.models.transformers.t5_film_transformer import T5FilmDecoder
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from diffusers.models.transformers.transformer_2d_dreamlite import DreamLiteTransformer2DModel
from diffusers.models.transformers.transformer_allegro import AllegroTransformer3DModel
from diffusers.models.transformers.transformer_anyflow import AnyFlowTransformer3DModel
from diffusers.models.transformers.transformer_anyflow_far import AnyFlowFARTransformer3DModel
from torch import nn

from tests.zoo import Case

B = 2  # batch size of every case


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=g)


def _t1000(g: torch.Generator) -> torch.Tensor:
    """A float timestep per sample in [0, 1000)."""
    return torch.rand(B, generator=g) * 1000


def _tlong(g: torch.Generator) -> torch.Tensor:
    """An integer timestep per sample in [0, 1000)."""
    return torch.randint(0, 1000, (B,), generator=g)


# --- AceStepTransformer1DModel -------------------------------------------------------------


def _build_ace_step() -> nn.Module:
    return AceStepTransformer1DModel(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,  # layer types alternate: sliding, full
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        in_channels=16,  # context (8) + noisy latents (8), concatenated on channels
        audio_acoustic_hidden_dim=8,
        patch_size=2,
        sliding_window=2,
    ).eval()


def _inputs_ace_step(g: torch.Generator) -> dict[str, Any]:
    t = _rand(g, B)
    return {
        "hidden_states": _randn(g, B, 12, 8),
        "timestep": t,
        "timestep_r": t * 0.5,
        "encoder_hidden_states": _randn(g, B, 5, 32),
        "context_latents": _randn(g, B, 12, 8),
        "return_dict": False,
    }


# --- AuraFlowTransformer2DModel ------------------------------------------------------------


def _build_auraflow() -> nn.Module:
    return AuraFlowTransformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=2,
        num_single_dit_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=32,  # must equal inner dim (2 x 16)
        out_channels=4,
        pos_embed_max_size=16,  # 4 x 4 patches
    ).eval()


def _inputs_auraflow(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 4, 8, 8),
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "timestep": _rand(g, B),
        "return_dict": False,
    }


# --- CogVideoXTransformer3DModel -----------------------------------------------------------


def _build_cogvideox() -> nn.Module:
    return CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=16,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=5,  # (2 latent frames - 1) * 4 + 1: the precomputed sincos table is used
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=6,
    ).eval()


def _inputs_cogvideox(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 2, 4, 8, 8),
        "encoder_hidden_states": _randn(g, B, 6, 16),  # length = max_text_seq_length
        "timestep": _tlong(g),
        "return_dict": False,
    }


# --- ConsisIDTransformer3DModel ------------------------------------------------------------


def _build_consisid() -> nn.Module:
    return ConsisIDTransformer3DModel(
        num_attention_heads=3,
        attention_head_dim=16,  # inner 48; face cross-attn kv dim = 48 * 2 / 3 = 32
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=16,
        num_layers=4,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=6,
        is_train_face=True,  # builds local_facial_extractor and perceiver_cross_attention
        cross_attn_interval=2,  # perceiver_cross_attention x2, after blocks 0 and 2
        cross_attn_dim_head=16,
        cross_attn_num_heads=2,
        LFE_id_dim=16,
        LFE_vit_dim=16,
        LFE_depth=2,
        LFE_dim_head=8,
        LFE_num_heads=2,
        LFE_num_id_token=2,
        LFE_num_querie=4,
        LFE_output_dim=32,  # = face cross-attn kv dim
        LFE_ff_mult=2,
        LFE_num_scale=2,  # one extractor layer per ViT scale
    ).eval()


def _inputs_consisid(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 2, 4, 8, 8),
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "timestep": _tlong(g),
        # face conditioning: runs local_facial_extractor and perceiver_cross_attention
        "id_cond": _randn(g, B, 16),
        "id_vit_hidden": [_randn(g, B, 5, 16) for _ in range(2)],
        "return_dict": False,
    }


# --- DiTTransformer2DModel -----------------------------------------------------------------


def _build_dit() -> nn.Module:
    return DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=3,  # block 0 stays resident (needs): two stream
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,  # number of class labels
    ).eval()


def _inputs_dit(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 4, 8, 8),
        "timestep": _tlong(g),
        "class_labels": torch.randint(0, 10, (B,), generator=g),
        "return_dict": False,
    }


# --- HunyuanDiT2DModel ---------------------------------------------------------------------


def _build_hunyuan_dit() -> nn.Module:
    return HunyuanDiT2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        patch_size=2,
        sample_size=8,
        hidden_size=32,
        num_layers=4,  # 4 blocks: block 3 takes the long skip from block 0
        cross_attention_dim=16,
        cross_attention_dim_t5=16,
        pooled_projection_dim=16,
        text_len=5,
        text_len_t5=7,
    ).eval()


def _inputs_hunyuan_dit(g: torch.Generator) -> dict[str, Any]:
    # 2D RoPE over the 4 x 4 patch grid, as the pipeline builds it
    rope = get_2d_rotary_pos_embed(16, ((0, 0), (4, 4)), (4, 4), output_type="pt")
    return {
        "hidden_states": _randn(g, B, 4, 8, 8),
        "timestep": _t1000(g),
        "encoder_hidden_states": _randn(g, B, 5, 16),
        "text_embedding_mask": torch.ones(B, 5, dtype=torch.long),
        "encoder_hidden_states_t5": _randn(g, B, 7, 16),
        "text_embedding_mask_t5": torch.ones(B, 7, dtype=torch.long),
        "image_meta_size": torch.tensor([[64.0, 64.0, 64.0, 64.0, 0.0, 0.0]] * B),
        "style": torch.zeros(B, dtype=torch.long),
        "image_rotary_emb": rope,
        "return_dict": False,
    }


# --- LatteTransformer3DModel ---------------------------------------------------------------


def _build_latte() -> nn.Module:
    return LatteTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        cross_attention_dim=32,
        attention_bias=True,
        sample_size=8,
        patch_size=2,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        caption_channels=16,
        video_length=2,  # temporal pos-embed length must equal the frame count
    ).eval()


def _inputs_latte(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 4, 2, 8, 8),
        "timestep": _tlong(g),
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "return_dict": False,
    }


# --- LuminaNextDiT2DModel ------------------------------------------------------------------


def _build_lumina_next() -> nn.Module:
    model = LuminaNextDiT2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        cross_attention_dim=16,
    )
    # pad_token is created with torch.empty: give it values from the seeded RNG
    nn.init.normal_(model.pad_token, std=0.02)
    return model.eval()


def _inputs_lumina_next(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 4, 8, 8),
        "timestep": _rand(g, B),
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "encoder_mask": torch.ones(B, 6, dtype=torch.long),
        "image_rotary_emb": get_2d_rotary_pos_embed_lumina(16, 8, 8),
        "cross_attention_kwargs": {},  # the blocks do **cross_attention_kwargs: None fails
        "return_dict": False,
    }


# --- MiniMaxMusic3RVQDepthDecoder ----------------------------------------------------------


def _build_minimax_depth() -> nn.Module:
    return MiniMaxMusic3RVQDepthDecoder(
        hidden_size=32,
        num_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        audio_vocab_size=16,
        num_codebooks=3,  # audio_heads x2 (not used by forward)
        max_position_embeddings=8,
    ).eval()


def _inputs_minimax_depth(g: torch.Generator) -> dict[str, Any]:
    return {"inputs_embeds": _randn(g, B, 4, 32)}


# --- PixArtTransformer2DModel --------------------------------------------------------------


def _build_pixart() -> nn.Module:
    return PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        cross_attention_dim=32,
        sample_size=8,
        patch_size=2,
        caption_channels=16,
        use_additional_conditions=False,
    ).eval()


def _inputs_pixart(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 4, 8, 8),
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "timestep": _tlong(g),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        "return_dict": False,
    }


# --- PriorTransformer ----------------------------------------------------------------------


def _build_prior() -> nn.Module:
    return PriorTransformer(
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        embedding_dim=16,
        num_embeddings=6,  # text sequence length
        additional_embeddings=4,  # proj, time, image, prd tokens
    ).eval()


def _inputs_prior(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 16),
        "timestep": _tlong(g),
        "proj_embedding": _randn(g, B, 16),
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "attention_mask": torch.ones(B, 6, dtype=torch.bool),
        "return_dict": False,
    }


# --- SanaTransformer2DModel ----------------------------------------------------------------


def _build_sana() -> nn.Module:
    return SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=16,
        sample_size=8,
        patch_size=1,
    ).eval()


def _inputs_sana(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 4, 8, 8),
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "timestep": _tlong(g),
        "return_dict": False,
    }


# --- StableAudioDiTModel -------------------------------------------------------------------


def _build_stable_audio() -> nn.Module:
    return StableAudioDiTModel(
        sample_size=16,
        in_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        num_key_value_attention_heads=1,
        out_channels=4,
        cross_attention_dim=16,
        time_proj_dim=16,
        global_states_input_dim=16,
        cross_attention_input_dim=16,
    ).eval()


def _inputs_stable_audio(g: torch.Generator) -> dict[str, Any]:
    # partial RoPE on half the head dim over latents + 1 prepended global token, as the pipeline
    rope = get_1d_rotary_pos_embed(8, 16 + 1, use_real=True, repeat_interleave_real=False)
    return {
        "hidden_states": _randn(g, B, 4, 16),
        "timestep": _rand(g, B),
        "encoder_hidden_states": _randn(g, B, 5, 16),
        "global_hidden_states": _randn(g, B, 1, 16),
        "rotary_embedding": rope,
        "return_dict": False,
    }


# --- T5FilmDecoder -------------------------------------------------------------------------


def _build_t5_film() -> nn.Module:
    return T5FilmDecoder(
        input_dims=8,
        targets_length=16,
        d_model=32,
        num_layers=2,
        num_heads=2,
        d_kv=16,
        d_ff=64,
    ).eval()


def _inputs_t5_film(g: torch.Generator) -> dict[str, Any]:
    # two encoders (notes, continuous context), concatenated for cross-attention
    encodings = [(_randn(g, B, 6, 32), torch.ones(B, 6)), (_randn(g, B, 4, 32), torch.ones(B, 4))]
    return {
        "encodings_and_masks": encodings,
        "decoder_input_tokens": _randn(g, B, 16, 8),
        "decoder_noise_time": _rand(g, B),
    }


# --- Transformer2DModel --------------------------------------------------------------------


def _build_transformer_2d() -> nn.Module:
    # continuous input (the SD UNet's spatial transformer)
    return Transformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=16,
        num_layers=2,
        norm_num_groups=8,
        cross_attention_dim=24,
    ).eval()


def _inputs_transformer_2d(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 16, 4, 4),
        "encoder_hidden_states": _randn(g, B, 6, 24),
        "return_dict": False,
    }


# --- DreamLiteTransformer2DModel -----------------------------------------------------------


def _build_dreamlite() -> nn.Module:
    return DreamLiteTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=16,
        num_layers=2,
        norm_num_groups=8,
        cross_attention_dim=24,
        qk_norm="rms_norm",
        ff_mult=2,  # num_kv_heads left unset: AttnProcessor2_0 has no GQA (head_dim from k)
    ).eval()


def _inputs_dreamlite(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 16, 4, 4),
        "encoder_hidden_states": _randn(g, B, 6, 24),
        "return_dict": False,
    }


# --- AllegroTransformer3DModel -------------------------------------------------------------


def _build_allegro() -> nn.Module:
    return AllegroTransformer3DModel(
        patch_size=2,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=24,  # 3D RoPE splits the head dim in 3 even parts
        in_channels=4,
        out_channels=4,
        num_layers=2,
        cross_attention_dim=48,  # = inner dim: captions are projected to it
        sample_height=8,
        sample_width=8,
        sample_frames=2,
        caption_channels=16,
    ).eval()


def _allegro_rope() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """3D RoPE over 2 frames x 4 x 4 patches, built as AllegroPipeline does."""
    freqs_t, freqs_h, freqs_w, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=24,
        crops_coords=((0, 0), (4, 4)),
        grid_size=(4, 4),
        temporal_size=2,
        interpolation_scale=(2.2, 2.0, 2.0),
    )
    pos = torch.cartesian_prod(grid_t.long(), grid_h.long(), grid_w.long())
    pos = pos.reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1).contiguous()
    return (freqs_t, freqs_h, freqs_w), tuple(pos)


def _inputs_allegro(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": _randn(g, B, 4, 2, 8, 8),
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "timestep": _tlong(g),
        "image_rotary_emb": _allegro_rope(),
        "return_dict": False,
    }


# --- AnyFlowTransformer3DModel -------------------------------------------------------------


def _build_anyflow() -> nn.Module:
    return AnyFlowTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # rope splits head dim 3 ways: 4 + 4 + 4
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=48,
        num_layers=2,
        image_dim=16,  # I2V image embedder
        rope_max_seq_len=32,
    ).eval()


def _inputs_anyflow(g: torch.Generator) -> dict[str, Any]:
    t = _t1000(g)[:, None].expand(B, 2).contiguous()  # per-frame timesteps (B, F)
    return {
        "hidden_states": _randn(g, B, 2, 4, 8, 8),
        "timestep": t,
        "r_timestep": t * 0.5,
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "encoder_hidden_states_image": _randn(g, B, 3, 16),
        "return_dict": False,
    }


# --- AnyFlowFARTransformer3DModel ----------------------------------------------------------


def _build_anyflow_far() -> nn.Module:
    return AnyFlowFARTransformer3DModel(
        patch_size=(1, 2, 2),
        compressed_patch_size=(1, 4, 4),
        full_chunk_limit=2,  # 3 chunks: the first is demoted to compressed context
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=48,
        num_layers=2,
        rope_max_seq_len=32,
        chunk_partition=(1, 1, 1),
    ).eval()


def _inputs_anyflow_far(g: torch.Generator) -> dict[str, Any]:
    t = _t1000(g)[:, None].expand(B, 3).contiguous()
    # no kv_cache: the training-rollout path, one full causal pass over all chunks
    return {
        "hidden_states": _randn(g, B, 3, 4, 8, 8),
        "timestep": t,
        "r_timestep": t * 0.5,
        "encoder_hidden_states": _randn(g, B, 6, 16),
        "chunk_partition": [1, 1, 1],
        "return_dict": False,
    }


CASES: list[Case] = [
    Case("AceStepTransformer1DModel", _build_ace_step, _inputs_ace_step),
    Case("AuraFlowTransformer2DModel", _build_auraflow, _inputs_auraflow),
    Case("CogVideoXTransformer3DModel", _build_cogvideox, _inputs_cogvideox),
    Case(
        "ConsisIDTransformer3DModel",
        _build_consisid,
        _inputs_consisid,
        note=(
            "local_facial_extractor (registered last) runs first; its layers are [attn, ff]"
            " ModuleList pairs whose children are called; perceiver_cross_attention runs"
            " interleaved with transformer_blocks (after blocks 0 and 2)"
        ),
    ),
    Case(
        "DiTTransformer2DModel",
        _build_dit,
        _inputs_dit,
        # its forward reads transformer_blocks[0].norm1.emb after the blocks ran
        note="reads block 0's time embedder after the blocks: keep block 0 resident",
        needs={"resident_layers": 1},
    ),
    Case(
        "HunyuanDiT2DModel",
        _build_hunyuan_dit,
        _inputs_hunyuan_dit,
        note="U-Net style long skip: block 3 takes block 0's output",
    ),
    Case(
        "LatteTransformer3DModel",
        _build_latte,
        _inputs_latte,
        note="transformer_blocks and temporal_transformer_blocks run interleaved",
    ),
    Case("LuminaNextDiT2DModel", _build_lumina_next, _inputs_lumina_next),
    Case(
        "MiniMaxMusic3RVQDepthDecoder",
        _build_minimax_depth,
        _inputs_minimax_depth,
        note="audio_heads (and audio_embeddings, projection) are not used by forward",
    ),
    Case("PixArtTransformer2DModel", _build_pixart, _inputs_pixart),
    Case("PriorTransformer", _build_prior, _inputs_prior),
    Case("SanaTransformer2DModel", _build_sana, _inputs_sana),
    Case("StableAudioDiTModel", _build_stable_audio, _inputs_stable_audio),
    Case("T5FilmDecoder", _build_t5_film, _inputs_t5_film),
    Case("Transformer2DModel", _build_transformer_2d, _inputs_transformer_2d),
    Case("DreamLiteTransformer2DModel", _build_dreamlite, _inputs_dreamlite),
    Case("AllegroTransformer3DModel", _build_allegro, _inputs_allegro),
    Case("AnyFlowTransformer3DModel", _build_anyflow, _inputs_anyflow),
    Case(
        "AnyFlowFARTransformer3DModel",
        _build_anyflow_far,
        _inputs_anyflow_far,
        note="causal self-attention needs the flex backend: eager flex_attention on CPU (slow)",
    ),
]

NOT_BUILT: dict[str, str] = {}
