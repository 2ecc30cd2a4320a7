"""Quantized weights as stored ([Note: tensor subclasses], issue 22 item 5): torchao's int8 and
fp8 weight-only tensors stream through their inner tensors (int8/fp8 data and scales), bitwise
against the same quantized model resident, on the ring, with resident blocks, the codec,
AllGather (worlds 2 and 3) and node-shared; the wrapper objects stay the module's; what cannot
be streamed is refused naming the tensor and its type."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.errors import OffloadError
from dlo.host.region import LEDGER
from dlo.plan import subclasses
from dlo.plan.layout import module_tensor_entries, module_wrappers
from dlo.plan.subclasses import flatten, leaf_tensors, move_tensor, tensor_nbytes
from dlo.platform.device import CpuPlatform
from tests.harness import assert_all_ok, run_ranks

torchao_quant = pytest.importorskip("torchao.quantization")

CONFIGS = {
    "int8": lambda: torchao_quant.Int8WeightOnlyConfig(),
    "fp8": lambda: torchao_quant.Float8WeightOnlyConfig(),
    # int8 weights with activations quantized per call; int8-unpacked grouped weights
    "int8-dynamic": lambda: torchao_quant.Int8DynamicActivationInt8WeightConfig(),
    "intx": lambda: torchao_quant.IntxWeightOnlyConfig(),
}


class QBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # fp32: not quantized
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.float()).to(x.dtype)
        return x + self.down(F.gelu(self.up(h)))


class QDiT(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, kind: str, num_blocks: int = 4, dim: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every build (and on every rank)
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(QBlock(dim) for _ in range(num_blocks))
        self.head = nn.Linear(dim, dim)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.to(torch.bfloat16)
        # every Linear, the non-block embed and head included, as torchao leaves them
        torchao_quant.quantize_(self, CONFIGS[kind]())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _xs(seed: int = 0, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 5, 64, generator=g).to(torch.bfloat16) for _ in range(n)]


def _run(model: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x) for x in xs]


def _inner(model: nn.Module) -> dict[str, Any]:
    """Every wrapper's identity and device, and each inner tensor's identity and bytes."""
    out: dict[str, Any] = {}
    for name, t in model.named_parameters():
        out[name] = (id(t), type(t), t.device)
        for leaf, x in flatten(name, t).leaves() if hasattr(t, "__tensor_flatten__") else []:
            out[leaf] = (id(x), x.dtype, tuple(x.shape), x.stride(), x.device, x.clone())
    return out


def _assert_inner_same(before: dict[str, Any], model: nn.Module) -> None:
    after = _inner(model)
    assert before.keys() == after.keys()
    for k, v in before.items():
        w = after[k]
        assert v[:-1] == w[:-1] if len(v) == 6 else v == w, k
        if len(v) == 6:
            assert torch.equal(v[-1].view(torch.uint8), w[-1].view(torch.uint8)), k


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize(
    ("num_slots", "resident", "codec"), [(1, 0, "none"), (2, 1, "none"), (2, 0, "ans")]
)
def test_quantized_blocks_stream_as_stored(
    kind: str, num_slots: int, resident: int, codec: str
) -> None:
    xs = _xs()
    want = _run(QDiT(kind), xs)
    model = QDiT(kind)
    before = _inner(model)
    wrappers = {n: t for n, t in model.named_parameters() if hasattr(t, "__tensor_flatten__")}
    cfg = dlo.OffloadConfig(
        mode="layer", num_slots=num_slots, resident_layers=resident, codec=codec
    )
    b = dlo.enable_offload(model, cfg, device="cpu")
    got = _run(model, xs)
    assert all(torch.equal(a, c) for a, c in zip(want, got))
    # the module holds the same wrapper objects; the layout lists their inner tensors
    assert all(dict(model.named_parameters())[n] is t for n, t in wrappers.items())
    names = [s.name for s in b.layer_plan.blocks[0].layout.tensors]  # type: ignore[attr-defined]
    assert "up.weight.qdata" in names and "up.weight.scale" in names and "norm.weight" in names
    stats = b.stats()
    stored = sum(tensor_nbytes(t) for t in QDiT(kind).blocks.parameters())
    assert stats["host_nbytes"] >= stored if codec == "none" else stats["host_nbytes"] > 0
    # int8/fp8 stored, never dequantized: far below the bf16 weights' bytes
    bf16 = sum(p.numel() * 2 for p in QDiT(kind).blocks.parameters())
    assert stats["host_nbytes"] < 0.7 * bf16
    # state_dict rebuilds each wrapper from its host copy
    sd = model.state_dict()
    ref_sd = QDiT(kind).state_dict()
    up = sd["blocks.1.up.weight"]
    assert type(up) is type(ref_sd["blocks.1.up.weight"])
    for k in ("blocks.1.up.weight", "blocks.3.down.weight"):
        for (_, x), (_, y) in zip(flatten(k, sd[k]).leaves(), flatten(k, ref_sd[k]).leaves()):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k
    b.disable()
    _assert_inner_same(before, model)
    assert all(torch.equal(a, c) for a, c in zip(want, _run(model, xs)))
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


class _Retargets:
    """Counts the retargets of block wrappers (named; non-block ones are moved unnamed):
    on the CPU every device is the same, so the count is what shows they happen."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        real = subclasses.Wrapped.retarget

        def retarget(w: subclasses.Wrapped, device: torch.device) -> None:
            if w.name:
                self.calls.append(w.name)
            real(w, device)

        subclasses.Wrapped.retarget = retarget  # type: ignore[method-assign]


