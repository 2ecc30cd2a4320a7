"""What an enabled model refuses, and what it survives, with nothing lost: conversions
(``to``/``half``/...), copies, tensors sharing storage, inference tensors, overlapping claims,
autograd decided at each forward, KeyboardInterrupt inside a block, disable racing a forward."""

from __future__ import annotations

import copy
import functools
import io
import pickle
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import dlo
from dlo.errors import OffloadError
from dlo.hooks.registry import HookRegistry
from dlo.host.region import LEDGER
from tests.harness import assert_all_ok, forward_outcomes, run_ranks
from tests.nothing_lost import Baseline
from tests.toys import ToyDiT, ToyPipeline, assert_same, clone, snapshot


def _x(seed: int = 0, dim: int = 16) -> torch.Tensor:
    return torch.randn(2, 5, dim, generator=torch.Generator().manual_seed(seed))


def _model(mode: str) -> nn.Module:
    return ToyDiT(4) if mode == "layer" else ToyPipeline()


def _enable(model: Any, mode: str = "layer") -> dlo.OffloadBackend:
    backend = dlo.enable_offload(model, dlo.OffloadConfig(mode=mode), device="cpu")
    assert backend is not None
    return backend


def _a_block(model: nn.Module) -> nn.Module:
    return model.blocks[1] if isinstance(model, ToyDiT) else model.transformer.blocks[1]


def _refused_unchanged(model: nn.Module, fn: Callable[[], object], match: str) -> None:
    before = snapshot(model)  # placeholders while enabled: the same objects afterwards
    with pytest.raises(OffloadError, match=match):
        fn()
    assert_same(before, model)


def _nothing_installed(model: nn.Module) -> None:
    assert all(not HookRegistry.owners_on(m) for m in model.modules())
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


# ------------------------------------------------------------------ D1: to / half / cuda
@pytest.mark.parametrize("mode", ["layer", "module"])
def test_conversion_while_enabled_is_refused_before_anything_changes(mode: str) -> None:
    model = _model(mode)
    ref = clone(model)
    base = Baseline.take(model)
    backend = _enable(model, mode)
    conversions: list[Callable[[], object]] = [
        lambda: model.to(torch.bfloat16),
        lambda: model.half(),
        lambda: model.float(),
        lambda: model.to("cpu"),
        lambda: model.type(torch.float64),
        lambda: _a_block(model).double(),  # a managed module
        lambda: _a_block(model).lin.half(),  # inside one
    ]
    for convert in conversions:
        _refused_unchanged(model, convert, "disable dlo first")
    with torch.no_grad():
        assert torch.equal(model(_x()), ref(_x()))
    backend.disable()
    base.check(model)  # also: the refusals left no attribute behind
    model.half()  # an ordinary module again
    assert next(model.parameters()).dtype == torch.float16


# ------------------------------------------------------------------ D9: deepcopy / pickle
@pytest.mark.parametrize("mode", ["layer", "module"])
def test_copy_and_pickle_of_an_enabled_model_are_refused(mode: str) -> None:
    model = _model(mode)
    ref = clone(model)
    backend = _enable(model, mode)
    for target in (model, _a_block(model)):
        for fn in (copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
            _refused_unchanged(model, functools.partial(fn, target), "disable dlo first")
    with torch.no_grad():
        assert torch.equal(model(_x()), ref(_x()))
    backend.disable()
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(model)(_x()), ref(_x()))


# ------------------------------------------------------------------ D3: one storage, two tensors
def _fused_qkv(model: ToyDiT) -> None:
    blk = model.blocks[0]
    blk.qkv = nn.Parameter(torch.randn(48, 16))
    blk.q = nn.Parameter(blk.qkv.data[:16])  # a view of qkv's storage


def _view_across_blocks(model: ToyDiT) -> None:
    model.blocks[2].gain = model.blocks[1].gain[:1]  # a buffer that views another block's


def _block_view_of_non_block(model: ToyDiT) -> None:
    model.register_buffer("table", torch.randn(16))
    model.blocks[3].rope = model.table[:16]


