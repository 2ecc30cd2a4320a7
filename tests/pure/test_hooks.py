"""Tests of dlo.hooks: named, owned, removable hooks and foreign-offloader detection."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dlo.errors import OffloadError
from dlo.hooks import registry as dlo_hooks
from dlo.hooks.dispatch import ModelHook
from dlo.hooks.foreign import find_foreign_offloaders, foreign_offloader
from dlo.hooks.registry import HookRegistry


class Recorder(ModelHook):
    """Appends ("pre"|"post", tag, output-or-None) to a shared log."""

    def __init__(self, tag: str, log: list[tuple[Any, ...]]) -> None:
        self.tag = tag
        self.log = log

    def pre_forward(self, module, args, kwargs):
        self.log.append(("pre", self.tag))
        return None

    def post_forward(self, module, args, kwargs, output):
        self.log.append(("post", self.tag, output))
        return output


class Boom(Exception):
    pass


class Raising(nn.Module):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def forward(self, x):
        raise self.exc


def _snapshot(module: nn.Module) -> dict[str, Any]:
    """The module's attribute dict: identity of every value, contents of every dict."""
    return {
        key: (id(value), dict(value) if isinstance(value, dict) else None)
        for key, value in vars(module).items()
    }


@pytest.fixture
def log() -> list[tuple[Any, ...]]:
    return []


@pytest.fixture
def gloo_group() -> Iterator[None]:
    """A single-process gloo group for FSDP / DTensor detection tests."""
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- ordering
def test_pre_in_order_post_reversed(log):
    module = nn.Identity()
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    reg.register(module, "b", Recorder("b", log))
    out = module(torch.ones(1))
    assert [entry[:2] for entry in log] == [
        ("pre", "a"),
        ("pre", "b"),
        ("post", "b"),
        ("post", "a"),
    ]
    assert torch.equal(out, torch.ones(1))
    assert reg.names_on(module) == ["a", "b"]
    assert HookRegistry.owners_on(module) == [("dlo.test", "a"), ("dlo.test", "b")]


def test_second_owner_refused(log):
    module = nn.Linear(2, 2)
    first = HookRegistry("dlo.layerwise")
    first.register(module, "stream", Recorder("a", log))
    other = HookRegistry("dlo.model_swap")
    with pytest.raises(OffloadError, match="at most one strategy owns offload hooks") as info:
        other.register(module, "swap", Recorder("b", log))
    assert "dlo.layerwise" in str(info.value)
    assert "Linear" in str(info.value)
    # A second instance of the same backend is a different owner too.
    with pytest.raises(OffloadError, match="same owner name"):
        HookRegistry("dlo.layerwise").register(module, "x", Recorder("c", log))
    # State-dict hooks follow the same rule.
    with pytest.raises(OffloadError, match=r"dlo\.layerwise"):
        other.register_state_dict_hook(module, "sd", lambda m, sd, prefix: None)
    assert other.is_empty
    assert HookRegistry.owners_on(module) == [("dlo.layerwise", "stream")]
    module(torch.ones(2))
    assert [entry[:2] for entry in log] == [("pre", "a"), ("post", "a")]
    # Once the first owner is gone, the other may register.
    first.remove_all()
    other.register(module, "swap", Recorder("b", log))
    assert HookRegistry.owners_on(module) == [("dlo.model_swap", "swap")]
    other.remove_all()


def test_duplicate_name_and_bad_input(log):
    module = nn.Identity()
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    with pytest.raises(ValueError, match="'a'"):
        reg.register(module, "a", Recorder("a2", log))
    with pytest.raises(ValueError, match="'a'"):
        reg.register_state_dict_hook(module, "a", lambda m, sd, prefix: None)
    with pytest.raises(ValueError, match="'a'"):
        reg.register_load_state_dict_pre_hook(module, "a", lambda *args: None)
    with pytest.raises(ValueError, match="non-empty"):
        reg.register(module, "", Recorder("e", log))
    with pytest.raises(TypeError, match="ModelHook"):
        reg.register(module, "f", object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        reg.register(object(), "g", Recorder("g", log))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="owner"):
        HookRegistry("")
    assert reg.names_on(module) == ["a"]
    reg.remove_all()


