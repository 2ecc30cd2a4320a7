"""Probe (issue 22 item 5; run from the repository root with PYTHONPATH=.): step time of a transfer-bound toy DiT streamed bf16 vs
torchao int8/fp8 weight-only as stored."""

import json
import os
import time

import torch
from torch import nn

import dlo
from tests.cpu.test_subclasses import CONFIGS, QBlock, torchao_quant

DEV = torch.device("cuda", 0)
DIM, N, TOK = (
    int(os.environ.get("DIM", 3072)),
    int(os.environ.get("NB", 16)),
    int(os.environ.get("TOK", 256)),
)


class DiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(QBlock(DIM) for _ in range(N))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.to(torch.bfloat16)
        if kind != "bf16":
            torchao_quant.quantize_(self, CONFIGS[kind]())

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def timeit(model, x, reps=10):
    with torch.no_grad():
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            out = model(x)
        e.record()
        torch.cuda.synchronize()
    return s.elapsed_time(e) / reps, out


res = []
x = torch.randn(1, TOK, DIM, device=DEV, dtype=torch.bfloat16)
# H2D limit: pinned copy rate of one block's bytes
buf = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
d = torch.empty_like(buf, device=DEV)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20):
    d.copy_(buf, non_blocking=True)
torch.cuda.synchronize()
h2d = 20 * buf.numel() / (time.perf_counter() - t) / 1e9
for kind in ["bf16", "int8", "fp8"]:
    m = DiT(kind).to(DEV)
    ms_res, ref = timeit(m, x)
    del m
    torch.cuda.empty_cache()
    m = DiT(kind)
    b = dlo.enable_offload(m, dlo.OffloadConfig(mode="layer"), device=DEV)
    ms_ring, out = timeit(m, x)
    st = b.stats()
    b.disable()
    host = st["host_nbytes"]
    res.append(
        dict(
            kind=kind,
            resident_ms=ms_res,
            ring_ms=ms_ring,
            bitwise=bool(torch.equal(out, ref)),
            host_nbytes=host,
            h2d_limit_ms=host / h2d / 1e6,
            h2d_gbps=h2d,
        )
    )
    print(res[-1], flush=True)
report = dict(
    dim=DIM,
    blocks=N,
    tokens=TOK,
    results=res,
    torch=torch.__version__,
    gpu=torch.cuda.get_device_name(),
)
with open(os.path.join(os.environ.get("OUT", "."), "quant_probe.json"), "w") as f:
    json.dump(report, f, indent=1)