def _gathered(rank: int, world: int, transfer: str, kind: str, resident: int) -> dict[str, Any]:
    xs = _xs(rank)
    want = _run(QDiT(kind, 5), xs)
    model = QDiT(kind, 5)
    before = _inner(model)
    cfg = dlo.OffloadConfig(
        mode="layer",
        transfer=transfer,
        chunk_mb=1,
        collective_timeout_s=20.0,
        resident_layers=resident,
    )
    b = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    spy = _Retargets()  # in this rank's process only
    b.enable(model)
    enabled = len(spy.calls)
    got = _run(model, xs)
    st = b.stats()
    b.disable(restore=True)
    try:
        _assert_inner_same(before, model)
        restored = True
    except AssertionError:
        restored = False
    return {
        "same": all(torch.equal(a, c) for a, c in zip(want, got)),
        "transfer": st["transfer"],
        "restored": restored,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
        "retargets": (enabled, len(spy.calls) - enabled),
    }


@pytest.mark.parametrize(
    ("world", "transfer", "kind", "resident"),
    [
        (2, "allgather", "int8", 0),
        (2, "allgather", "int8", 1),
        (3, "allgather", "fp8", 0),
        (2, "node-shared", "int8", 0),
    ],
)
def test_quantized_blocks_across_ranks(world: int, transfer: str, kind: str, resident: int) -> None:
    res = assert_all_ok(run_ranks(_gathered, world, transfer, kind, resident, timeout_s=180))
    for rank, r in enumerate(res):
        assert r["same"] and r["restored"], rank
        assert r["transfer"] == transfer and r["ledger"] == (0, 0), rank
        # every block wrapper (5 blocks x 2 weights) to the device at enable, and back
        assert r["retargets"] == (10, 10), (rank, r["retargets"])


def test_model_swap_refuses_wrappers_naming_them() -> None:
    model = QDiT("int8", 2)
    before = _inner(model)
    cfg = dlo.OffloadConfig(mode="module")
    with pytest.raises(OffloadError, match=r"blocks\.0\.up\.weight \(Int8Tensor\)"):
        dlo.enable_offload(model, cfg, device="cpu")
    _assert_inner_same(before, model)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


class _OpaqueParam(nn.Parameter):
    """A Parameter subclass with state of its own (no ``__tensor_flatten__``)."""


class _BadWrapper(TwoTensor):
    """Names an inner tensor it does not hold as a tensor attribute."""

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["a", "label"], None


def test_subclasses_dlo_cannot_stream_are_refused_naming_tensor_and_type() -> None:
    model = QDiT("int8", 2)
    model.blocks[1].norm.weight = _OpaqueParam(model.blocks[1].norm.weight.detach().clone())
    with pytest.raises(OffloadError, match=r"blocks\.1\.norm\.weight \(_OpaqueParam\)"):
        dlo.enable_offload(model, dlo.OffloadConfig(mode="layer"), device="cpu")
    model = QDiT("int8", 2)
    bad = _BadWrapper(torch.zeros(64), torch.ones(64))
    bad.label = "not a tensor"  # type: ignore[attr-defined]
    model.blocks[0].register_buffer("odd", bad)
    with pytest.raises(OffloadError, match=r"block 'blocks\.0': odd \(_BadWrapper\).*'label'.*str"):
        dlo.enable_offload(model, dlo.OffloadConfig(mode="layer"), device="cpu")
    with pytest.raises(OffloadError, match=r"odd \(_BadWrapper\).*'label'.*str"):
        dlo.enable_offload(model, dlo.OffloadConfig(mode="module"), device="cpu")
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_nested_wrappers_flatten_rebuild_and_move() -> None:
    a, b, c = torch.randn(4), torch.randn(4), torch.randn(4)
    outer = TwoTensor(TwoTensor(a, b), c)
    m = nn.Module()
    m.w = nn.Parameter(outer, requires_grad=False)
    entries = module_tensor_entries(m)
    assert [(n, k) for n, k, _ in entries] == [
        ("w.a.a", "param"),
        ("w.a.b", "param"),
        ("w.b", "param"),
    ]
    assert [t for _, _, t in entries] == leaf_tensors(m.w)
    (w,) = module_wrappers(m)
    rebuilt = w.rebuild(lambda x: x * 2)
    assert type(rebuilt) is TwoTensor and type(rebuilt.a) is TwoTensor
    assert torch.equal(rebuilt.a.b, b * 2) and torch.equal(rebuilt.b, c * 2)
    assert tensor_nbytes(m.w) == 3 * 4 * 4
    ids = [id(t) for _, _, t in entries]
    move_tensor(m.w, torch.device("cpu"))  # in place: the same objects
    assert [id(t) for _, _, t in module_tensor_entries(m)] == ids


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_compiled_quantized_blocks_are_bitwise_without_recompiles(kind: str) -> None:
    """Each block compiled (fullgraph) before enable, one slot (every block lands in it
    each step): the same bits and graphs as the compiled resident model, none recompiled."""
    from torch._dynamo.testing import CompileCounter

    xs = _xs()
    torch._dynamo.reset()
    ref, ref_counter = QDiT(kind), CompileCounter()
    for blk in ref.blocks:
        blk.compile(backend=ref_counter, fullgraph=True)
    want = _run(ref, xs)
    torch._dynamo.reset()
    model, counter = QDiT(kind), CompileCounter()
    for blk in model.blocks:
        blk.compile(backend=counter, fullgraph=True)
    b = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer", num_slots=1), device="cpu")
    got = _run(model, xs)
    first = counter.frame_count
    again = _run(model, xs)
    assert all(torch.equal(a, c) for a, c in zip(want, got))
    assert all(torch.equal(a, c) for a, c in zip(want, again))
    assert first == counter.frame_count == ref_counter.frame_count
    b.disable()


