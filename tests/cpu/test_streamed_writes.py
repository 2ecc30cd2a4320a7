"""A block (or swapped component) that writes its own tensors in place: the write is kept
where the host holds whole blocks, and refused by name where it cannot be kept (see [Note:
writes into streamed tensors] in dlo.runtime.streamed)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

import dlo
from dlo.host.region import LEDGER
from tests.harness import assert_all_ok, run_ranks
from tests.toys import ToyEncoder, clone

DIM = 16


class _CachingBlock(nn.Module):
    """Refreshes a residual cache (a buffer, written in place) on even steps and reuses it
    on odd steps, as step-caching schemes do; also counts its calls in a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.calls = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.register_buffer("cache", torch.zeros(DIM), persistent=False)

    def forward(self, h: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        self.calls.add_(1)
        if reuse:
            return h + self.cache
        out = torch.tanh(self.lin(h))
        self.cache.copy_((out - h).mean(dim=(0, 1)))
        return out


class _CachingDiT(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_CachingBlock() for _ in range(n))

    def forward(self, h: torch.Tensor, step: int) -> torch.Tensor:
        for blk in self.blocks:
            h = blk(h, reuse=step % 2 == 1)
        return h


def _x(step: int) -> torch.Tensor:
    return torch.randn(2, 3, DIM, generator=torch.Generator().manual_seed(step))


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in [*m.named_parameters(), *m.named_buffers()]}


@pytest.mark.parametrize("num_slots, resident", [(1, 0), (2, 0), (2, 1)])
def test_ring_keeps_in_place_writes_like_the_resident_model(num_slots: int, resident: int) -> None:
    # resident: a resident block keeps its writes on the device; disable restores them too
    torch.manual_seed(0)
    model = _CachingDiT()
    ref = clone(model)
    cfg = dlo.OffloadConfig(mode="layer", num_slots=num_slots, resident_layers=resident)
    b = dlo.enable_offload(model, cfg, None, "cpu")
    with torch.no_grad():
        for step in range(6):
            assert torch.equal(model(_x(step), step), ref(_x(step), step)), step
    b.disable()
    got, want = _state(model), _state(ref)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert float(model.blocks[0].calls) == 6.0
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


class _SwapPipeline(nn.Module):
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = ToyEncoder(dim=DIM)
        self.transformer = _CachingDiT()

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.transformer(x + self.text_encoder(x), step)


def test_model_swap_keeps_in_place_writes_across_evictions() -> None:
    torch.manual_seed(0)
    pipe = _SwapPipeline()
    ref = clone(pipe)
    b = dlo.enable_offload(pipe, dlo.OffloadConfig(mode="module"), None, "cpu")
    with torch.no_grad():
        for step in range(4):  # every step evicts the transformer for the encoder
            assert torch.equal(pipe(_x(step), step), ref(_x(step), step)), step
    b.disable()
    got, want = _state(pipe), _state(ref)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _allgather_write(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = _CachingDiT()
    cfg = dlo.OffloadConfig(mode="layer", transfer="allgather", collective_timeout_s=20.0)
    b = dlo.enable_offload(model, cfg, dlo.ParallelConfig(data_parallel_size=world), "cpu")
    try:
        with torch.no_grad():
            model(_x(0), 0)
    except dlo.OffloadError as e:
        return str(e)
    finally:
        b.disable()
    return "no error"


def test_allgather_refuses_an_in_place_write_by_name() -> None:
    msgs = assert_all_ok(run_ranks(_allgather_write, 2, timeout_s=120))
    for m in msgs:
        assert "blocks.0" in m and "calls" in m and "cache" in m and "in place" in m, m
