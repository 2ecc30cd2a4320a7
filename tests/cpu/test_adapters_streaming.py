"""LoRA adapters loaded, switched, deleted and unloaded while dlo streams a pipeline's blocks
([Note: adapters while streaming] in :mod:`dlo.backends.lora`): 10 requests over 3 adapters
bit for bit against the resident pipeline with the same adapters, with and without the
codec; fuse and unfuse while enabled, encoded blocks encoded again; the refusals that stand
(inside a forward, where blocks gather) change nothing;
a failed adapter call leaves the placeholders and the model as they were."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

import dlo
from dlo.backends.lora import AdapterCalls
from dlo.commands.pipeline_calls import resident_reference
from dlo.host.region import LEDGER
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder
from tests.harness import assert_all_ok, run_ranks

TARGETS = (["to_q", "to_k", "to_v", "to_out.0"], ["to_q", "to_v"], ["to_k", "proj_out"])
"""Three adapters on different layers (the third reaches the single blocks' ``proj_out``)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adapters") / "tiny-flux"
    save_folder(FOLDERS["tiny-flux"], out, max_shard_size=40_000)
    return out


def make_loras(folder: Path, out: Path) -> list[Path]:
    """Three random LoRAs for the tiny Flux transformer, saved as diffusers saves them."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    paths = []
    for i, targets in enumerate(TARGETS):
        ref = resident_reference(str(folder), torch.float32, torch.device("cpu"))
        torch.manual_seed(i)
        config = LoraConfig(
            r=4 + 2 * i, lora_alpha=4, target_modules=targets, init_lora_weights=False
        )
        ref.transformer.add_adapter(config)
        path = out / f"lora{i}"
        FluxPipeline.save_lora_weights(
            path, transformer_lora_layers=get_peft_model_state_dict(ref.transformer)
        )
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def loras(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_loras(folder, tmp_path_factory.mktemp("loras"))


def flux_call(pipe: Any, seed: int = 0) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    call: dict[str, Any] = {**FOLDERS["tiny-flux"].call, "output_type": "pt"}
    call.update(prompt="a red fox", num_inference_steps=2)
    gen = torch.Generator().manual_seed(seed)
    return pipe(**call, generator=gen).images  # type: ignore[no-any-return]


def requests(n: int) -> list[tuple[list[str], list[float]]]:
    """``n`` requests over the adapters a0..a2: one or two adapters each, varying weights."""
    out = []
    for r in range(n):
        names = [f"a{r % 3}"] if r % 4 else [f"a{r % 3}", f"a{(r + 1) % 3}"]
        out.append((names, [1.0 if r % 2 else 0.5] * len(names)))
    return out


def switch_and_compare(
    folder: Path, loras: list[Path], device: str, cfg: dlo.OffloadConfig
) -> dict[str, Any]:
    """Load three adapters on a streaming pipeline and on a resident one, serve 10
    requests switching among them, delete one, unload all: every output bitwise; then
    disable gives the plain model back. Returns the backend's last stats."""
    dev = torch.device(device)
    ref = resident_reference(str(folder), torch.float32, dev)
    pipe, backend = dlo.load_pipeline(folder, cfg, device=device)
    assert backend is not None
    try:
        base = flux_call(pipe)
        assert torch.equal(base, flux_call(ref))
        assert backend.stats()["num_streamed_blocks"] > 0
        for i, path in enumerate(loras):
            ref.load_lora_weights(path, adapter_name=f"a{i}")
            pipe.load_lora_weights(path, adapter_name=f"a{i}")
        lora_params = [p for n, p in pipe.transformer.named_parameters() if "lora_" in n]
        assert lora_params and all(p.device.type == dev.type for p in lora_params)
        outputs = []
        for names, weights in requests(10):
            ref.set_adapters(names, weights)
            pipe.set_adapters(names, weights)
            want = flux_call(ref)
            assert torch.equal(flux_call(pipe), want), names
            assert not torch.equal(want, base)
            outputs.append(want)
        distinct: list[torch.Tensor] = []
        for o in outputs:
            if not any(torch.equal(o, d) for d in distinct):
                distinct.append(o)
        assert len(distinct) >= 3  # the adapters differ (on a GPU some outputs sum alike)
        ref.delete_adapters("a1")
        pipe.delete_adapters("a1")
        ref.set_adapters(["a0", "a2"], [0.7, 0.3])
        pipe.set_adapters(["a0", "a2"], [0.7, 0.3])
        assert torch.equal(flux_call(pipe), flux_call(ref))
        ref.unload_lora_weights()
        pipe.unload_lora_weights()
        assert not [n for n, _ in pipe.transformer.named_parameters() if "lora_" in n]
        assert torch.equal(flux_call(pipe), base)
        pipe.load_lora_weights(loras[0], adapter_name="again")  # still on at disable
        stats = backend.stats()
    finally:
        backend.disable()
    # the adapters made while enabled went where their base layers went back to
    tuners = [m for m in pipe.transformer.modules() if hasattr(m, "base_layer")]
    assert tuners and all(
        p.device == t.base_layer.weight.device for t in tuners for p in t.parameters()
    )
    pipe.unload_lora_weights()
    assert torch.equal(flux_call(pipe.to(dev)), base)  # the plain model, given back
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    return stats


@pytest.mark.parametrize("codec", ["none", "ans"])
def test_ten_requests_over_three_adapters_bitwise(
    folder: Path, loras: list[Path], codec: str
) -> None:
    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0, num_slots=2, codec=codec)
    stats = switch_and_compare(folder, loras, "cpu", cfg)
    assert stats["codec"] == codec
    assert stats["num_resident_blocks"] == 0


