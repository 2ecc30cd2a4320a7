"""``codec="ans"`` on the CPU platform (the reference codec, [Note: block codecs]): bitwise
parity with the resident model, host bytes are the encoded bytes, rollback on an injected
encode or decode failure, refusals where a codec does not apply (issue 22)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dlo
from dlo import faults
from dlo.backends.layerwise import LayerwiseBackend
from dlo.errors import InjectedFault
from dlo.hooks.registry import HookRegistry
from dlo.host.region import LEDGER
from dlo.models import build_pipeline, make_inputs
from dlo.platform.device import CpuPlatform
from dlo.platform.env import page_size
from tests.harness import assert_all_ok, run_ranks
from tests.toys import ToyBlock, ToyDiT, ToyPipeline, assert_same, clone, snapshot


class Fp8Block(ToyBlock):
    """A ToyBlock with an fp8 weight and its fp32 scale (a quantized layer as stored)."""

    def __init__(self, dim: int, seed: int) -> None:
        super().__init__(dim, seed)
        g = torch.Generator().manual_seed(seed + 99)
        self.register_buffer("w8", (torch.randn(dim, dim, generator=g)).to(torch.float8_e4m3fn))
        self.register_buffer("w8_scale", torch.tensor([0.05 + seed * 0.01]))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h = super().forward(x, scale=scale)
        return h + (h.float() @ (self.w8.float() * self.w8_scale)).to(h.dtype) * 0.01


class Fp8DiT(ToyDiT):
    def __init__(self, num_blocks: int = 4, dim: int = 16) -> None:
        super().__init__(num_blocks, dim)
        self.blocks = nn.ModuleList(Fp8Block(dim, i) for i in range(num_blocks))


def _x(seed: int) -> torch.Tensor:
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed))


def _run(model: nn.Module, n: int = 3) -> list[torch.Tensor]:
    out = []
    for s in range(n):
        with torch.inference_mode() if s % 2 else torch.no_grad():
            out.append(model(_x(s)).clone())
    return out


def _enable(model: nn.Module, **kw: Any) -> dlo.OffloadBackend:
    b = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer", codec="ans", **kw), device="cpu")
    assert b is not None
    return b


@pytest.mark.parametrize("num_slots", [1, 2])
@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("make", [ToyDiT, Fp8DiT], ids=["bf16+fp32", "fp8"])
def test_parity_state_dict_and_restore_with_the_codec(
    make: type[nn.Module], resident: int, num_slots: int
) -> None:
    model = make()
    ref = _run(clone(model), 4)
    before = snapshot(model)
    want_sd = {k: v.clone() for k, v in model.state_dict().items()}
    b = _enable(model, num_slots=num_slots, resident_layers=resident)
    assert all(torch.equal(x, y) for x, y in zip(ref, _run(model, 4)))
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in want_sd.items())
    st = b.stats()
    assert st["codec"] == "ans" and st["codec_bitstream"] == "dlo-zlib-planes-v1"
    assert 0 < st["host_encoded_nbytes"] < st["host_encoded_raw_nbytes"]
    # host bytes are the encoded bytes (each block on its own pages, as without a codec)
    assert st["host_nbytes"] == st["host_encoded_nbytes"]
    assert st["host_region_nbytes"] == LEDGER.host_nbytes
    blocks = b._state.host.blocks  # type: ignore[attr-defined]
    assert LEDGER.host_nbytes == sum(
        -(-blk.encoded.layout.nbytes // page_size()) * page_size() for blk in blocks
    )
    assert st["decoded_nbytes"] > 0 and st["encoded_h2d_nbytes"] < st["decoded_nbytes"]
    b.disable()
    assert_same(before, model)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    assert all(torch.equal(x, y) for x, y in zip(ref, _run(model, 4)))


def test_codec_per_component_with_the_demo_pipeline() -> None:
    pipe = build_pipeline("tiny", dtype=torch.bfloat16)
    ids, latents = make_inputs("tiny", tokens=None, seed=0, device="cpu", dtype=torch.bfloat16)
    ref = pipe.generate(ids, latents, 2)
    cfg = dlo.OffloadConfig(
        mode="layer", components=("dit", "encoder"), layer_options={"dit": {"codec": "ans"}}
    )
    b = dlo.enable_offload(pipe, cfg, device="cpu")
    assert b is not None
    assert torch.equal(pipe.generate(ids, latents, 2), ref)
    host = b._state.host  # type: ignore[attr-defined]
    kinds = {blk.stack.component: blk.encoded is not None for blk in host.blocks}
    assert kinds == {"dit": True, "encoder": False}
    b.disable()
    assert torch.equal(pipe.generate(ids, latents, 2), ref)


@pytest.mark.parametrize(
    ("point", "after"), [("encode", 0), ("encode", 2), ("host_fill", 3), ("decode", 0)]
)
def test_an_encode_or_decode_failure_rolls_back_everything(point: str, after: int) -> None:
    model = ToyPipeline()
    before = snapshot(model)
    with faults.inject(point, after=after), pytest.raises(InjectedFault):
        dlo.enable_offload(
            model,
            dlo.OffloadConfig(mode="layer", components=("dit", "encoder"), codec="ans"),
            device="cpu",
        )
    assert_same(before, model)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    assert all(not HookRegistry.owners_on(m) for m in model.modules())
    ref = clone(model)
    b = dlo.enable_offload(
        model,
        dlo.OffloadConfig(mode="layer", components=("dit", "encoder"), codec="ans"),
        device="cpu",
    )
    assert b is not None
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    b.disable()


def test_blocks_are_released_as_they_are_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: released as encoded]: when block k is encoded, the k blocks before it hold
    no original any more (the host never holds the model and every encoded block)."""
    import dlo.backends.layer_codec as layer_codec

    model = ToyDiT(5)
    released: list[int] = []
    real = layer_codec.encode_packed

    def encode_packed(*args: Any, **kw: Any) -> Any:
        released.append(sum(blk.lin.weight.numel() == 0 for blk in model.blocks))
        return real(*args, **kw)

    monkeypatch.setattr(layer_codec, "encode_packed", encode_packed)
    ref = _run(clone(model), 2)
    b = _enable(model)
    assert released == [0, 1, 2, 3, 4]
    assert all(torch.equal(x, y) for x, y in zip(ref, _run(model, 2)))
    b.disable()