def test_one_hook_instance_serves_one_module(log):
    hook = Recorder("a", log)
    first, second = nn.Identity(), nn.Identity()
    reg = HookRegistry("dlo.test")
    reg.register(first, "a", hook)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(second, "a", hook)
    reg.remove(first, "a")
    reg.register(second, "a", hook)
    assert reg.names_on(second) == ["a"]
    reg.remove_all()


# ----------------------------------------------------------------------------- rewriting
class ScaledAdd(nn.Module):
    def forward(self, x, *, scale=1.0):
        return x * scale


def test_pre_hook_rewrites_args_and_kwargs_before_user_pre_hooks():
    module = ScaledAdd()
    seen: list[tuple[Any, Any]] = []

    def user_pre(mod, args, kwargs):
        seen.append((args[0].item(), kwargs.get("scale")))

    module.register_forward_pre_hook(user_pre, with_kwargs=True)

    class Rewrite(ModelHook):
        def pre_forward(self, module, args, kwargs):
            return (args[0] + 1,), {**kwargs, "scale": 3.0}

    class Double(ModelHook):
        def pre_forward(self, module, args, kwargs):
            assert kwargs["scale"] == 3.0  # sees the first hook's rewrite
            return (args[0] * 2,), kwargs

    reg = HookRegistry("dlo.test")
    reg.register(module, "rewrite", Rewrite())
    reg.register(module, "double", Double())
    out = module(torch.tensor(1.0))
    assert out.item() == (1.0 + 1) * 2 * 3.0
    # dlo's pre-hooks run before the user's even though the user's was registered first.
    assert seen == [(4.0, 3.0)]
    reg.remove_all()
    assert module(torch.tensor(1.0), scale=2.0).item() == 2.0


def test_pre_hook_bad_return_is_type_error(log):
    class Bad(ModelHook):
        def pre_forward(self, module, args, kwargs):
            return args  # forgot kwargs

    module = nn.Identity()
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    reg.register(module, "bad", Bad())
    with pytest.raises(TypeError, match=r"Bad\.pre_forward"):
        module(torch.ones(1))
    assert [entry[:2] for entry in log] == [("pre", "a"), ("post", "a")]
    assert log[-1][2] is None
    reg.remove_all()


def test_post_hook_replaces_output_and_none_keeps_it():
    class Plus(ModelHook):
        def __init__(self, value: float) -> None:
            self.value = value

        def post_forward(self, module, args, kwargs, output):
            return output + self.value

    class ReturnsNone(ModelHook):
        def post_forward(self, module, args, kwargs, output):
            return None

    module = nn.Identity()
    reg = HookRegistry("dlo.test")
    reg.register(module, "times", Plus(1.0))  # runs last (post is reversed)
    reg.register(module, "none", ReturnsNone())
    reg.register(module, "plus", Plus(10.0))  # runs first
    assert module(torch.zeros(1)).item() == 11.0
    reg.remove_all()


# ----------------------------------------------------------------------------- errors
def test_forward_exception_reaches_post_with_none_and_is_reraised_unchanged(log):
    class Replace(ModelHook):
        def post_forward(self, module, args, kwargs, output):
            log.append(("replace", output))
            return torch.zeros(1)  # ignored on the error path

    error = Boom("forward failed")
    module = Raising(error)
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    reg.register(module, "replace", Replace())
    with pytest.raises(Boom) as info:
        module(torch.ones(1))
    assert info.value is error
    assert log == [("pre", "a"), ("replace", None), ("post", "a", None)]
    assert dlo_hooks._STATES[module].frames == []
    reg.remove_all()


