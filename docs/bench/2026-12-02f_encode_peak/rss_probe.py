"""Probe (issue 22): the host peak of an enable with codec="ans" on a model built in memory.
Run from the repository root: PYTHONPATH=. python3 docs/bench/2026-12-02f_encode_peak/rss_probe.py
(DEVICE=cuda by default, NB blocks of 67 MB bf16). VmHWM is reset just before enable."""

import json
import os
import time

import torch
from torch import nn

import dlo
from dlo.platform.env import process_peak_rss_bytes

NB = int(os.environ.get("NB", 48))
DEVICE = os.environ.get("DEVICE", "cuda")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2048, 8192).to(torch.bfloat16)
        self.b = nn.Linear(8192, 2048).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x))


class Model(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(NB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


model = Model()
model_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
if DEVICE == "cuda":
    torch.zeros(1, device="cuda")  # the CUDA context before the baseline
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM
base = process_peak_rss_bytes()
t = time.perf_counter()
backend = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer", codec="ans"), device=DEVICE)
enable_s = time.perf_counter() - t
stats = backend.stats()
report = {
    "dlo": dlo.__file__,
    "model_nbytes": model_nbytes,
    "rss_before_enable": base,
    "peak_rss_enable": process_peak_rss_bytes(),
    "host_nbytes": stats["host_nbytes"],
    "enable_s": enable_s,
}
backend.disable()
print(json.dumps(report))