def test_an_interrupt_while_a_block_is_laid_restores_it_from_its_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while the second encoded block is written into the region: it was released
    as encoded, and its pieces are still held until it is laid, so the rollback rebuilds it
    bitwise (never from half-laid region bytes read as raw)."""
    import dlo.backends.layer_codec as layer_codec

    model = ToyDiT(4)
    before = snapshot(model)
    calls = []
    real = layer_codec.write_pieces

    def write_pieces(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            real(*args)  # half of what a real interrupt could leave: the bytes, not the mark
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(layer_codec, "write_pieces", write_pieces)
    with pytest.raises(KeyboardInterrupt):
        _enable(model)
    assert_same(before, model)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_a_failed_decode_in_a_forward_is_raised_and_the_next_forward_is_bitwise() -> None:
    model = ToyDiT(4)
    ref = _run(clone(model), 2)
    b = _enable(model, num_slots=2)
    try:
        with faults.inject("decode", after=1), pytest.raises(InjectedFault):
            _run(model, 1)
        assert all(torch.equal(x, y) for x, y in zip(ref, _run(model, 2)))
    finally:
        b.disable()


def test_codec_config_is_checked_and_refused_where_it_cannot_apply() -> None:
    with pytest.raises(ValueError, match="codec='zstd' is not one of 'none', 'ans'"):
        dlo.OffloadConfig(mode="layer", codec="zstd")
    with pytest.raises(ValueError, match=r"layer_options\.codec"):
        dlo.OffloadConfig(mode="layer", layer_options={"dit": {"codec": "lz4"}})
    with pytest.raises(ValueError, match="codec='ans' applies to mode='layer' only"):
        dlo.OffloadConfig(mode="module", codec="ans")
    model = ToyDiT(3)
    before = snapshot(model)
    with pytest.raises(ValueError, match="host_backing='mapped' streams stack 'blocks'"):
        dlo.enable_offload(
            model,
            dlo.OffloadConfig(mode="layer", codec="ans", host_backing="mapped"),
            device="cpu",
        )
    assert_same(before, model)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def _gathered(rank: int, world: int, resident: int, restore: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    model = Fp8DiT(5)  # bf16 weights, fp32 norms, fp8 weights with fp32 scales
    xs = [torch.randn(2, 5, 16, generator=g) for _ in range(3)]
    ref = clone(model)
    with torch.no_grad():
        want = [ref(x) for x in xs]
    before = snapshot(model)
    cfg = dlo.OffloadConfig(
        mode="layer",
        transfer="allgather",
        codec="ans",
        chunk_mb=1,
        resident_layers=resident,
        collective_timeout_s=20.0,
    )
    b = LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())
    b.enable(model)
    with torch.no_grad():
        got = [model(x) for x in xs]
    st = b.stats()
    b.disable(restore=restore)
    restored = None
    if restore:  # gathered back through the decoder: the model as before, bit for bit
        restored = True
        try:
            assert_same(before, model)
        except AssertionError:
            restored = False
    return {
        "same": all(torch.equal(a, c) for a, c in zip(want, got)),
        "stats": st,
        "restored": restored,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.mark.parametrize(
    ("world", "resident", "restore"), [(2, 0, True), (3, 1, True), (3, 0, False)]
)
def test_allgather_with_the_codec_is_bitwise_on_every_rank(
    world: int, resident: int, restore: bool
) -> None:
    """Each rank encodes its own slices; a slice is decoded into the slot, then gathered
    (decode then gather, [Note: decode pipeline])."""
    res = assert_all_ok(run_ranks(_gathered, world, resident, restore, timeout_s=120))
    for rank, r in enumerate(res):
        st = r["stats"]
        assert r["same"], rank
        assert st["transfer"] == "allgather" and st["group_size"] == world
        assert 0 < st["host_encoded_nbytes"] <= st["host_encoded_raw_nbytes"]
        assert st["host_nbytes"] == st["host_encoded_nbytes"]
        assert st["allgather_nbytes"] > 0 and st["decoded_nbytes"] > 0
        assert r["ledger"] == (0, 0)
        if restore:
            assert r["restored"], rank


class _Empty(nn.Module):
    """A block without tensors."""

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x * scale


class _WithEmptyBlock(ToyDiT):
    def __init__(self) -> None:
        super().__init__(3)
        self.blocks.insert(1, _Empty())


def test_a_block_without_tensors_streams_with_the_codec() -> None:
    model = _WithEmptyBlock()
    ref = _run(clone(model), 2)
    b = _enable(model)
    assert all(torch.equal(x, y) for x, y in zip(ref, _run(model, 2)))
    b.disable()
    assert all(torch.equal(x, y) for x, y in zip(ref, _run(model, 2)))


def test_an_in_place_write_of_an_encoded_block_is_refused_naming_the_codec() -> None:
    class Writes(ToyBlock):
        def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
            self.gain.add_(1)  # a step counter kept in a buffer
            return super().forward(x, scale=scale)

    model = ToyDiT(3)
    model.blocks[1] = Writes(16, 1)
    b = _enable(model)
    try:
        with pytest.raises(dlo.OffloadError, match="with a codec the host copy is encoded"):
            _run(model, 1)
    finally:
        b.disable()


@pytest.mark.parametrize(("compute_ms", "expected"), [(None, "none"), (1e-6, "ans")])
def test_codec_auto_is_decided_by_the_policy(compute_ms: float | None, expected: str) -> None:
    model = ToyDiT(3)
    ref = _run(clone(model), 2)
    cfg = dlo.OffloadConfig(mode="layer", codec="auto", block_compute_ms=compute_ms)
    b = dlo.enable_offload(model, cfg, device="cpu")
    assert b is not None
    try:
        st = b.stats()
        assert st["codec"] == expected, st["policy"]
        (stack,) = st["policy"]["stacks"].values()
        assert stack["codec"] == expected and stack["codec_reason"].startswith("auto: ")
        assert all(torch.equal(x, y) for x, y in zip(ref, _run(model, 2)))
    finally:
        b.disable()


class Int8Block(ToyBlock):
    """Weight-only int8 as stored: an int8 weight and its fp32 per-row scale."""

    def __init__(self, dim: int, seed: int) -> None:
        super().__init__(dim, seed)
        g = torch.Generator().manual_seed(seed + 7)
        w = torch.randint(-127, 128, (dim, dim), generator=g, dtype=torch.int8)
        self.register_buffer("w_int8", w)
        self.register_buffer("w_scale", torch.rand(dim, 1, generator=g) * 0.01)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h = super().forward(x, scale=scale)
        return h + h.float() @ (self.w_int8.float() * self.w_scale).t().to(h.dtype) * 0.01


@pytest.mark.parametrize("codec", ["none", "ans"])
def test_quantized_weights_stream_as_stored_and_subclasses_are_refused(codec: str) -> None:
    """Issue 22 item 5: int8/fp8 weights with their scales stream in their stored dtype,
    bitwise; a tensor subclass is refused at enable naming the tensor and its type."""
    model = ToyDiT(3)
    model.blocks[1] = Int8Block(16, 1)
    ref = _run(clone(model), 2)
    b = dlo.enable_offload(model, dlo.OffloadConfig(mode="layer", codec=codec), device="cpu")
    assert b is not None
    assert model.blocks[1].w_int8.dtype == torch.int8  # stored dtype, not upcast
    assert all(torch.equal(x, y) for x, y in zip(ref, _run(model, 2)))
    b.disable()

    class Packed(torch.Tensor):  # a tensor subclass, as quantization libraries make
        pass

    sub = ToyDiT(3)
    sub.blocks[2].register_buffer("packed", torch.zeros(4).as_subclass(Packed))
    before = snapshot(sub)
    with pytest.raises(dlo.OffloadError, match=r"blocks\.2\.packed \(Packed\)"):
        dlo.enable_offload(sub, dlo.OffloadConfig(mode="layer", codec=codec), device="cpu")
    assert_same(before, sub)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_encode_and_restore_go_through_one_pinned_bounce_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: bounce buffer]: the blocks are packed into two buffers in turn (the next one
    on a thread while one is encoded), each pinned once for the encode pass and released at
    its end (the host holds only the region then), and
    everything pinned is unpinned by the disable; bitwise throughout. (The decodes to the
    host go through it on CUDA only: tests/gpu/test_codec_gpu.py.)"""
    import dlo.codec.blocks as blocks

    class Pinning(CpuPlatform):
        can_pin = True

        def __init__(self) -> None:
            super().__init__()
            self.pinned: list[int] = []
            self.unpinned: list[int] = []

        def register_host(self, tensor: torch.Tensor) -> bool:
            self.pinned.append(tensor.numel())
            return True

        def unregister_host(self, tensor: torch.Tensor) -> None:
            self.unpinned.append(tensor.numel())

    packed: list[int] = []
    real = blocks.pack_block

    def pack_block(dst: torch.Tensor, *args: Any) -> None:
        packed.append(dst.untyped_storage().data_ptr())
        real(dst, *args)

    monkeypatch.setattr(blocks, "pack_block", pack_block)
    model = ToyDiT(4)
    ref, before = _run(clone(model)), snapshot(model)
    pf = Pinning()
    cfg = dlo.OffloadConfig(mode="layer", codec="ans", pin_memory=True)
    b = LayerwiseBackend(cfg, dlo.ParallelConfig(), pf)
    b.enable(model)
    assert len(packed) == 4 and len(set(packed)) == 2  # two buffers in turn
    assert packed[0] == packed[2] != packed[1] == packed[3]
    st = b.stats()
    assert LEDGER.host_nbytes == st["host_region_nbytes"]  # the bounce is gone
    assert LEDGER.pinned_nbytes == st["host_pinned_nbytes"] > 0
    shard = max(blk.layout.shard_nbytes for blk in b._state.host.blocks)
    assert pf.pinned[:2] == pf.unpinned[:2] == [shard, shard]  # pinned for the pass only
    assert all(torch.equal(x, y) for x, y in zip(ref, _run(model)))
    b.disable(restore=True)
    assert_same(before, model)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    assert sorted(pf.pinned) == sorted(pf.unpinned)