def test_an_adapter_loaded_before_enable_streams_with_its_block_and_deletes_while_enabled(
    folder: Path, loras: list[Path]
) -> None:
    """The other placement: an adapter loaded before enable is part of its block's layout
    (it streams with the block); one loaded after sits on the device; both switch, and the
    first deletes while enabled."""
    ref = resident_reference(str(folder), torch.float32, torch.device("cpu"))
    ref.load_lora_weights(loras[0], adapter_name="a0")

    def prepare(p: Any) -> None:
        p.load_lora_weights(loras[0], adapter_name="a0")

    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0)
    pipe, backend = dlo.load_pipeline(folder, cfg, device="cpu", prepare=prepare)
    assert backend is not None
    try:
        streamed_with_block = backend.stats()["host_nbytes"]
        assert torch.equal(flux_call(pipe), flux_call(ref))
        ref.load_lora_weights(loras[1], adapter_name="a1")
        pipe.load_lora_weights(loras[1], adapter_name="a1")
        assert backend.stats()["host_nbytes"] == streamed_with_block  # a1 is not in a block
        for names in (["a0"], ["a1"], ["a0", "a1"]):
            ref.set_adapters(names)
            pipe.set_adapters(names)
            assert torch.equal(flux_call(pipe), flux_call(ref)), names
        ref.delete_adapters("a0")
        pipe.delete_adapters("a0")
        assert torch.equal(flux_call(pipe), flux_call(ref))
    finally:
        backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_refusals_that_stand_change_nothing(folder: Path, loras: list[Path]) -> None:
    """hotswap (it copies into tensors that may be a block's), adapters made from base
    weight values, an adapter call inside a forward, and a load that names a base weight
    are refused; a failed load (no such file)
    leaves the placeholders and the outputs as they were."""
    pipe, backend = dlo.load_pipeline(folder, dlo.OffloadConfig(resident_layers=0), device="cpu")
    assert backend is not None
    try:
        pipe.load_lora_weights(loras[0], adapter_name="a0")
        want = flux_call(pipe)
        with pytest.raises(dlo.OffloadError, match="enable_lora_hotswap"):
            pipe.enable_lora_hotswap(target_rank=8)
        with pytest.raises(dlo.OffloadError, match="with hotswap"):
            pipe.load_lora_weights(loras[1], adapter_name="a0", hotswap=True)
        for bad in ({"use_dora": True}, {"init_lora_weights": "pissa"}):
            config = LoraConfig(r=2, target_modules=["to_q"], **bad)  # type: ignore[arg-type]
            with pytest.raises(dlo.OffloadError, match="made from the base weights"):
                pipe.transformer.add_adapter(config, adapter_name="bad")
        with pytest.raises(Exception, match="no_such_lora"):
            pipe.load_lora_weights(str(folder / "no_such_lora"), adapter_name="bad")
        # a LoRA that also writes a block's norm (Flux Control): refused naming the key,
        # and the adapter it had added by then taken off again
        sd = dict(load_file(str(loras[1] / "pytorch_lora_weights.safetensors")))
        norm = pipe.transformer.transformer_blocks[0].attn.norm_q
        sd["transformer.transformer_blocks.0.attn.norm_q.weight"] = torch.ones(norm.weight.shape)
        with pytest.raises(dlo.OffloadError, match=r"norm_q\.weight.*load it before enabling"):
            pipe.load_lora_weights(sd, adapter_name="ctl")
        assert set(pipe.transformer.peft_config) == {"a0"}
        assert not [n for n, _ in pipe.transformer.named_parameters() if ".ctl." in n]
        block = pipe.transformer.transformer_blocks[0]
        assert block.attn.to_q.base_layer.weight.numel() == 0  # its placeholder, not a stub
        # inside a forward: refused, naming when to call it
        seen: list[str] = []

        def inside(*_: Any) -> None:
            if not seen:
                with pytest.raises(dlo.OffloadError, match="between pipeline calls"):
                    pipe.transformer.load_lora_adapter(str(loras[1]), adapter_name="x")
                seen.append("refused")

        handle = block.register_forward_pre_hook(inside)
        try:
            assert torch.equal(flux_call(pipe), want)
        finally:
            handle.remove()
        assert seen == ["refused"]
        assert torch.equal(flux_call(pipe), want)
    finally:
        backend.disable()


