"""Check zoo cases without dlo: ``python -m tests.zoo.check tests.zoo.diffusers_a [Name ...]``.

Each case must build (eval, float32, CPU), run two forwards on the same inputs with equal
tensors bit for bit, produce at least one floating tensor with no NaN, and be fast (the
build and a forward under a few seconds). Prints one line per case.
"""

from __future__ import annotations

import importlib
import sys
import time

import torch

from tests.zoo import Case, tensors_of


def check(case: Case) -> str:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = case.build()
    t1 = time.perf_counter()
    assert type(model).__name__ == case.name, (type(model).__name__, case.name)
    assert not model.training, "build() must return the model in eval mode"
    n = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        outs = []
        for _ in range(2):
            g = torch.Generator().manual_seed(1)
            outs.append(list(tensors_of(case.run(model, case.inputs(g)))))
    t2 = time.perf_counter()
    a, b = outs
    assert a and len(a) == len(b), "no tensors in the output"
    assert any(t.is_floating_point() for t in a), "no floating tensor in the output"
    for x, y in zip(a, b):
        assert torch.equal(x, y), "two forwards differ"
        if x.is_floating_point():
            assert not torch.isnan(x).any(), "NaN in the output"
    return f"{case.name}: ok, {n / 1e6:.2f} M params, build {t1 - t0:.2f} s, 2 forwards {t2 - t1:.2f} s"


def main(argv: list[str]) -> int:
    mod = importlib.import_module(argv[0])
    want = set(argv[1:])
    bad = 0
    for case in mod.CASES:
        if want and case.name not in want:
            continue
        try:
            print(check(case), flush=True)
        except Exception as e:  # report every case
            bad += 1
            print(f"{case.name}: FAIL {type(e).__name__}: {e}", flush=True)
    for name, why in getattr(mod, "NOT_BUILT", {}).items():
        print(f"{name}: not built on CPU: {why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