def test_the_platforms_codec_is_measured_with_the_policys_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reference codec is always there; nvCOMP on CUDA only where it is installed, and
    each rank publishes which at enable (``codec="auto"`` takes "none" without it)."""
    from dlo.codec import codecs
    from dlo.errors import OffloadError
    from dlo.runtime import measure

    class _Cuda:
        has_streams = True

    def missing() -> Any:
        raise OffloadError("nvCOMP is not installed")

    assert codecs.codec_available(CpuPlatform())
    monkeypatch.setattr(codecs, "import_nvcomp", missing)
    assert not codecs.codec_available(_Cuda())  # type: ignore[arg-type]

    def broken() -> Any:  # installed, but its library fails to load: no codec, no failure
        raise OSError("libnvcomp.so.6: cannot open shared object file")

    monkeypatch.setattr(codecs, "import_nvcomp", broken)
    assert not codecs.codec_available(_Cuda())  # type: ignore[arg-type]
    monkeypatch.setattr(codecs, "import_nvcomp", lambda: object())
    assert codecs.codec_available(_Cuda())  # type: ignore[arg-type]
    mine = measure.measure_rank(CpuPlatform(), rank=0, nbytes=1 << 20, pinned=False, groups={})
    assert mine.ok and mine.codec_available
    monkeypatch.setattr(measure, "codec_available", lambda platform: False)
    mine = measure.measure_rank(CpuPlatform(), rank=0, nbytes=1 << 20, pinned=False, groups={})
    assert mine.ok and not mine.codec_available
