"""Issue 22's probe of nvCOMP's Python API on one GPU: the calls dlo.codec.codecs makes
(encode, decode into a preallocated torch buffer with a reusable config, alignment, rates,
what a corrupted buffer does). Writes $OUT/probe.json (2026-12-02: docs/bench/2026-12-02d_codec).

    PYTHONPATH=.:/tmp/site python launch/nvcomp_probe.py
"""

import json
import os
import time
import traceback

import torch
from nvidia import nvcomp

out = {}


def rec(k, f):
    try:
        out[k] = f()
    except Exception as e:
        out[k] = f"ERR {type(e).__name__}: {e}"
        traceback.print_exc()


dev = torch.device("cuda")
torch.manual_seed(0)
s = torch.cuda.Stream()
n = 64 << 20
x = (torch.randn(n // 2, device=dev) * 0.02).to(torch.bfloat16)
xb = x.view(torch.uint8)
codec = nvcomp.Codec(algorithm="ANS", data_type="<f2", cuda_stream=s.cuda_stream)
rec("dir_codec", lambda: [a for a in dir(codec) if not a.startswith("_")])
rec("decomp_align", lambda: str(codec.get_required_decompression_alignment()))
rec("comp_align", lambda: str(codec.get_required_compression_alignment()))
rec("max_comp", lambda: codec.get_max_comp_buffer_size(n))
with torch.cuda.stream(s):
    cc = codec.compression_config(n)
    enc = codec.encode(nvcomp.as_array(xb), compression_config=cc)
    s.synchronize()
    rec("enc_size", lambda: enc.buffer_size)
    rec("enc_kind", lambda: str(enc.buffer_kind))
    encb = torch.from_dlpack(enc).view(torch.uint8).reshape(-1)
    rec("enc_torch", lambda: [encb.numel(), str(encb.device)])
    # into an external buffer of the max size
    maxn = int(out["max_comp"]) if isinstance(out["max_comp"], int) else 2 * n
    ext = torch.empty(maxn, dtype=torch.uint8, device=dev)

    def enc_ext():
        r = codec.encode(nvcomp.as_array(xb), out=nvcomp.as_array(ext), compression_config=cc)
        s.synchronize()
        return [r.buffer_size, r.shape if hasattr(r, "shape") else None]

    rec("enc_ext", enc_ext)
    dc = codec.decompression_config(cc)
    nb = encb.numel()
    staging = torch.empty(nb + 4096, dtype=torch.uint8, device=dev)
    staging[:nb].copy_(encb)
    slot = torch.zeros(n + 4096, dtype=torch.uint8, device=dev)

    def dec():
        r = codec.decode(
            nvcomp.as_array(staging[:nb]), out=nvcomp.as_array(slot[:n]), decompression_config=dc
        )
        s.synchronize()
        return [r.buffer_size, bool(torch.equal(slot[:n], xb))]

    rec("dec_ext", dec)
    # a second codec object decoding with a config built from a fresh compression config
    codec2 = nvcomp.Codec(algorithm="ANS", data_type="<f2", cuda_stream=s.cuda_stream)

    def dec2():
        dc2 = codec2.decompression_config(codec2.compression_config(n))
        slot.zero_()
        codec2.decode(
            nvcomp.as_array(staging[:nb]), out=nvcomp.as_array(slot[:n]), decompression_config=dc2
        )
        s.synchronize()
        return bool(torch.equal(slot[:n], xb))

    rec("dec_other_codec", dec2)

    def dec_hdr():
        dc3 = codec2.decompression_config(nvcomp.as_array(staging[:nb]))
        slot.zero_()
        codec2.decode(
            nvcomp.as_array(staging[:nb]), out=nvcomp.as_array(slot[:n]), decompression_config=dc3
        )
        s.synchronize()
        return bool(torch.equal(slot[:n], xb))

    rec("dec_header_cfg", dec_hdr)

    def rate():
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            codec.decode(
                nvcomp.as_array(staging[:nb]),
                out=nvcomp.as_array(slot[:n]),
                decompression_config=dc,
            )
        e0.record(s)
        t0 = time.perf_counter()
        for _ in range(20):
            codec.decode(
                nvcomp.as_array(staging[:nb]),
                out=nvcomp.as_array(slot[:n]),
                decompression_config=dc,
            )
        t1 = time.perf_counter()
        e1.record(s)
        s.synchronize()
        return {
            "gpu_ms_per": e0.elapsed_time(e1) / 20,
            "host_ms_per": (t1 - t0) * 1e3 / 20,
            "GBps": n / (e0.elapsed_time(e1) / 20 / 1e3) / 1e9,
        }

    rec("decode_rate", rate)

    def enc_rate():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            codec.encode(nvcomp.as_array(xb), out=nvcomp.as_array(ext), compression_config=cc)
        s.synchronize()
        return n * 5 / (time.perf_counter() - t0) / 1e9

    rec("encode_GBps", enc_rate)

    # odd sizes: a piece not a multiple of 64 KiB, fp32 mixed in
    def odd():
        m = (3 << 20) + 512
        y = torch.randn(m // 4, device=dev).view(torch.uint8)
        c3 = codec.compression_config(m)
        e = codec.encode(nvcomp.as_array(y), compression_config=c3)
        s.synchronize()
        eb = torch.from_dlpack(e).view(torch.uint8).reshape(-1).clone()
        o = torch.zeros(m, dtype=torch.uint8, device=dev)
        codec.decode(
            nvcomp.as_array(eb),
            out=nvcomp.as_array(o),
            decompression_config=codec.decompression_config(c3),
        )
        s.synchronize()
        return [eb.numel() / m, bool(torch.equal(o, y))]

    rec("fp32_odd", odd)

    def ptr_offset():  # decode from a staging slice at an offset of 256 bytes
        st2 = torch.empty(nb + 512, dtype=torch.uint8, device=dev)
        st2[256 : 256 + nb].copy_(encb)
        slot.zero_()
        codec.decode(
            nvcomp.as_array(st2[256 : 256 + nb]),
            out=nvcomp.as_array(slot[256 : 256 + n]),
            decompression_config=dc,
        )
        s.synchronize()
        return bool(torch.equal(slot[256 : 256 + n], xb))

    rec("offset_256", ptr_offset)

    def corrupt():
        bad = staging[:nb].clone()
        bad[nb // 2] ^= 0xFF
        bad[100] ^= 0x55
        codec.decode(nvcomp.as_array(bad), out=nvcomp.as_array(slot[:n]), decompression_config=dc)
        s.synchronize()
        return bool(torch.equal(slot[:n], xb))

    rec("corrupt_decode_equal", corrupt)

    def truncated_src():
        codec.decode(
            nvcomp.as_array(staging[: nb // 2]),
            out=nvcomp.as_array(slot[:n]),
            decompression_config=dc,
        )
        s.synchronize()
        return "no error"

    rec("truncated_src", truncated_src)
out["ratio_bf16_normal"] = (
    out.get("enc_size", 0) / n if isinstance(out.get("enc_size"), int) else None
)
print(json.dumps(out, indent=1, default=str))
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "probe.json"), "w") as f:
    json.dump(out, f, indent=1, default=str)