def test_a_load_naming_a_tensor_of_the_model_at_enable_stays_refused() -> None:
    """Inside an adapter call only new keys load (the adapter's); outside, none."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    calls = AdapterCalls(list, torch.device("cpu"), busy=lambda: False, rank=0)
    calls.known.update(id(t) for t in model.parameters())
    new = {"0.lora_A.weight": torch.zeros(1)}
    old = {"0.weight": torch.zeros(2, 2), **new}
    assert not calls.allows_load(model, new, "")  # outside a call
    with calls.call("load_lora_adapter"):
        assert calls.allows_load(model, new, "")
        with pytest.raises(dlo.OffloadError, match=r"would write \['0.weight'\]"):
            calls.allows_load(model, old, "")
        assert calls.allows_load(model, old, "prefix.")  # keys under another module
    assert calls.depth == 0


def _gathered_rank(rank: int, world: int, folder: str, loras: list[str]) -> bool:
    """Under AllGather each rank loads its own adapter while enabled (a0 on rank 0, a1 on
    rank 1) and serves it bitwise against its own resident pipeline with that adapter; the
    gathers stay in step; then it unloads, and restore gives the plain model back."""
    ref = resident_reference(folder, torch.float32, torch.device("cpu"))
    base = flux_call(ref)
    ref.load_lora_weights(loras[rank], adapter_name="mine")
    want = flux_call(ref)
    pipe, backend = dlo.load_pipeline(
        folder,
        dlo.OffloadConfig(
            mode="layer", transfer="allgather", resident_layers=0, collective_timeout_s=30
        ),
        parallel=dlo.ParallelConfig(data_parallel_size=world),
        device="cpu",
    )
    assert backend is not None
    try:
        assert backend.stats()["gather_engine"] is not None
        assert torch.equal(flux_call(pipe), base)
        pipe.load_lora_weights(loras[rank], adapter_name="mine")
        for _ in range(2):
            assert torch.equal(flux_call(pipe), want)
        pipe.unload_lora_weights()
        assert torch.equal(flux_call(pipe), base)
    finally:
        backend.disable(restore=True)
    assert torch.equal(flux_call(pipe), base)
    return not torch.equal(want, base)


def test_allgather_ranks_load_their_own_adapters_while_enabled(
    folder: Path, loras: list[Path]
) -> None:
    paths = [str(p) for p in loras[:2]]
    assert all(assert_all_ok(run_ranks(_gathered_rank, 2, str(folder), paths, timeout_s=180)))


def test_pipeline_shadows_taken_off_in_either_order_leave_nothing() -> None:
    """Two backends' shadows of one pipeline method: removed in either order, the method is
    the class's again and an inactive shadow holds nothing of its backend."""
    from dlo.backends.lora import _PipelineShadow
    from dlo.journal import Journal

    class Pipe:
        def load_lora_weights(self) -> str:
            return "real"

    for order in ((0, 1), (1, 0)):
        pipe, journal = Pipe(), Journal()
        calls: list[str] = []
        shadows = []
        for tag in ("a", "b"):

            def shadow(real: Any, tag: str = tag, calls: list[str] = calls) -> str:
                calls.append(tag)
                return real()  # type: ignore[no-any-return]

            shadows.append(_PipelineShadow(pipe, "load_lora_weights", shadow))
            shadows[-1].install(journal)
        assert pipe.load_lora_weights() == "real" and calls == ["b", "a"]
        shadows[order[0]].remove()
        calls.clear()
        assert pipe.load_lora_weights() == "real"
        assert calls == ["ab"[order[1]]]
        assert shadows[order[0]].shadow is None
        shadows[order[1]].remove()
        assert "load_lora_weights" not in vars(pipe), order


