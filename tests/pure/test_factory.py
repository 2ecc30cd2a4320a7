"""Choosing and creating backends (dlo.backends.factory): what is returned, what is refused,
and that a refused enable leaves nothing behind."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import torch
from torch import nn

import dlo
from dlo.backends.factory import enable_offload, get_offload_backend
from dlo.backends.layerwise import LayerwiseBackend
from dlo.backends.model_swap import ModelSwapBackend
from dlo.host.region import LEDGER
from dlo.models import build_pipeline, make_inputs
from dlo.platform.device import CpuPlatform

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def single_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def _state(model: nn.Module) -> dict[str, tuple[Any, ...]]:
    """Identity, storage, device and a copy of every parameter and buffer, plus the number of
    torch forward hooks of every module (so a hook dlo forgot to remove shows up)."""
    state: dict[str, tuple[Any, ...]] = {
        name: (id(t), t.data_ptr(), t.device, t.dtype, t.detach().clone())
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
    for name, m in model.named_modules():
        hooks = (len(m._forward_pre_hooks), len(m._forward_hooks), len(vars(m)))
        state[f"module:{name}"] = (hooks, 0, None, None, torch.zeros(()))
    return state


def _assert_untouched(model: nn.Module, before: dict[str, tuple[Any, ...]]) -> None:
    after = _state(model)
    assert after.keys() == before.keys()
    for name, (ident, ptr, device, dtype, value) in before.items():
        a_ident, a_ptr, a_device, a_dtype, a_value = after[name]
        assert (a_ident, a_ptr, a_device, a_dtype) == (ident, ptr, device, dtype), name
        assert torch.equal(a_value, value), name


def _assert_nothing_installed(model: nn.Module) -> None:
    for name, m in model.named_modules():
        assert dlo.HookRegistry.owners_on(m) == [], name
    assert LEDGER.host_nbytes == 0
    assert LEDGER.pinned_nbytes == 0


@pytest.fixture(scope="module")
def tiny_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return make_inputs("tiny", dtype=torch.float32)


def _tiny() -> nn.Module:
    return build_pipeline("tiny", dtype=torch.float32)


# ----------------------------------------------------------------------------- get_offload_backend
@pytest.mark.parametrize("config", [None, dlo.OffloadConfig(mode="none")])
@pytest.mark.parametrize("device", [None, "cpu", "mps"])
def test_disabled_gives_none(config: dlo.OffloadConfig | None, device: str | None) -> None:
    assert get_offload_backend(config, device=device) is None
    assert get_offload_backend(config, dlo.ParallelConfig(), device) is None


@pytest.mark.parametrize("device", ["mps", torch.device("mps"), "xla", "meta"])
@pytest.mark.parametrize("mode", ["layer", "module"])
def test_unsupported_device_gives_none_with_warning(
    device: str | torch.device, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dlo.backends.factory"):
        assert get_offload_backend(dlo.OffloadConfig(mode=mode), device=device) is None
    kind = torch.device(device).type
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(kind in r.getMessage() and "not supported" in r.getMessage() for r in warnings)


def test_unsupported_device_enable_offload_installs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _tiny()
    before = _state(model)
    with caplog.at_level(logging.WARNING, logger="dlo.backends.factory"):
        assert enable_offload(model, dlo.OffloadConfig(mode="layer"), device="mps") is None
    assert any("mps" in r.getMessage() for r in caplog.records)
    _assert_untouched(model, before)
    _assert_nothing_installed(model)


@pytest.mark.parametrize(
    "config, cls",
    [
        (dlo.OffloadConfig(mode="layer"), LayerwiseBackend),
        (dlo.OffloadConfig(mode="layer", transfer="allgather"), LayerwiseBackend),
        (dlo.OffloadConfig(mode="layer", components=("dit",), resident_layers=1), LayerwiseBackend),
        (dlo.OffloadConfig(mode="module"), ModelSwapBackend),
        (dlo.OffloadConfig.from_flags(enable_cpu_offload=True), ModelSwapBackend),
        (dlo.OffloadConfig.from_flags(enable_layerwise_offload=True), LayerwiseBackend),
    ],
)
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_backend_class_by_mode(
    config: dlo.OffloadConfig, cls: type, device: str | torch.device
) -> None:
    backend = get_offload_backend(config, dlo.ParallelConfig(), device)
    assert type(backend) is cls
    assert isinstance(backend, dlo.OffloadBackend)
    assert not backend.is_enabled()
    assert backend.name == config.mode
    backend.disable()  # a no-op before enable


def test_backend_gets_config_parallel_and_platform() -> None:
    cfg = dlo.OffloadConfig(mode="layer", transfer="allgather")
    par = dlo.ParallelConfig(data_parallel_size=2)
    backend = get_offload_backend(cfg, par, "cpu")
    assert isinstance(backend, LayerwiseBackend)
    assert backend.config is cfg and backend.parallel is par
    assert isinstance(backend.platform, CpuPlatform)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parallel_defaults_to_data_parallel_over_world_size(
    monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    backend = get_offload_backend(dlo.OffloadConfig(mode="layer"), None, "cpu")
    assert isinstance(backend, LayerwiseBackend)
    assert backend.parallel == dlo.ParallelConfig(data_parallel_size=world)


def test_creating_a_backend_touches_nothing() -> None:
    model = _tiny()
    before = _state(model)
    for mode in ("layer", "module"):
        assert get_offload_backend(dlo.OffloadConfig(mode=mode), device="cpu") is not None
    _assert_untouched(model, before)
    _assert_nothing_installed(model)


@pytest.mark.parametrize(
    "config",
    [
        types.SimpleNamespace(enabled=True, mode="layer"),
        types.SimpleNamespace(enabled=True, mode="module"),
    ],
)
def test_config_must_be_an_offload_config(config: Any) -> None:
    with pytest.raises(TypeError, match=r"config must be an OffloadConfig.*SimpleNamespace"):
        get_offload_backend(config, device="cpu")


@pytest.mark.parametrize("config", [{"mode": "layer"}, "layer"])
def test_plain_data_config_is_a_type_error(config: Any) -> None:
    with pytest.raises(TypeError, match="config must be an OffloadConfig"):
        get_offload_backend(config, device="cpu")


@pytest.mark.parametrize(
    "parallel", [{"data_parallel_size": 2}, 2, dlo.OffloadConfig(mode="layer"), "dp=2"]
)
def test_parallel_must_be_a_parallel_config(parallel: Any) -> None:
    with pytest.raises(
        TypeError, match=r"parallel must be a ParallelConfig, got " + type(parallel).__name__
    ):
        get_offload_backend(dlo.OffloadConfig(mode="layer"), parallel, "cpu")
    with pytest.raises(TypeError, match="parallel must be a ParallelConfig"):
        enable_offload(nn.Linear(2, 2), dlo.OffloadConfig(mode="module"), parallel, "cpu")


# ----------------------------------------------------------------------------- enable_offload
@pytest.mark.parametrize(
    "config", [None, dlo.OffloadConfig(mode="none"), dlo.OffloadConfig.from_flags()]
)
def test_enable_offload_disabled_leaves_model_untouched(
    config: dlo.OffloadConfig | None, tiny_inputs: tuple[torch.Tensor, torch.Tensor]
) -> None:
    model = _tiny()
    ids, latents = tiny_inputs
    with torch.no_grad():
        ref = model.denoise(latents, model.encode(ids), steps=1)
    before = _state(model)
    assert enable_offload(model, config, device="cpu") is None
    assert enable_offload(model, config) is None
    _assert_untouched(model, before)
    _assert_nothing_installed(model)
    with torch.no_grad():
        assert torch.equal(model.denoise(latents, model.encode(ids), steps=1), ref)


def test_enable_offload_returns_an_enabled_backend(
    tiny_inputs: tuple[torch.Tensor, torch.Tensor],
) -> None:
    model = _tiny()
    ids, latents = tiny_inputs
    with torch.no_grad():
        ref = model.denoise(latents, model.encode(ids), steps=1)
    backend = enable_offload(model, dlo.OffloadConfig(mode="layer"), dlo.ParallelConfig(), "cpu")
    assert isinstance(backend, LayerwiseBackend) and backend.is_enabled()
    try:
        with torch.no_grad():
            assert torch.equal(model.denoise(latents, model.encode(ids), steps=1), ref)
    finally:
        backend.disable()
    assert not backend.is_enabled()
    _assert_nothing_installed(model)


@pytest.mark.parametrize(
    "config",
    [
        dlo.OffloadConfig(mode="layer", transfer="auto"),
        dlo.OffloadConfig(mode="layer", components=("dit",), transfer="auto"),
        dlo.OffloadConfig(mode="layer", layer_options={"dit": {"weight_transfer": "auto"}}),
        dlo.OffloadConfig(mode="layer", layer_options={"encoder": {"weight_transfer": "auto"}}),
        dlo.OffloadConfig(mode="layer", num_slots="auto", resident_layers="auto"),
        dlo.OffloadConfig(mode="layer", layer_options={"dit": {"resident_layers": "auto"}}),
    ],
)
def test_automatic_settings_resolve_at_enable(
    config: dlo.OffloadConfig, tiny_inputs: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """One rank: "auto" resolves to concrete values (no peers: rank-local), recorded in
    stats()["policy"]; the output is bitwise the resident one and disable restores the model."""
    model = _tiny()
    ids, latents = tiny_inputs
    with torch.no_grad():
        ref = model.denoise(latents, model.encode(ids), steps=1)
    before = _state(model)
    backend = enable_offload(model, config, dlo.ParallelConfig(), "cpu")
    assert isinstance(backend, LayerwiseBackend)
    try:
        st = backend.stats()
        policy = st["policy"]
        assert policy is not None and "dlo policy" in policy["explanation"]
        assert st["transfer"] == "rank-local" and st["group_size"] == 1
        assert all(s["transfer"] == "rank-local" for s in policy["stacks"].values())
        assert st["num_slots"] == policy["num_slots"] >= 2
        # the blocks the policy keeps: pinned in the ring, so a re-plan may unpin them
        assert st["num_resident_blocks"] + st["num_pinned_blocks"] == sum(
            s["num_resident"] for s in policy["stacks"].values()
        )
        assert backend.plan is not None
        assert all(s.transfer != "auto" for s in backend.plan.stacks)
        with torch.no_grad():
            assert torch.equal(model.denoise(latents, model.encode(ids), steps=1), ref)
    finally:
        backend.disable()
    after = _state(model)  # same objects, devices, dtypes and values (new storage)
    assert after.keys() == before.keys()
    for name, (ident, _ptr, device, dtype, value) in before.items():
        a_ident, _a_ptr, a_device, a_dtype, a_value = after[name]
        assert (a_ident, a_device, a_dtype) == (ident, device, dtype), name
        assert torch.equal(a_value, value), name
    _assert_nothing_installed(model)


def test_device_budget_too_small_is_refused_and_leaves_nothing(
    tiny_inputs: tuple[torch.Tensor, torch.Tensor],
) -> None:
    model = _tiny()
    before = _state(model)
    cfg = dlo.OffloadConfig(mode="layer", device_budget_gb=1e-6)
    with pytest.raises(ValueError, match=r"device_budget_gb=1e-06 cannot hold"):
        enable_offload(model, cfg, dlo.ParallelConfig(), "cpu")
    _assert_untouched(model, before)
    _assert_nothing_installed(model)


@pytest.mark.parametrize(
    "config",
    [
        dlo.OffloadConfig(mode="layer", components=("dit",)),
        dlo.OffloadConfig(mode="layer", components=("dit",), transfer="allgather"),
        dlo.OffloadConfig(mode="layer", components=("dit", "encoder")),
        dlo.OffloadConfig(mode="layer", components=("encoder",)),
    ],
)
def test_plain_sequential_with_explicit_components_raises(config: dlo.OffloadConfig) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    before = _state(model)
    backend = get_offload_backend(config, dlo.ParallelConfig(), "cpu")
    assert backend is not None
    with pytest.raises(ValueError, match="Sequential"):
        backend.enable(model)
    assert not backend.is_enabled()
    _assert_untouched(model, before)
    _assert_nothing_installed(model)
    with pytest.raises(ValueError, match="Sequential"):
        enable_offload(model, config, dlo.ParallelConfig(), "cpu")
    _assert_untouched(model, before)
    _assert_nothing_installed(model)
    with torch.no_grad():
        assert model(torch.ones(1, 4)).shape == (1, 4)
