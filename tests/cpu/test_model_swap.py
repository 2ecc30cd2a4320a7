"""Model-level swap on the CPU platform: mutual exclusion, parity, identity, rollback."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import dlo
from dlo import faults
from dlo.backends.model_swap import ModelSwapBackend
from dlo.errors import InjectedFault, OffloadError
from dlo.hooks.registry import HookRegistry
from dlo.host.region import LEDGER
from dlo.platform.device import CpuPlatform
from tests.toys import ToyDiT, ToyEncoder, assert_same, clone, snapshot


class Vae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class SwapPipeline(nn.Module):
    _dit_modules: ClassVar[list[str]] = ["transformer", "transformer_2"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder", "empty_encoder"]
    _vae_modules: ClassVar[list[str]] = ["vae"]

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = ToyEncoder()
        self.empty_encoder = nn.Identity()  # parameterless: never transfers
        self.transformer = ToyDiT(3, seed=1)
        self.transformer_2 = ToyDiT(2, seed=2)
        self.vae = Vae()
        self.trace: list[tuple[str, tuple[str, ...]]] = []

    def resident(self) -> tuple[str, ...]:
        names = ("text_encoder", "transformer", "transformer_2")
        return tuple(n for n in names if all(p.numel() for p in getattr(self, n).parameters()))

    def forward(self, x: torch.Tensor, steps: int = 4) -> torch.Tensor:
        self.trace.clear()

        def mark(name: str) -> Any:
            def hook(module: nn.Module, args: tuple) -> None:
                self.trace.append((name, self.resident()))

            return hook

        handles = [
            getattr(self, n).register_forward_pre_hook(mark(n))
            for n in ("text_encoder", "transformer", "transformer_2")
        ]
        try:
            cond = self.text_encoder(self.empty_encoder(x))
            h = x
            for s in range(steps):
                dit = self.transformer if s < steps // 2 else self.transformer_2
                h = h + 0.1 * dit(h + cond)
            return self.vae(h)
        finally:
            for hd in handles:
                hd.remove()


def _enable(pipe: nn.Module, **kw: Any) -> ModelSwapBackend:
    b = dlo.enable_offload(pipe, dlo.OffloadConfig(mode="module", **kw), device="cpu")
    assert isinstance(b, ModelSwapBackend)
    return b


def test_mutual_exclusion_observed_at_every_call_and_parity() -> None:
    pipe = SwapPipeline()
    ref = clone(pipe)
    before = snapshot(pipe)
    backend = _enable(pipe)
    assert pipe.resident() == ("text_encoder",)  # encoders start resident, DiTs on host
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        for _ in range(2):
            want = ref(x)
            got = pipe(x)
            assert torch.equal(want, got)
            assert pipe.trace == [
                ("text_encoder", ("text_encoder",)),
                ("transformer", ("transformer",)),
                ("transformer", ("transformer",)),
                ("transformer_2", ("transformer_2",)),
                ("transformer_2", ("transformer_2",)),
            ]
    st = backend.stats()
    assert st["components"]["transformer"]["num_loads"] == 2
    assert st["components"]["empty_encoder"]["nbytes"] == 0
    assert st["host_nbytes"] > 0 and st["h2d_nbytes"] > 0
    backend.disable()
    backend.disable()
    assert_same(before, pipe)
    assert LEDGER.host_nbytes == 0
    assert all(not HookRegistry.owners_on(m) for m in pipe.modules())


@pytest.mark.parametrize(
    "point",
    [
        "manifest_build",
        "host_allocation",
        "host_fill",
        "device_placement",
        "hook_install",
        "first_transfer",
        "commit",
    ],
)
def test_rollback_on_injected_failure(point: str) -> None:
    pipe = SwapPipeline()
    before = snapshot(pipe)
    with faults.inject(point), pytest.raises(InjectedFault):
        _enable(pipe)
    assert_same(before, pipe)
    assert LEDGER.host_nbytes == 0
    assert all(not HookRegistry.owners_on(m) for m in pipe.modules())
    _enable(pipe).disable()
    assert_same(before, pipe)


def test_second_strategy_refused_and_idempotence() -> None:
    pipe = SwapPipeline()
    backend = _enable(pipe)
    with pytest.raises(OffloadError, match="already enabled"):
        backend.enable(pipe)
    layer = dlo.get_offload_backend(dlo.OffloadConfig(mode="layer"), device="cpu")
    assert layer is not None
    with pytest.raises(OffloadError, match="at most one strategy"):
        layer.enable(pipe)
    backend.disable()
    layer.enable(pipe)  # after disable the pipeline is free again
    layer.disable()


class SplitModel(nn.Module, dlo.SupportsModelOffload):
    """One transformer with two mutually exclusive phases, offloading itself."""

    def __init__(self) -> None:
        super().__init__()
        self.reasoner = nn.Linear(16, 16)
        self.generator = ToyDiT(2)
        self.calls: list[tuple[str, Any]] = []
        self.active: str | None = None
        self._device: torch.device | None = None

    def enable_model_offload(self, *, device: torch.device, pin_memory: bool) -> None:
        if self._device is not None:
            return  # idempotent
        self.calls.append(("enable", (device, pin_memory)))
        self._device = device

    def disable_model_offload(self) -> None:
        if self._device is None:
            return
        self.calls.append(("disable", None))
        self._device = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.active = "reasoner"
        h = self.reasoner(x)
        self.active = "generator"
        return self.generator(h)


def test_split_model_delegates_through_the_protocol() -> None:
    model = SplitModel()
    backend = ModelSwapBackend(
        dlo.OffloadConfig(mode="module"), dlo.ParallelConfig(), CpuPlatform()
    )
    backend.enable(model)
    assert model.calls == [("enable", (torch.device("cpu"), False))]
    assert backend.stats()["delegated"]
    with pytest.raises(OffloadError, match="already enabled"):
        backend.enable(model)
    backend.disable()
    backend.disable()
    assert model.calls[-1] == ("disable", None) and len(model.calls) == 2


def test_duck_typed_split_model_is_not_delegated() -> None:
    class Duck(nn.Module):
        _dit_modules: ClassVar[list[str]] = ["dit"]

        def __init__(self) -> None:
            super().__init__()
            self.dit = ToyDiT(2)

        def enable_model_offload(self, **kw: Any) -> None:
            raise AssertionError("must not be called: not a declared SupportsModelOffload")

    backend = _enable(Duck())
    assert not backend.stats()["delegated"]
    backend.disable()


class DeclaredPipeline(SwapPipeline):
    _resident_modules: ClassVar[list[str]] = ["head"]
    _offload_plan = dlo.OffloadPlan(on_demand_component_paths=("transformer_2",))

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 16)


def test_on_demand_not_swapped_resident_placed_and_state_dict_real() -> None:
    pipe = DeclaredPipeline()
    want = {k: v.clone() for k, v in pipe.state_dict().items()}
    backend = _enable(pipe)
    assert "transformer_2" not in backend.stats()["components"]
    assert "transformer" in backend.stats()["components"]
    got = pipe.state_dict()  # the DiT is evicted (on the host) right now
    assert all(p.numel() == 0 for p in pipe.transformer.parameters())
    for k in want:
        assert torch.equal(want[k], got[k]), k
    with pytest.raises(OffloadError, match="load_state_dict"):
        pipe.transformer.load_state_dict(pipe.transformer.state_dict())
    backend.disable()


def test_a_component_arriving_while_one_it_would_evict_runs_is_refused() -> None:
    # another thread (a second request), or a nested call: activating the text encoder would
    # evict the running transformer's weights under it
    pipe = SwapPipeline()
    ref = clone(pipe)
    backend = _enable(pipe)
    x = torch.randn(2, 3, 16)
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold(module: nn.Module, args: tuple) -> None:
        inside.set()
        release.wait(10)

    def second_request() -> None:
        inside.wait(10)
        try:
            with torch.no_grad():
                pipe.text_encoder(x)
        except BaseException as e:
            errors.append(e)
        release.set()

    t = threading.Thread(target=second_request)
    t.start()
    h = pipe.transformer.register_forward_pre_hook(hold)
    with torch.no_grad():
        out = pipe.transformer(x)
    h.remove()
    t.join(10)
    assert len(errors) == 1 and "while ['transformer'] is running" in str(errors[0])
    with torch.no_grad():
        assert torch.equal(out, ref.transformer(x))  # the first request computed correctly
    nested = pipe.transformer.register_forward_pre_hook(lambda m, a: pipe.text_encoder(x))
    with torch.no_grad(), pytest.raises(OffloadError, match="is running"):
        pipe.transformer(x)
    nested.remove()
    with torch.no_grad():  # nothing stuck: every component runs again
        assert torch.equal(pipe(x), ref(x))
    backend.disable()


class _TransposedBlock(nn.Module):
    """A block whose matmul reads its input transposed (the shape of the issue's repro)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.transpose(0, 1)).transpose(0, 1)


class _TransposedDiT(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList([_TransposedBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_swap_is_bitwise_under_either_grad_mode_and_weights_are_never_inference_tensors(
    grad_mode: str,
) -> None:
    """The swap's device copy is made inside the caller's forward: under inference_mode it
    used to be an inference tensor (another kernel path than the resident model, and a model
    no later no_grad forward or autograd refusal could use)."""
    mode = torch.inference_mode if grad_mode == "inference_mode" else torch.no_grad
    model = _TransposedDiT()
    x = torch.randn(7, 5, 16)
    with mode():
        ref = model(x)
    backend = dlo.enable_offload(model, dlo.OffloadConfig(mode="module"), device="cpu")
    assert backend is not None
    for _ in range(2):
        with mode():
            out = model(x)
        assert torch.equal(out, ref)
        assert not any(p.is_inference() for p in model.parameters())
    with torch.no_grad():  # the other mode on the same resident copy
        assert torch.equal(model(x), ref)
    backend.disable()
    with mode():
        assert torch.equal(model(x), ref)


def test_swap_refuses_autograd_like_the_ring() -> None:
    model = _TransposedDiT()
    x = torch.randn(7, 5, 16)
    backend = dlo.enable_offload(model, dlo.OffloadConfig(mode="module"), device="cpu")
    assert backend is not None
    with pytest.raises(OffloadError, match="autograd enabled"):
        model(x.requires_grad_())
    with pytest.raises(OffloadError, match="autograd enabled"):
        model(x.detach())  # the weights require grad
    with torch.no_grad():
        out = model(x.detach())  # still usable after the refusals
    backend.disable()
    with torch.no_grad():
        assert torch.equal(out, model(x.detach()))


@pytest.mark.parametrize(
    "components, trace",
    [
        (
            ("dit",),  # the encoder stays resident; the DiTs swap against each other
            [
                ("text_encoder", ("text_encoder",)),
                ("transformer", ("text_encoder", "transformer")),
                ("transformer", ("text_encoder", "transformer")),
                ("transformer_2", ("text_encoder", "transformer_2")),
                ("transformer_2", ("text_encoder", "transformer_2")),
            ],
        ),
        (
            ("text_encoder",),  # only the encoders swap; the DiTs stay resident
            [
                ("text_encoder", ("text_encoder", "transformer", "transformer_2")),
                ("transformer", ("text_encoder", "transformer", "transformer_2")),
                ("transformer", ("text_encoder", "transformer", "transformer_2")),
                ("transformer_2", ("text_encoder", "transformer", "transformer_2")),
                ("transformer_2", ("text_encoder", "transformer", "transformer_2")),
            ],
        ),
    ],
    ids=["dit", "text_encoder"],
)
def test_components_select_which_groups_swap(
    components: tuple[str, ...], trace: list[tuple[str, tuple[str, ...]]]
) -> None:
    """vLLM-Omni's ``{"mode": "module", "components": [...]}``: the selected groups swap, the
    others stay device resident (untouched here, on the CPU platform)."""
    pipe = SwapPipeline()
    ref = clone(pipe)
    before = snapshot(pipe)
    backend = dlo.enable_offload(
        pipe,
        dlo.OffloadConfig.from_dict({"mode": "module", "components": list(components)}),
        device="cpu",
    )
    assert backend is not None
    swapped = set(backend.stats()["components"])
    assert swapped == (
        {"transformer", "transformer_2"}
        if components == ("dit",)
        else {"text_encoder", "empty_encoder"}
    )
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        assert torch.equal(ref(x), pipe(x))
        assert pipe.trace == trace
    backend.disable()
    assert_same(before, pipe)
    assert LEDGER.host_nbytes == 0
