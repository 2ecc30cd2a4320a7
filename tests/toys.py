"""Small models for dlo's tests: heterogeneous blocks with mixed dtypes, transposed
weights, persistent and non-persistent buffers, several containers, skippable blocks."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from torch import nn

from dlo.plan.declarations import OffloadPlan


class ToyBlock(nn.Module):
    """A residual block: bf16/fp32 mix, a transposed weight, buffers of two kinds."""

    def __init__(self, dim: int, seed: int, *, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(dim, dim).to(dtype)
        self.lin.weight.data = (torch.randn(dim, dim, generator=g) * 0.2).to(dtype)
        self.lin.bias.data = (torch.randn(dim, generator=g) * 0.1).to(dtype)
        self.norm = nn.LayerNorm(dim)  # fp32 inside a bf16 block
        self.norm.weight.data = 1 + 0.1 * torch.randn(dim, generator=g)
        # transposed: shape (dim, 2*dim) with strides (1, dim)
        self.proj_t = nn.Parameter((torch.randn(2 * dim, dim, generator=g) * 0.2).to(dtype).t())
        self.register_buffer("rope", torch.randn(dim, generator=g), persistent=False)
        self.register_buffer("gain", torch.tensor([0.5 + seed % 3], dtype=torch.float32))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h = self.norm(x.float() + self.rope) * self.gain
        h = self.lin(h.to(self.lin.weight.dtype)).float()
        h = h.to(self.proj_t.dtype) @ self.proj_t
        return x + scale * 0.1 * torch.tanh(h.float()[..., : x.shape[-1]]).to(x.dtype)


class ToyDiT(nn.Module):
    """A DiT-shaped model: embed, one or two block containers, head."""

    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(
        self, num_blocks: int = 5, dim: int = 16, *, num_blocks2: int = 0, seed: int = 0
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim, seed * 1000 + i) for i in range(num_blocks))
        if num_blocks2:
            self.blocks2 = nn.ModuleList(
                ToyBlock(dim, seed * 1000 + 500 + i, dtype=torch.float32)
                for i in range(num_blocks2)
            )
        self.head = nn.Linear(dim, dim)
        self.skip: set[int] = set()
        g = torch.Generator().manual_seed(seed + 7)
        for lin in (self.embed, self.head):
            lin.weight.data = torch.randn(dim, dim, generator=g) * 0.3
            lin.bias.data = torch.zeros(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, b in enumerate(self.blocks):
            if i not in self.skip:
                h = b(h, scale=1.0 + i)
        for b in getattr(self, "blocks2", ()):
            h = b(h)
        return self.head(h)


class TwoStackDiT(ToyDiT):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks", "blocks2"]


class ToyEncoder(nn.Module):
    def __init__(self, num_layers: int = 3, dim: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            ToyBlock(dim, 9000 + i, dtype=torch.float32) for i in range(num_layers)
        )
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class ToyPipeline(nn.Module):
    """Two DiTs (high/low noise experts) and a streamed text encoder sharing slots."""

    _dit_modules: ClassVar[list[str]] = ["transformer", "transformer_2"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []
    _offload_plan = OffloadPlan(
        encoder_block_attrs={"text_encoder": ("layers",)},
        encoder_dlo_weight_replication=("text_encoder",),
    )

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = ToyEncoder()
        self.transformer = ToyDiT(4, seed=1)
        self.transformer_2 = ToyDiT(3, seed=2)

    def forward(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        cond = self.text_encoder(x)
        h = x
        for s in range(steps):
            dit = self.transformer if s % 2 == 0 else self.transformer_2
            h = h + 0.1 * dit(h + cond)
        return h


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Identity, metadata and bytes of every tensor, to compare after rollback/disable."""
    out: dict[str, Any] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[name] = (id(t), t.dtype, tuple(t.shape), t.stride(), t.device, t.detach().clone())
    return out


def assert_same(before: dict[str, Any], model: nn.Module) -> None:
    after = snapshot(model)
    assert before.keys() == after.keys()
    for k, (i, dt, sh, st, dev, val) in before.items():
        i2, dt2, sh2, st2, dev2, val2 = after[k]
        assert (i, dt, sh, st, dev) == (i2, dt2, sh2, st2, dev2), k
        assert torch.equal(val, val2), k


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
