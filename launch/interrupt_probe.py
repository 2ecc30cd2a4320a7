"""Issue 26 item 4's probe (a developer tool, not a test): raise KeyboardInterrupt at the
first execution of each distinct line of dlo's code during ``enable`` of the tiny demo
pipeline, then check the model is exactly as before (tensors, hooks, dlo's ledger, no
claim) and that a fresh enable gives the same bits; prints every point that breaks that.

    PYTHONPATH=. python launch/interrupt_probe.py layer|module [LIMIT]

2026-12-02 (CPU, torch 2.13): layer 22 of 1160 points, module 21 of 639 (about 3 min each).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

import dlo
from dlo.host.region import LEDGER
from dlo.models import build_pipeline, make_inputs

ROOT = os.path.dirname(dlo.__file__)
Line = tuple[str, int]


def _snapshot(model: Any) -> tuple[dict[str, Any], int]:
    sd = model.state_dict(keep_vars=True)
    tensors = {k: (v.device, v.dtype, tuple(v.shape), v.detach().clone()) for k, v in sd.items()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return tensors, hooks


def _difference(model: Any, before: tuple[dict[str, Any], int], ledger: tuple[int, int]) -> str:
    tensors, hooks = _snapshot(model)
    if hooks != before[1]:
        return f"hooks {hooks} != {before[1]}"
    for k, (device, dtype, shape, value) in before[0].items():
        d2, t2, s2, v2 = tensors[k]
        if (device, dtype, shape) != (d2, t2, s2):
            return f"{k}: {s2} {d2} {t2}"
        if not torch.equal(value, v2):
            return f"{k}: values"
    now = (LEDGER.host_nbytes, LEDGER.pinned_nbytes)
    return f"ledger +{now[0] - ledger[0]} host bytes" if now != ledger else ""


def _lines(cfg: dlo.OffloadConfig, model: Any) -> list[Line]:
    """Every distinct dlo line one enable executes, in first-execution order."""
    seen: dict[Line, None] = {}

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            seen.setdefault((frame.f_code.co_filename, frame.f_lineno))
        return local

    backend = dlo.get_offload_backend(cfg, None, "cpu")
    sys.settrace(lambda f, e, a: local if f.f_code.co_filename.startswith(ROOT) else None)
    try:
        backend.enable(model)
    finally:
        sys.settrace(None)
    backend.disable()
    return list(seen)


def _interrupted_enable(cfg: dlo.OffloadConfig, model: Any, target: Line) -> tuple[bool, Any]:
    """Enable with a KeyboardInterrupt at ``target``'s first execution."""
    hit = [False]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not hit[0] and (frame.f_code.co_filename, frame.f_lineno) == target:
            hit[0] = True
            raise KeyboardInterrupt
        return local

    backend = dlo.get_offload_backend(cfg, None, "cpu")
    sys.settrace(lambda f, e, a: local if f.f_code.co_filename.startswith(ROOT) else None)
    try:
        backend.enable(model)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return hit[0], backend


def main(mode: str, limit: int) -> None:
    cfg = (
        dlo.OffloadConfig(mode="module")
        if mode == "module"
        else dlo.OffloadConfig(mode="layer", components=("dit", "encoder"))
    )
    model = build_pipeline("tiny", dtype=torch.float32)
    ids, latents = make_inputs("tiny", tokens=None, seed=0, device="cpu", dtype=torch.float32)
    ref = model.generate(ids, latents, 1)
    before = _snapshot(model)
    lines = _lines(cfg, model)[:limit]
    bad: dict[Line, str] = {}
    t0 = time.time()
    for target in lines:
        ledger = (LEDGER.host_nbytes, LEDGER.pinned_nbytes)
        try:
            hit, backend = _interrupted_enable(cfg, model, target)
        except Exception as e:
            bad[target] = f"raised {type(e).__name__}: {e}"[:200]
            continue
        if not hit:
            backend.disable()
            continue
        why = "is_enabled after interrupt" if backend.is_enabled() else ""
        why = why or _difference(model, before, ledger)
        if not why:
            try:
                again = dlo.get_offload_backend(cfg, None, "cpu")
                again.enable(model)
                same = torch.equal(model.generate(ids, latents, 1), ref)
                again.disable()
                why = "" if same else "re-enable not bitwise"
            except Exception as e:
                why = f"re-enable: {type(e).__name__}: {e}"[:200]
        if why:
            bad[target] = why
            try:
                backend.disable()
            except Exception as e:
                print(f"  (disable after {target}: {type(e).__name__})")
            model = build_pipeline("tiny", dtype=torch.float32)
            before = _snapshot(model)
    print(f"{mode}: {len(bad)} bad of {len(lines)} in {time.time() - t0:.1f}s")
    for (path, lineno), why in bad.items():
        print(f"  {os.path.relpath(path, ROOT)}:{lineno}: {why}")


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "layer",
        int(sys.argv[2]) if len(sys.argv) > 2 else 10**9,
    )