def test_pre_hook_raising_unwinds_only_entered_hooks(log):
    error = Boom("pre failed")

    class Fail(ModelHook):
        def pre_forward(self, module, args, kwargs):
            raise error

    module = nn.Identity()
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    reg.register(module, "b", Recorder("b", log))
    reg.register(module, "fail", Fail())
    reg.register(module, "c", Recorder("c", log))
    with pytest.raises(Boom) as info:
        module(torch.ones(1))
    assert info.value is error
    assert log == [("pre", "a"), ("pre", "b"), ("post", "b", None), ("post", "a", None)]
    assert dlo_hooks._STATES[module].frames == []
    # The next call is clean once the failing hook is gone.
    reg.remove(module, "fail")
    log.clear()
    module(torch.ones(1))
    assert [entry[:2] for entry in log] == [
        ("pre", "a"),
        ("pre", "b"),
        ("pre", "c"),
        ("post", "c"),
        ("post", "b"),
        ("post", "a"),
    ]
    reg.remove_all()


def test_post_hook_raising_still_unwinds_earlier_hooks(log, caplog):
    error = Boom("post failed")

    class FailPost(ModelHook):
        def post_forward(self, module, args, kwargs, output):
            raise error

    class FailUnwind(ModelHook):
        def post_forward(self, module, args, kwargs, output):
            log.append(("unwind-fail", output))
            raise RuntimeError("secondary")

    module = nn.Identity()
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    reg.register(module, "unwind_fail", FailUnwind())
    reg.register(module, "fail", FailPost())
    with caplog.at_level("WARNING", logger="dlo.hooks"), pytest.raises(Boom) as info:
        module(torch.ones(1))
    assert info.value is error
    assert log == [("pre", "a"), ("unwind-fail", None), ("post", "a", None)]
    assert "FailUnwind.post_forward raised while unwinding" in caplog.text
    assert dlo_hooks._STATES[module].frames == []
    reg.remove_all()


# ----------------------------------------------------------------------------- re-entrancy
class Recursive(nn.Module):
    """Calls itself ``depth`` times; optionally swallows an exception from the inner call."""

    def forward(self, x, depth: int = 0, swallow: bool = False):
        if depth == 0:
            return x + 1
        if swallow:
            try:
                return self(x, depth=depth - 1)
            except Boom:
                return x * 100
        return self(x, depth=depth - 1) * 2


def test_reentrant_calls_pair_pre_and_post():
    events: list[tuple[str, int, Any]] = []

    class Depth(ModelHook):
        def pre_forward(self, module, args, kwargs):
            events.append(("pre", kwargs.get("depth", 0), None))

        def post_forward(self, module, args, kwargs, output):
            events.append(("post", kwargs.get("depth", 0), output.item()))
            return output

    module = Recursive()
    reg = HookRegistry("dlo.test")
    reg.register(module, "depth", Depth())
    out = module(torch.tensor(0.0), depth=2)
    assert out.item() == 4.0
    assert events == [
        ("pre", 2, None),
        ("pre", 1, None),
        ("pre", 0, None),
        ("post", 0, 1.0),
        ("post", 1, 2.0),
        ("post", 2, 4.0),
    ]
    assert dlo_hooks._STATES[module].frames == []
    reg.remove_all()


def test_reentrant_inner_failure_before_dlo_pre_hook_does_not_steal_outer_frame(log):
    """A global pre-hook raising in the inner call: dlo's pre never ran there."""
    module = Recursive()
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))

    def global_pre(mod, args):
        if mod is module and len(log) == 1:  # only the inner call
            raise Boom("global pre-hook")

    handle = nn.modules.module.register_module_forward_pre_hook(global_pre)
    try:
        out = module(torch.tensor(1.0), depth=1, swallow=True)
    finally:
        handle.remove()
    assert out.item() == 100.0
    # The outer call's post-hook saw the real output, not the inner error path.
    assert len(log) == 2
    assert log[0] == ("pre", "a")
    assert log[1][:2] == ("post", "a") and log[1][2].item() == 100.0
    assert dlo_hooks._STATES[module].frames == []
    reg.remove_all()


