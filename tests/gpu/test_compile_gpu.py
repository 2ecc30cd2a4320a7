"""torch.compile with the ring on one CUDA GPU (Inductor, Triton kernels): the demo DiT
compiled per block (compile_repeated_blocks) and whole, bitwise equal to the same compile of
the resident model, one set of graphs whatever slot a block lands in; CUDA-graph modes
refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import dlo
from dlo.bench.methods import _inputs
from dlo.errors import OffloadError
from dlo.models import build_pipeline
from tests.cpu.test_compile import Counter

DEV = torch.device("cuda", 0)
PRESET = "tiny"


def _dit() -> torch.nn.Module:
    return build_pipeline(PRESET, dtype=torch.bfloat16).transformer


def _compile(dit: torch.nn.Module, form: str, backend: Any, mode: str | None) -> Any:
    if form == "repeated":
        dit.compile_repeated_blocks(backend=backend, mode=mode, fullgraph=True)
        return dit
    return torch.compile(dit, backend=backend, mode=mode)


def _forwards(fn: Any, tokens: tuple[int, ...] = (64, 64, 96, 64)) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for t in tokens:
            out.append(fn(*_inputs(PRESET, t, DEV, torch.bfloat16)).clone())
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize(
    "form, mode",
    [("repeated", None), ("whole", None), ("repeated", "max-autotune-no-cudagraphs")],
)
def test_compiled_ring_is_bitwise_to_the_compiled_resident_model(
    form: str, mode: str | None
) -> None:
    dit = _dit()
    torch._dynamo.reset()
    ref_counter = Counter("inductor")
    ref = _forwards(_compile(copy.deepcopy(dit).to(DEV), form, ref_counter, mode))
    torch._dynamo.reset()
    counter = Counter("inductor")
    backend = dlo.enable_offload(dit, dlo.OffloadConfig(mode="layer", num_slots=2), device=DEV)
    assert backend is not None
    fn = _compile(dit, form, counter, mode)
    got = _forwards(fn)
    graphs = counter.graphs
    again = _forwards(fn)  # the blocks land in other slots now
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), form
    assert all(torch.equal(a, b) for a, b in zip(ref, again)), form
    assert counter.graphs == graphs  # nothing recompiled on the second pass
    if form == "repeated":
        assert graphs == ref_counter.graphs
    backend.disable()


def test_cuda_graph_mode_is_refused_on_the_gpu() -> None:
    dit = _dit()
    backend = dlo.enable_offload(dit, dlo.OffloadConfig(mode="layer"), device=DEV)
    assert backend is not None
    with pytest.raises(OffloadError, match="max-autotune-no-cudagraphs"):
        dit.compile_repeated_blocks(mode="reduce-overhead")
    backend.disable()
