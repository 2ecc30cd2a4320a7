"""Profile the first steps of the dlo row at a budget: a chrome trace of one call."""

import gzip
import json
import os
import sys

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from dlo.backends.factory import enable_offload
from dlo.bench import pipeline_budgets as pb
from dlo.commands.pipeline_calls import dits_of
from dlo.config.fields import GIB
from dlo.config.offload import OffloadConfig

folder, budget, size, steps, out = (
    sys.argv[1],
    float(sys.argv[2]),
    sys.argv[3],
    sys.argv[4],
    sys.argv[5],
)
args = pb.parse([folder, "--budgets", str(budget), "--size", size, "--steps", steps])
b = pb.Bench(args)
pipe = pb.resident_reference(folder, b.dtype, torch.device("cpu"))
undo = b.platform.cap_memory(int(budget * GIB))
pb._clean(b.platform)
backend = enable_offload(pipe, OffloadConfig(device_budget_gb=budget), device=b.device)
dit = dits_of(pipe)[0]
ranges = []


def pre(*_):
    r = record_function(f"DIT_FORWARD_{len(ranges)}")
    r.__enter__()
    ranges.append(r)


def post(*_):
    ranges[-1].__exit__(None, None, None)


h1, h2 = dit.register_forward_pre_hook(pre), dit.register_forward_hook(post)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    res, times = b.call(pipe, 0, reset=False)
h1.remove()
h2.remove()
print("times", json.dumps(times))
st = backend.stats()
print("replans", json.dumps(st.get("policy", {}).get("replans", []), default=str)[:2000])
path = os.path.join(out, f"trace_{int(budget)}_{size}.json")
prof.export_chrome_trace(path)
with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
    g.write(f.read())
os.remove(path)
# second call: steady (no trace)
res, times = b.call(pipe, 0, reset=False)
print("times2", json.dumps(times))
backend.disable()
undo and undo()