def test_reentrant_inner_forward_failure_swallowed_by_outer(log):
    class FailAtZero(nn.Module):
        def forward(self, x, depth: int = 0):
            if depth == 0:
                raise Boom("inner")
            try:
                return self(x, depth=depth - 1)
            except Boom:
                return x - 1

    module = FailAtZero()
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    out = module(torch.tensor(5.0), depth=1)
    assert out.item() == 4.0
    assert [entry[:2] for entry in log] == [
        ("pre", "a"),
        ("pre", "a"),
        ("post", "a"),
        ("post", "a"),
    ]
    assert log[2][2] is None  # inner call: error path
    assert log[3][2].item() == 4.0  # outer call: real output
    reg.remove_all()


# ----------------------------------------------------------------------------- removal
def test_removal_is_owner_scoped_and_idempotent(log):
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    reg = HookRegistry("dlo.a")
    stranger = HookRegistry("dlo.b")
    reg.register(first, "x", Recorder("x", log))
    reg.register(first, "y", Recorder("y", log))
    reg.register(second, "x", Recorder("x2", log))
    reg.register_state_dict_hook(second, "sd", lambda m, sd, prefix: None)
    assert not reg.is_empty
    assert stranger.remove(first, "x") is False
    assert reg.remove(first, "nope") is False
    assert reg.remove(nn.Linear(1, 1), "x") is False
    assert reg.remove(first, "x") is True
    assert reg.remove(first, "x") is False
    assert reg.names_on(first) == ["y"]
    assert reg.remove_all() == 3
    assert reg.remove_all() == 0
    assert reg.is_empty
    assert reg.names_on(first) == [] and HookRegistry.owners_on(second) == []
    log.clear()
    first(torch.ones(2))
    second(torch.ones(2))
    assert log == []


def test_remove_all_restores_module_exactly_and_leaves_user_hooks(log):
    module = nn.Linear(2, 2)
    user_events: list[str] = []
    user_pre = module.register_forward_pre_hook(lambda m, a: user_events.append("user-pre"))
    user_post = module.register_forward_hook(lambda m, a, o: user_events.append("user-post"))
    module.register_state_dict_post_hook(lambda m, sd, prefix, meta: None)
    before = _snapshot(module)
    hook_dicts = ("_forward_hooks", "_forward_pre_hooks", "_state_dict_hooks")
    before_hooks = {key: dict(getattr(module, key)) for key in hook_dicts}

    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    reg.register(module, "b", Recorder("b", log))
    reg.register_state_dict_hook(module, "sd", lambda m, sd, prefix: None)
    reg.register_load_state_dict_pre_hook(module, "load", lambda *args: None)
    assert _snapshot(module) != before
    module(torch.ones(2))
    assert user_events == ["user-pre", "user-post"]
    assert [entry[:2] for entry in log] == [
        ("pre", "a"),
        ("pre", "b"),
        ("post", "b"),
        ("post", "a"),
    ]

    assert reg.remove_all() == 4
    assert _snapshot(module) == before
    assert {key: dict(getattr(module, key)) for key in hook_dicts} == before_hooks
    assert module not in dlo_hooks._STATES

    # The user's hooks are still there and still run; dlo's are gone.
    user_events.clear()
    log.clear()
    module(torch.ones(2))
    assert user_events == ["user-pre", "user-post"] and log == []
    user_pre.remove()
    user_post.remove()


def test_dispatchers_removed_with_last_forward_hook(log):
    module = nn.Identity()
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    reg.register_state_dict_hook(module, "sd", lambda m, sd, prefix: None)
    assert len(module._forward_pre_hooks) == 1 and len(module._forward_hooks) == 1
    reg.remove(module, "a")
    assert len(module._forward_pre_hooks) == 0 and len(module._forward_hooks) == 0
    assert len(module._state_dict_hooks) == 1
    reg.remove(module, "sd")
    assert len(module._state_dict_hooks) == 0
    assert module not in dlo_hooks._STATES


