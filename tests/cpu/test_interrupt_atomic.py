"""Issue 26 item 4: a KeyboardInterrupt at any line of ``enable`` leaves the model exactly as
before (tensors, hooks, dlo's ledger, no claim left) and a fresh enable gives the same bits
(see [Note: interrupts during enable] in :mod:`dlo.journal`); one at any line of ``disable``
leaves the backend enabled or not, and a second ``disable`` leaves the model as before
([Note: interrupts during disable]). CI interrupts every
``STRIDE``-th distinct line of dlo's code that enable runs; ``launch/interrupt_probe.py``
runs every one (about 3 minutes per mode on 2 cores)."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import pytest
import torch

import dlo
from dlo.host.region import LEDGER
from dlo.journal import masked
from dlo.models import build_pipeline, make_inputs

logger = logging.getLogger(__name__)
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


def _traced(call: Any, local: Any) -> None:
    sys.settrace(lambda f, e, a: local if f.f_code.co_filename.startswith(ROOT) else None)
    try:
        call()
    finally:
        sys.settrace(None)


def _lines(cfg: dlo.OffloadConfig, model: Any, phase: str) -> list[Line]:
    """Every distinct dlo line one enable (or disable) executes, in first-execution order."""
    seen: dict[Line, None] = {}

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            seen.setdefault((frame.f_code.co_filename, frame.f_lineno))
        return local

    backend = dlo.get_offload_backend(cfg, None, "cpu")
    if phase == "disable":
        backend.enable(model)
    _traced(lambda: backend.enable(model) if phase == "enable" else backend.disable(), local)
    backend.disable()
    return list(seen)


def _interrupted(cfg: dlo.OffloadConfig, model: Any, target: Line, phase: str) -> tuple[bool, Any]:
    """Enable (or enable, then disable) with a KeyboardInterrupt at ``target``'s first
    execution in that phase."""
    hit = [False]

    def local(frame: Any, event: str, arg: Any) -> Any:
        here = (frame.f_code.co_filename, frame.f_lineno)
        if event == "line" and not hit[0] and here == target and not masked():
            hit[0] = True  # inside dlo.journal.atomic a real SIGINT is deferred: none here
            raise KeyboardInterrupt
        return local

    backend = dlo.get_offload_backend(cfg, None, "cpu")
    if phase == "disable":
        backend.enable(model)
    try:
        _traced(lambda: backend.enable(model) if phase == "enable" else backend.disable(), local)
    except KeyboardInterrupt:
        pass
    return hit[0], backend


def probe(
    mode: str, stride: int = 1, limit: int = 10**9, phase: str = "enable"
) -> tuple[int, dict[Line, str]]:
    """Interrupt every ``stride``-th distinct line (up to ``limit`` of them) of ``phase``;
    returns how many were tried and the ones that broke, with why. An interrupted enable
    must leave the model as before; an interrupted disable either finished or leaves the
    backend enabled, and a second ``disable()`` finishes it ([Note: interrupts during
    disable])."""
    cfg = (
        dlo.OffloadConfig(mode="module")
        if mode == "module"
        else dlo.OffloadConfig(
            mode="layer",
            components=("dit", "encoder"),
            codec="ans" if mode == "layer-codec" else "none",  # its encode pass, bounce buffers
        )
    )
    model = build_pipeline("tiny", dtype=torch.float32)
    ids, latents = make_inputs("tiny", tokens=None, seed=0, device="cpu", dtype=torch.float32)
    ref = model.generate(ids, latents, 1)
    before = _snapshot(model)
    lines = _lines(cfg, model, phase)[:limit:stride]
    bad: dict[Line, str] = {}
    t0 = time.time()
    for target in lines:
        ledger = (LEDGER.host_nbytes, LEDGER.pinned_nbytes)
        try:
            hit, backend = _interrupted(cfg, model, target, phase)
        except Exception as e:
            bad[target] = f"raised {type(e).__name__}: {e}"[:200]
            continue
        if not hit:
            backend.disable()
            continue
        why = ""
        if backend.is_enabled():
            if phase == "enable":
                why = "is_enabled after interrupt"
            else:  # the interrupted disable is resumed
                try:
                    backend.disable()
                except Exception as e:
                    why = f"second disable: {type(e).__name__}: {e}"[:200]
                why = why or ("is_enabled after a second disable" if backend.is_enabled() else "")
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
                logger.info("disable after %s: %s", target, type(e).__name__)
            model = build_pipeline("tiny", dtype=torch.float32)
            before = _snapshot(model)
    logger.info("%s %s: %d bad of %d in %.1fs", phase, mode, len(bad), len(lines), time.time() - t0)
    return len(lines), bad


STRIDE = 5


@pytest.mark.parametrize("mode", ["layer", "module", "layer-codec"])
def test_an_interrupt_at_any_line_of_enable_leaves_the_model_as_before(mode: str) -> None:
    tried, bad = probe(mode, stride=STRIDE)
    assert tried > 80, tried  # the probe reached enable's code
    listed = [f"{os.path.relpath(p, ROOT)}:{n}: {why}" for (p, n), why in bad.items()]
    assert not bad, "\n".join(listed)


@pytest.mark.parametrize("mode", ["layer", "module"])
def test_an_interrupted_disable_is_finished_by_the_next_one(mode: str) -> None:
    tried, bad = probe(mode, stride=2, phase="disable")
    assert tried > 15, tried  # the probe reached disable's code
    listed = [f"{os.path.relpath(p, ROOT)}:{n}: {why}" for (p, n), why in bad.items()]
    assert not bad, "\n".join(listed)


def test_atomic_defers_a_real_sigint_to_its_end() -> None:
    import signal

    from dlo.journal import atomic

    done: list[str] = []
    # Python's own handler (another test of this worker may have installed its own)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), atomic():
            with atomic():  # nested: only the outermost block delivers it
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler has run by now
                done.append("inner")
            done.append("outer")
        assert done == ["inner", "outer"] and not masked()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_undo_failure_is_raised_by_the_rollback_that_finishes() -> None:
    """An undo fails, an interrupt lands before the next one: the resumed rollback runs the
    rest and raises the failure (it was lost to the interrupt before)."""
    import signal

    from dlo.journal import Journal

    ran: list[str] = []
    journal = Journal()
    journal.record("last", lambda: ran.append("last"))
    journal.record("interrupted", lambda: os.kill(os.getpid(), signal.SIGINT))
    journal.record("fails", lambda: (_ for _ in ()).throw(ValueError("first failure")))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            journal.rollback()
        assert len(journal) == 1 and ran == []
        with pytest.raises(ValueError, match="first failure"):
            journal.rollback()
        assert len(journal) == 0 and ran == ["last"]
        journal.rollback()  # idempotent, nothing left to raise
    finally:
        signal.signal(signal.SIGINT, previous)
