"""Probe of issue 40 item 8 on one GPU ([Note: compile across shapes]): Wan2.1-14B block shapes
(random bf16 weights, a few blocks), every block's forward compiled with
``torch.compile(block.forward)`` before enable, a forward at one latent frame count then
another, in one process per method; the outputs go to a file to compare across processes.

Usage: python launch/compile_shapes_probe.py resident|dlo FRAMES,FRAMES NUM_BLOCKS OUT.pt
       default|det|static  (det: Inductor's deterministic mode; static: dynamic=False)
"""

import sys

import torch
import torch._inductor.config as inductor_config
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

import dlo

mode, frames_list = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
num_blocks, out, variant = int(sys.argv[3]), sys.argv[4], sys.argv[5]
if variant == "det":
    inductor_config.deterministic = True
options = {"dynamic": False} if variant == "static" else {}
torch.manual_seed(0)
config = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=num_blocks,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
with torch.device("cuda"):
    model = WanTransformer3DModel(**config).eval().to(torch.bfloat16)
backend = None
if mode == "dlo":
    model.cpu()
for block in model.blocks:
    block.forward = torch.compile(block.forward, **options)
if mode == "dlo":
    backend = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer"))
g = torch.Generator(device="cuda").manual_seed(1)
outs = []
for frames in frames_list:
    hs = torch.randn(1, 16, frames, 60, 104, generator=g, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 512, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        t = torch.tensor([500], device="cuda")
        outs.append(model(hs, t, text, return_dict=False)[0].cpu())
torch.save(outs, out)
print(mode, variant, frames_list, "done")
