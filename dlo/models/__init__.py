"""The embedded default pipeline: a small but real text-to-image/video diffusion model with
deterministic random weights, in three sizes (:data:`PRESETS`)."""

from dlo.models.blocks import Attention, DiTBlock, FP32LayerNorm, Mlp, TextEncoderBlock
from dlo.models.build import build_pipeline, init_weights, tensor_seed
from dlo.models.decoder import Decoder
from dlo.models.dit import DiT
from dlo.models.pipeline import DemoPipeline, make_inputs
from dlo.models.presets import PRESETS, Preset, get_preset
from dlo.models.text_encoder import TextEncoder

__all__ = [
    "PRESETS",
    "Attention",
    "Decoder",
    "DemoPipeline",
    "DiT",
    "DiTBlock",
    "FP32LayerNorm",
    "Mlp",
    "Preset",
    "TextEncoder",
    "TextEncoderBlock",
    "build_pipeline",
    "get_preset",
    "init_weights",
    "make_inputs",
    "tensor_seed",
]