def test_remove_during_forward_takes_effect_at_once(log):
    module = nn.Identity()
    reg = HookRegistry("dlo.test")

    class RemoveAll(ModelHook):
        def pre_forward(self, module, args, kwargs):
            reg.remove_all()

    reg.register(module, "a", Recorder("a", log))
    reg.register(module, "remove", RemoveAll())
    reg.register(module, "b", Recorder("b", log))
    assert torch.equal(module(torch.ones(1)), torch.ones(1))
    # Removed hooks get no further call, not even the post of the call in flight.
    assert log == [("pre", "a")]
    assert module not in dlo_hooks._STATES
    assert len(module._forward_hooks) == 0 and len(module._forward_pre_hooks) == 0
    module(torch.ones(1))
    assert log == [("pre", "a")]


def test_remove_one_hook_during_forward(log):
    module = nn.Identity()
    reg = HookRegistry("dlo.test")

    class RemoveB(ModelHook):
        def pre_forward(self, module, args, kwargs):
            reg.remove(module, "b")

    reg.register(module, "a", Recorder("a", log))
    reg.register(module, "remove_b", RemoveB())
    reg.register(module, "b", Recorder("b", log))
    reg.register(module, "c", Recorder("c", log))
    module(torch.ones(1))
    assert [entry[:2] for entry in log] == [
        ("pre", "a"),
        ("pre", "c"),
        ("post", "c"),
        ("post", "a"),
    ]
    assert dlo_hooks._STATES[module].frames == []
    reg.remove_all()


# ----------------------------------------------------------------------------- state dict
def test_state_dict_hook_replaces_entries_with_prefix():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    block = model[1]
    real = {"weight": torch.full((2, 2), 7.0), "bias": torch.full((2,), 7.0)}
    prefixes: list[str] = []

    def materialize(module, state_dict, prefix):
        assert module is block
        prefixes.append(prefix)
        for key, value in real.items():
            state_dict[prefix + key] = value.clone()

    reg = HookRegistry("dlo.test")
    reg.register_state_dict_hook(block, "materialize", materialize)
    sd = model.state_dict()
    assert prefixes == ["1."]
    assert torch.equal(sd["1.weight"], real["weight"]) and torch.equal(sd["1.bias"], real["bias"])
    assert torch.equal(sd["0.weight"], model[0].weight.detach())
    assert torch.equal(block.state_dict()["weight"], real["weight"])
    reg.remove_all()
    assert torch.equal(model.state_dict()["1.weight"], block.weight.detach())


def test_load_state_dict_pre_hook_can_refuse():
    model = nn.Sequential(nn.Linear(2, 2))
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def refuse(module, state_dict, prefix, *rest):
        raise OffloadError("disable offload before load_state_dict", block=prefix.rstrip("."))

    reg = HookRegistry("dlo.test")
    reg.register_load_state_dict_pre_hook(model[0], "refuse_load", refuse)
    with pytest.raises(OffloadError, match="disable offload before load_state_dict") as info:
        model.load_state_dict(saved)
    assert info.value.block == "0"
    reg.remove_all()
    model.load_state_dict(saved)


# ----------------------------------------------------------------------------- foreign
def test_accelerate_hook_refused_and_untouched(log):
    module = nn.Linear(2, 2)
    marker = object()
    module._hf_hook = marker
    before = _snapshot(module)
    assert foreign_offloader(module) == "accelerate"
    reg = HookRegistry("dlo.test")
    with pytest.raises(OffloadError, match="accelerate") as info:
        reg.register(module, "a", Recorder("a", log))
    assert "Linear" in str(info.value)
    assert module._hf_hook is marker and _snapshot(module) == before
    assert reg.is_empty and module not in dlo_hooks._STATES