def test_a_failed_retarget_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper torch will not move (the third one here) fails the enable, which rolls
    back: every wrapper and inner tensor as before, nothing held."""
    model = QDiT("int8", 3)
    before = _inner(model)
    xs = _xs()
    want = _run(QDiT("int8", 3), xs)
    calls: list[str] = []
    real = subclasses.retarget

    def retarget(t: torch.Tensor, device: torch.device, *, name: str = "") -> None:
        calls.append(name)
        if len(calls) == 3:
            raise TypeError(f"{name} cannot move (injected)")
        real(t, device, name=name)

    monkeypatch.setattr(subclasses, "retarget", retarget)
    with pytest.raises(TypeError, match="injected"):
        dlo.enable_offload(model, dlo.OffloadConfig(mode="layer"), device="cpu")
    _assert_inner_same(before, model)
    assert all(torch.equal(a, c) for a, c in zip(want, _run(model, xs)))
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    # move_tensor: all or nothing too
    w = model.head.weight
    leaves = [(id(x), x.data_ptr()) for x in leaf_tensors(w)]
    calls[:] = ["", ""]  # the next call is the third: it fails
    with pytest.raises(TypeError, match="injected"):
        move_tensor(w, torch.device("cpu"))
    assert [(id(x), x.data_ptr()) for x in leaf_tensors(w)] == leaves


def test_a_non_block_wrapper_sharing_a_block_tensor_is_refused() -> None:
    model = QDiT("int8", 2)
    model.head.weight.scale = model.blocks[0].up.weight.scale  # a block's scale, shared
    with pytest.raises(OffloadError, match=r"blocks\.0\.up\.weight\.scale.*head\.weight"):
        dlo.enable_offload(model, dlo.OffloadConfig(mode="layer"), device="cpu")
    model = QDiT("int8", 2)
    bad = _BadWrapper(torch.zeros(64), torch.ones(64))
    bad.label = "not a tensor"  # type: ignore[attr-defined]
    model.head.register_buffer("odd", bad)
    with pytest.raises(OffloadError, match=r"non-block head\.odd: .*'label'"):
        dlo.enable_offload(model, dlo.OffloadConfig(mode="layer"), device="cpu")
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_quantized_in_load_pipelines_prepare(tmp_path: Any) -> None:
    """The documented path for a checkpoint: load, quantize in ``prepare`` (the weights
    leave the file's mapping for torchao's int8 tensors), enable; bitwise against the same
    quantization of the resident model."""
    import functools

    from dlo.io.writer import save_checkpoint
    from dlo.models import build_pipeline, make_inputs

    ckpt = save_checkpoint(build_pipeline("tiny", dtype=torch.bfloat16), tmp_path / "ckpt")
    ids, lat = make_inputs("tiny", seed=1, dtype=torch.bfloat16)
    ref = build_pipeline("tiny", dtype=torch.bfloat16)
    torchao_quant.quantize_(ref.transformer, CONFIGS["int8"]())
    want = ref.generate(ids, lat, 2)

    def quantize(pipe: Any) -> None:
        torchao_quant.quantize_(pipe.transformer, CONFIGS["int8"]())

    factory = functools.partial(build_pipeline, "tiny", dtype=torch.bfloat16, device="meta")
    pipe, b = dlo.load_pipeline(
        factory, ckpt, dlo.OffloadConfig(mode="layer"), device="cpu", prepare=quantize
    )
    assert b is not None
    assert torch.equal(pipe.generate(ids, lat, 2), want)
    names = [s.name for s in b.layer_plan.blocks[0].layout.tensors]  # type: ignore[attr-defined]
    assert any(n.endswith(".qdata") for n in names), names
    b.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
