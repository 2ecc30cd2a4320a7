"""Model-level swap on one CUDA GPU: parity, exclusion, pinned host copies, nothing left."""

from __future__ import annotations

import torch

import dlo
from dlo.host.region import LEDGER
from dlo.models import build_pipeline, make_inputs

DEV = torch.device("cuda", 0)


def test_swap_demo_pipeline_parity_and_exclusion() -> None:
    ref = build_pipeline("tiny", device=DEV)
    pipe = build_pipeline("tiny")
    backend = dlo.enable_offload(pipe, dlo.OffloadConfig(mode="module"), device=DEV)
    assert backend is not None
    st = backend.stats()
    assert st["host_pinned_nbytes"] == st["host_nbytes"] > 0
    ids, lat = make_inputs("tiny", seed=2, device=DEV)
    for _ in range(2):
        assert torch.equal(ref.generate(ids, lat, 3), pipe.generate(ids, lat, 3))
    comps = backend.stats()["components"]
    # after a generate the DiT ran last: it is resident, the encoder is not
    assert comps["transformer"]["resident"] and not comps["text_encoder"]["resident"]
    assert all(p.numel() == 0 for p in pipe.text_encoder.parameters())
    assert comps["transformer"]["num_loads"] == 2 and comps["transformer"]["timed_loads"] >= 1
    before = torch.cuda.memory_allocated(DEV)
    backend.disable()
    assert LEDGER.pinned_nbytes == 0 and LEDGER.host_nbytes == 0
    assert torch.cuda.memory_allocated(DEV) < before
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in pipe.transformer.parameters())