@pytest.mark.parametrize(
    ("alias", "names"),
    [
        (_fused_qkv, r"blocks\.0\.qkv and blocks\.0\.q "),
        (_view_across_blocks, r"blocks\.1\.gain and blocks\.2\.gain"),
        (_block_view_of_non_block, r"blocks\.3\.rope and non-block table"),
    ],
)
def test_tensors_sharing_one_storage_are_refused_naming_both(
    alias: Callable[[ToyDiT], None], names: str
) -> None:
    model = ToyDiT(4)
    alias(model)
    before = snapshot(model)
    with pytest.raises(OffloadError, match=names + r".*storage"):
        _enable(model)
    assert_same(before, model)
    _nothing_installed(model)


def test_tensors_sharing_one_storage_in_a_swapped_component_are_refused() -> None:
    pipe = ToyPipeline()
    blk = pipe.transformer.blocks[0]
    blk.lin.bias = nn.Parameter(blk.lin.weight.data[0])
    before = snapshot(pipe)
    with pytest.raises(OffloadError, match=r"blocks\.0\.lin\.weight and .*blocks\.0\.lin\.bias"):
        _enable(pipe, "module")
    assert_same(before, pipe)
    _nothing_installed(pipe)


# ------------------------------------------------------------------ D7: inference tensors
@pytest.mark.parametrize("mode", ["layer", "module"])
def test_model_of_inference_tensors_is_refused_at_enable(mode: str) -> None:
    with torch.inference_mode():
        model = _model(mode)
    before = snapshot(model)
    with pytest.raises(OffloadError, match=r"inference tensors .*blocks\.0\.lin\.weight.*outside"):
        _enable(model, mode)
    assert_same(before, model)
    _nothing_installed(model)


# ------------------------------------------------------------------ D4: overlapping claims
class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.adapter = inner, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 0 * self.adapter(x)


class _Pipe:
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self, transformer: nn.Module) -> None:
        self.transformer = transformer


@pytest.mark.parametrize(("first", "second"), [("layer", "module"), ("module", "layer")])
def test_component_containing_or_inside_an_offloaded_one_is_refused(
    first: str, second: str
) -> None:
    dit = ToyDiT(3)
    ref = clone(dit)
    base = Baseline.take(dit)
    inner, outer = _Pipe(dit), _Pipe(_Wrapper(dit))
    # the first backend takes the DiT itself (layer) or the wrapper around it (module)
    pipes = (inner, outer) if first == "layer" else (outer, inner)
    backend = _enable(pipes[0], first)
    relation = "contains" if first == "layer" else "is inside"
    before = snapshot(dit)
    with pytest.raises(OffloadError, match=f"'transformer' {relation} component 'transformer'"):
        _enable(pipes[1], second)
    assert_same(before, dit)
    with torch.no_grad():
        out = pipes[0].transformer(_x())
    want = ref(_x()) if first == "layer" else ref(_x()) + 0 * outer.transformer.adapter(_x())
    assert torch.equal(out, want)
    backend.disable()
    base.check(dit)


