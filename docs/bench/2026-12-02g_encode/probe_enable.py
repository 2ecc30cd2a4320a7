"""Enable and disable(restore=True) times of the medium preset with the codec, built in memory
(one H200; the tree on PYTHONPATH first). Usage: probe_enable.py OUT.json LABEL [PRESET]"""

import json
import resource
import sys
import time

import torch

import dlo
from dlo.models import build_pipeline, make_inputs

label = sys.argv[2]
preset = sys.argv[3] if len(sys.argv) > 3 else "medium"
dev = "cuda" if torch.cuda.is_available() else "cpu"
pipe = build_pipeline(preset)
ref = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
row: dict[str, object] = {"label": label}
for codec in ("none", "ans"):
    t = time.perf_counter()
    b = dlo.enable_offload(pipe, dlo.OffloadConfig(mode="layer", codec=codec), device=dev)
    if dev == "cuda":
        torch.cuda.synchronize()
    row[f"enable_s_{codec}"] = round(time.perf_counter() - t, 3)
    ids, latents = make_inputs(preset, tokens=4096, device=dev)
    with torch.no_grad():
        pipe.generate(ids, latents, 1)
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    b.disable(restore=True)
    row[f"disable_restore_s_{codec}"] = round(time.perf_counter() - t, 3)
    got = pipe.transformer.state_dict()
    row[f"restored_bitwise_{codec}"] = all(torch.equal(ref[k], got[k]) for k in ref)
row["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
print(json.dumps(row), flush=True)
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(row) + "\n")