def fuse_and_compare(
    folder: Path, loras: list[Path], device: str, cfg: dlo.OffloadConfig, when: str
) -> dict[str, Any]:
    """fuse, unfuse, fuse on a streaming pipeline and on a resident one in step: bitwise
    after each, twice (the second call reloads every block from its host copy), and after
    disable. Returns the backend's stats."""
    dev = torch.device(device)
    ref = resident_reference(str(folder), torch.float32, dev)
    ref.load_lora_weights(loras[0], adapter_name="a0")

    def prepare(p: Any) -> None:
        if when == "before":
            p.load_lora_weights(loras[0], adapter_name="a0")

    pipe, backend = dlo.load_pipeline(folder, cfg, device=device, prepare=prepare)
    assert backend is not None
    seen = []
    try:
        if when == "after":
            pipe.load_lora_weights(loras[0], adapter_name="a0")
        assert torch.equal(flux_call(pipe), flux_call(ref))  # blocks kept in slots now
        for step in ("fuse", "unfuse", "fuse"):
            for p in (ref, pipe):  # adapter_names: diffusers reads merge's signature
                p.fuse_lora(lora_scale=0.7, adapter_names=["a0"]) if step == "fuse" else (
                    p.unfuse_lora()
                )
            want = flux_call(ref)
            assert torch.equal(flux_call(pipe), want), step
            assert torch.equal(flux_call(pipe), want), step
            seen.append(want)
        # fused: PEFT would unmerge in place inside the forward of a disabled adapter
        pipe.disable_lora()
        with pytest.raises(dlo.OffloadError, match=r"unmerge\(\) of a LoRA layer.*unfuse_lora"):
            flux_call(pipe)
        pipe.enable_lora()
        assert torch.equal(flux_call(pipe), want)
        stats = backend.stats()
    finally:
        backend.disable()
    assert not torch.equal(seen[0], seen[1])  # the fuse changed the weights
    assert torch.equal(flux_call(pipe.to(dev)), flux_call(ref))  # fused weights given back
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    return stats


@pytest.mark.parametrize("resident", [0, 2, "pins"])
@pytest.mark.parametrize("when", ["after", "before"])
def test_fuse_and_unfuse_while_enabled_give_the_resident_bits(
    folder: Path, loras: list[Path], when: str, resident: Any
) -> None:
    """fuse_lora while enabled rewrites the host copies block by block ([Note: fusing while
    streaming]): the resident bits after each fuse and unfuse and after disable; an adapter
    loaded before enable (streamed with its block) fuses too; streamed, resident and pinned
    blocks alike."""
    cfg = (
        dlo.OffloadConfig(device_budget_gb=0.0012)  # blocks pinned: their own device copies
        if resident == "pins"
        else dlo.OffloadConfig(mode="layer", resident_layers=resident, num_slots=2)
    )
    st = fuse_and_compare(folder, loras, "cpu", cfg, when)
    if resident == "pins":
        assert st["num_pinned_blocks"] > 0
    else:
        assert st["num_resident_blocks"] == resident and st["num_streamed_blocks"] > 0


@pytest.mark.parametrize("resident", [0, 2, "pins"])
def test_fusing_encoded_blocks_encodes_them_again_bitwise(
    folder: Path, loras: list[Path], resident: Any
) -> None:
    """With a codec the fuse encodes each rewritten block again ([Note: fusing while
    streaming]): the resident bits after each fuse and unfuse and after disable."""
    cfg = (
        dlo.OffloadConfig(device_budget_gb=0.0012, codec="ans")
        if resident == "pins"
        else dlo.OffloadConfig(mode="layer", resident_layers=resident, num_slots=2, codec="ans")
    )
    st = fuse_and_compare(folder, loras, "cpu", cfg, "after")
    assert st["codec"] == "ans" and st["host_encoded_nbytes"] > 0


