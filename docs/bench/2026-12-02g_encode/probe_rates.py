# ruff: noqa  (a one-off probe, kept as the record of docs/benchmarks.md's rates)
"""Rates of the encode pass's steps on one GPU (issue 22, faster first-time encode).

Run: PYTHONPATH=.:/tmp/site python3 docs/bench/2026-12-02g_encode/probe_rates.py OUT.json
"""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from nvidia import nvcomp

MB = 1 << 20
res: dict[str, float] = {}


def rate(name, fn, nbytes, reps=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / reps
    res[name + "_GBps"] = round(nbytes / dt / 1e9, 2)
    print(f"{name}: {nbytes / dt / 1e9:.2f} GB/s ({dt * 1e3:.2f} ms)", flush=True)


n = 288 * MB
dev = torch.device("cuda")
w = (torch.randn(n // 2, device=dev) * 0.02).to(torch.bfloat16).view(torch.uint8)
host = w.cpu()
pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
pinned.copy_(host)
pageable2 = torch.empty(n, dtype=torch.uint8)
pageable2.copy_(host)
dbuf = torch.empty(n, dtype=torch.uint8, device=dev)

rate("h2d_pageable", lambda: dbuf.copy_(pageable2), n)
rate("h2d_pinned", lambda: dbuf.copy_(pinned, non_blocking=True), n)
rate("d2h_pageable", lambda: pageable2.copy_(dbuf), n)
rate("d2h_pinned", lambda: pinned.copy_(dbuf, non_blocking=True), n)
rate("d2h_new_pageable_cpu()", lambda: dbuf.cpu(), n)
rate("memcpy_1thread", lambda: pageable2.copy_(host), n)
for k in (4, 8, 16):
    pool = ThreadPoolExecutor(k)
    step = n // k

    def par():
        list(
            pool.map(
                lambda i: pageable2[i * step : (i + 1) * step].copy_(
                    host[i * step : (i + 1) * step]
                ),
                range(k),
            )
        )

    rate(f"memcpy_{k}threads", par, n)
    rate(
        f"to_pinned_{k}threads",
        lambda: list(
            pool.map(
                lambda i: pinned[i * step : (i + 1) * step].copy_(host[i * step : (i + 1) * step]),
                range(k),
            )
        ),
        n,
    )
rate("fresh_pageable_alloc_and_copy", lambda: torch.empty(n, dtype=torch.uint8).copy_(host), n)

stream = torch.cuda.Stream()
codec = nvcomp.Codec(algorithm="ANS", data_type="<f2", cuda_stream=stream.cuda_stream, device_id=0)
piece = 64 * MB
cc = codec.compression_config(piece)
print("config attrs", [a for a in dir(cc) if not a.startswith("_")], flush=True)
maxsize = int(getattr(cc, "max_compressed_buffer_size", 2 * piece))
res["max_compressed_ratio"] = maxsize / piece
arr = lambda t: nvcomp.as_array(t, cuda_stream=stream.cuda_stream)


def enc_alloc():
    with torch.cuda.stream(stream):
        for lo in range(0, n, piece):
            e = codec.encode(arr(dbuf[lo : lo + piece]), compression_config=cc)
            stream.synchronize()
            int(e.buffer_size)


outs = [torch.empty(maxsize, dtype=torch.uint8, device=dev) for _ in range(n // piece)]


def enc_out():
    with torch.cuda.stream(stream):
        es = []
        for k, lo in enumerate(range(0, n, piece)):
            es.append(
                codec.encode(arr(dbuf[lo : lo + piece]), out=arr(outs[k]), compression_config=cc)
            )
        stream.synchronize()
        return [int(e.buffer_size) for e in es]


dbuf.copy_(w)
rate("encode_alloc_sync_each", enc_alloc, n)
try:
    sizes = enc_out()
    print("out= sizes", sizes, flush=True)
    rate("encode_out_one_sync", enc_out, n)
    res["ratio"] = sum(sizes) / n
except Exception as e:  # noqa: BLE001
    print("encode out= failed:", repr(e), flush=True)
    res["encode_out_error"] = repr(e)
try:
    bsrc = [arr(dbuf[lo : lo + piece]) for lo in range(0, n, piece)]
    batch = nvcomp.BatchArray(bsrc) if hasattr(nvcomp, "BatchArray") else None
    print("BatchArray", hasattr(nvcomp, "BatchArray"), flush=True)
except Exception as e:  # noqa: BLE001
    print("batch failed", repr(e), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