# ------------------------------------------------------------------ D2: autograd, decided per call
class _PairBlock(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(16, 16)
        self.lin.weight.data = torch.randn(16, 16, generator=g) * 0.2

    def forward(self, pair: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> torch.Tensor:
        x, extra = pair
        return torch.tanh(self.lin(x) + extra["bias"])


class _PairDiT(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_PairBlock(i) for i in range(3))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b((x, {"bias": bias}))
        return x


def test_autograd_is_refused_by_what_requires_grad_at_each_forward() -> None:
    model = _PairDiT().requires_grad_(False)
    ref = clone(model)
    backend = _enable(model)
    bias = torch.zeros(16)
    assert torch.equal(model(_x(), bias), ref(_x(), bias))  # grad on, nothing requires it
    # an input nested in a tuple/dict argument of the block
    with pytest.raises(OffloadError, match="inference runtime"):
        model(_x(), bias.clone().requires_grad_())
    # a weight switched to requires_grad after enable
    model.blocks[2].lin.weight.requires_grad_(True)
    with pytest.raises(OffloadError, match=r"'blocks\.2'.*inference runtime"):
        model(_x(), bias)
    with torch.no_grad():
        assert torch.equal(model(_x(), bias), ref(_x(), bias))
    backend.disable()


# ------------------------------------------------------------------ D6: KeyboardInterrupt
class _Interrupt(nn.Module):
    """Raises KeyboardInterrupt from inside a module's forward when armed (Ctrl-C)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return x


@pytest.mark.parametrize("mode", ["layer", "module"])
def test_keyboard_interrupt_inside_a_block_then_next_forward_is_bitwise(mode: str) -> None:
    model = _model(mode)
    ref = clone(model)
    base = Baseline.take(model)
    backend = _enable(model, mode)
    stop = _Interrupt()
    # Ctrl-C while the block's forward runs one of its layers
    handle = _a_block(model).lin.register_forward_pre_hook(lambda m, a: (stop(a[0]), None)[1])
    with torch.no_grad():
        for _ in range(2):
            stop.armed = True
            with pytest.raises(KeyboardInterrupt):
                model(_x())
            for seed in (1, 2):
                assert torch.equal(model(_x(seed)), ref(_x(seed)))
    handle.remove()
    backend.disable()
    base.check(model)


@pytest.mark.parametrize("mode", ["layer", "module"])
def test_a_worker_thread_that_died_inside_a_block_leaves_no_claim(mode: str) -> None:
    # SystemExit (or an async exception a server injects) ends a worker thread inside a
    # block's forward: torch skips the post-hook, and the dead thread's claim must not
    # refuse every later forward and disable (it did)
    model = _model(mode)
    ref = clone(model)
    base = Baseline.take(model)
    backend = _enable(model, mode)
    armed = [True]

    def die(module: nn.Module, args: tuple) -> None:
        if armed[0]:
            armed[0] = False
            raise SystemExit

    handle = _a_block(model).lin.register_forward_pre_hook(die)

    def work() -> None:
        try:
            with torch.no_grad():
                model(_x())
        except SystemExit:
            return  # the thread ends here, its block's post-hook never ran

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert not worker.is_alive()
    with torch.no_grad():
        assert torch.equal(model(_x(1)), ref(_x(1)))
    handle.remove()
    backend.disable()
    base.check(model)


def _interrupted_in_a_gathering_block(rank: int, world: int) -> list[str]:
    model = ToyDiT(4)
    cfg = dlo.OffloadConfig(mode="layer", transfer="allgather", collective_timeout_s=5.0)
    backend = dlo.enable_offload(model, cfg, dlo.ParallelConfig(data_parallel_size=world), "cpu")
    assert backend is not None
    stop = _Interrupt()
    model.blocks[1].lin.register_forward_pre_hook(lambda m, a: (stop(a[0]), None)[1])
    stop.armed = rank == 0
    log = forward_outcomes(model, [_x(seed) for seed in range(2)])
    backend.disable()
    return log


def test_an_interrupted_block_poisons_a_gathering_ring() -> None:
    # ranks interrupted at different blocks hold different prefetched blocks: releasing the
    # interrupted one and going on would pair the gathers off by one
    r0, _ = assert_all_ok(run_ranks(_interrupted_in_a_gathering_block, 2, timeout_s=90))
    assert r0[0] == "interrupted", r0
    assert r0[1].startswith("BackendPoisonedError") and "recreate the worker" in r0[1], r0


# ------------------------------------------------------------------ D8: disable racing a forward
@pytest.mark.parametrize("mode", ["layer", "module"])
def test_disable_while_another_thread_runs_a_block_is_refused(mode: str) -> None:
    model = _model(mode)
    ref = clone(model)
    base = Baseline.take(model)
    backend = _enable(model, mode)
    inside, release = threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def hold(module: nn.Module, args: tuple) -> None:
        inside.set()
        release.wait(10)

    def run() -> None:
        with torch.no_grad():
            result["out"] = model(_x())

    handle = _a_block(model).register_forward_pre_hook(hold)
    t = threading.Thread(target=run)
    t.start()
    try:
        assert inside.wait(10)
        with pytest.raises(OffloadError, match="another thread runs"):
            backend.disable()
        assert backend.is_enabled()
    finally:
        release.set()
        t.join(10)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(result["out"], ref(_x()))
        assert torch.equal(model(_x(1)), ref(_x(1)))
    backend.disable()
    base.check(model)