def fused_encoded(folder: Path, lora: Path) -> tuple[Any, Any, Any]:
    """A resident pipeline and one streaming encoded blocks (``codec="ans"``), each with
    ``lora`` loaded and fused (the streaming one while enabled): ``(ref, pipe, backend)``."""
    ref = resident_reference(str(folder), torch.float32, torch.device("cpu"))
    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0, codec="ans")
    pipe, backend = dlo.load_pipeline(folder, cfg, device="cpu")
    assert backend is not None
    try:
        for p in (ref, pipe):
            p.load_lora_weights(lora, adapter_name="a0")
            p.fuse_lora(lora_scale=0.7)
    except BaseException:
        backend.disable()
        raise
    return ref, pipe, backend


def test_state_dict_after_fusing_encoded_blocks_is_the_fused_weights(
    folder: Path, loras: list[Path]
) -> None:
    """state_dict() decodes the block's host copy as it is now: after a fuse encoded it
    again, the new piece table over the new bytes (never the enable's table)."""
    ref, pipe, backend = fused_encoded(folder, loras[0])
    try:
        want, got = ref.transformer.state_dict(), pipe.transformer.state_dict()
        assert sorted(want) == sorted(got)
        assert all(torch.equal(want[k], got[k]) for k in want)
    finally:
        backend.disable()


def test_a_fuse_failing_to_fit_the_decoders_leaves_the_host_copy_whole(
    folder: Path, loras: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decoders are fitted to a block encoded again before its host copy changes: a
    failure there (a device out of memory growing the staging) leaves the old piece table
    over the old bytes, never the old table over new bytes."""
    from dlo.backends.layer_codec import HostCodec
    from dlo.runtime.decoding import Decoder

    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0, codec="ans")
    pipe, backend = dlo.load_pipeline(folder, cfg, device="cpu")
    assert backend is not None
    placed: list[str] = []
    real_place = HostCodec.place

    def place(self: Any, name: str, *args: Any) -> Any:
        placed.append(name)
        return real_place(self, name, *args)

    def fit(self: Any, layout: Any) -> None:
        raise RuntimeError("CUDA out of memory (injected)")

    try:
        pipe.load_lora_weights(loras[0], adapter_name="a0")
        coded = [b for b in backend._blocks if b.encoded is not None]
        before = [b.encoded.raw() for b in coded]
        monkeypatch.setattr(HostCodec, "place", place)
        monkeypatch.setattr(Decoder, "fit", fit)
        with pytest.raises(RuntimeError, match="injected"):
            pipe.fuse_lora(lora_scale=0.7)
        monkeypatch.undo()
        assert placed == []  # nothing written into a host copy
        assert all(torch.equal(b.encoded.raw(), r) for b, r in zip(coded, before))
    finally:
        backend.disable()


def test_a_fused_encoded_block_is_never_saved_as_the_checkpoint_s(
    folder: Path, loras: list[Path], tmp_path: Path
) -> None:
    """A fused block's bytes are no longer its checkpoint's: save_encoded after the fuse
    leaves it out, and the next enable without the adapter encodes it anew from the
    checkpoint (the resident bits without the LoRA), never serving the fused bytes."""
    own = tmp_path / "folder"
    shutil.copytree(folder, own)
    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0, codec="ans")
    plain = flux_call(resident_reference(str(own), torch.float32, torch.device("cpu")))
    pipe, backend = dlo.load_pipeline(own, cfg, device="cpu")
    assert backend is not None
    try:
        backend.save_encoded()  # every block, as loaded
        pipe.load_lora_weights(loras[0], adapter_name="a0")
        pipe.fuse_lora(lora_scale=0.7)
        fused = [
            b.name for b in backend._blocks if b.index not in backend._state.host.codec.origins
        ]
        assert fused
        with contextlib.suppress(ValueError):  # every encoded block fused: nothing to save
            backend.save_encoded()
    finally:
        backend.disable()
    pipe, backend = dlo.load_pipeline(own, cfg, device="cpu")
    assert backend is not None
    try:
        assert torch.equal(flux_call(pipe), plain)
    finally:
        backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