def test_diffusers_registry_with_hooks_refused():
    class FakeDiffusersRegistry:
        def __init__(self) -> None:
            self.hooks: dict[str, object] = {}

    module = nn.Linear(2, 2)
    registry = FakeDiffusersRegistry()
    module._diffusers_hook = registry
    assert foreign_offloader(module) is None  # an empty registry manages nothing
    registry.hooks["group_offloading"] = object()
    assert foreign_offloader(module) == "diffusers"
    with pytest.raises(OffloadError, match="diffusers"):
        HookRegistry("dlo.test").register(module, "a", ModelHook())
    assert list(registry.hooks) == ["group_offloading"]


def test_find_foreign_offloaders_paths():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    assert find_foreign_offloaders(model) == []
    model[1][1]._hf_hook = object()
    model._hf_hook = object()
    assert find_foreign_offloaders(model) == [("", "accelerate"), ("1.1", "accelerate")]
    assert foreign_offloader(model[1]) is None  # non-recursive


def test_fsdp2_fully_shard_and_dtensor_refused(gloo_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert foreign_offloader(model) == "FSDP2 fully_shard"
    assert foreign_offloader(model[0]) == "FSDP2 fully_shard"
    # model[1][0] is managed by the root's FSDP state: its parameters are DTensors.
    assert foreign_offloader(model[1][0]) == "DTensor parameters"
    assert foreign_offloader(model[1]) is None
    assert find_foreign_offloaders(model) == [
        ("", "FSDP2 fully_shard"),
        ("0", "FSDP2 fully_shard"),
        ("1.0", "DTensor parameters"),
    ]
    reg = HookRegistry("dlo.test")
    with pytest.raises(OffloadError, match="FSDP2 fully_shard"):
        reg.register(model[0], "a", ModelHook())
    with pytest.raises(OffloadError, match="DTensor parameters"):
        reg.register(model[1][0], "a", ModelHook())
    assert reg.is_empty


def test_fsdp1_refused(gloo_group):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu"))
    assert foreign_offloader(wrapped) == "FSDP"
    with pytest.raises(OffloadError, match="FSDP"):
        HookRegistry("dlo.test").register(wrapped, "a", ModelHook())

    # Subclasses (as wrappers of FSDP1 sometimes define) are recognized too.
    subclass = type("MyFSDP", (FullyShardedDataParallel,), {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped_sub = subclass(nn.Linear(4, 4), device_id=torch.device("cpu"))
    assert foreign_offloader(wrapped_sub) == "FSDP"


# ----------------------------------------------------------------------------- lifetime
def test_deleted_module_drops_its_state(log):
    module = nn.Linear(2, 2)
    reg = HookRegistry("dlo.test")
    reg.register(module, "a", Recorder("a", log))
    state_ref = weakref.ref(dlo_hooks._STATES[module])
    module_ref = weakref.ref(module)
    del module
    gc.collect()
    assert module_ref() is None
    assert state_ref() is None
    assert reg.is_empty
    assert reg.remove_all() == 0


def test_no_reference_cycles_after_remove_all(log):
    module = nn.Linear(2, 2)
    reg = HookRegistry("dlo.test")
    hook = Recorder("a", log)
    reg.register(module, "a", hook)
    reg.register_state_dict_hook(module, "sd", lambda m, sd, prefix: None)
    module(torch.ones(2))
    hook_ref = weakref.ref(hook)
    state_ref = weakref.ref(dlo_hooks._STATES[module])
    del hook
    reg.remove_all()
    # Plain reference counting frees them: no cycle needs the collector.
    gc.disable()
    try:
        assert hook_ref() is None
        assert state_ref() is None
    finally:
        gc.enable()
    gc.collect()
    assert hook_ref() is None
    registry_ref = weakref.ref(reg)
    del reg
    assert registry_ref() is None
    assert module(torch.ones(2)).shape == (2,)
