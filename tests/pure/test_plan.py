"""Pure tests of the topology resolver (dlo.plan): no process group, no device, no tensor data."""

from __future__ import annotations

import logging
import types
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.plan.declarations import (
    OffloadPlan,
    SupportsComponentDiscovery,
    SupportsModelOffload,
    get_by_path,
)
from dlo.plan.topology import BlockStack, ResolvedOffloadPlan, resolve_offload_plan

LAYER = OffloadConfig(mode="layer")
DIT_ONLY = OffloadConfig(mode="layer", components=("dit",))


# ----------------------------------------------------------------------------- fixtures
class Block(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("scale", torch.ones(dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x)) * self.scale


class DiT(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, num_blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.other = nn.ModuleList(Block() for _ in range(2))


class TwoStackDiT(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["double_blocks", "single_blocks"]

    def __init__(self, num_double: int = 2, num_single: int = 5) -> None:
        super().__init__()
        self.time_embed = nn.Linear(4, 4)
        self.double_blocks = nn.ModuleList(Block() for _ in range(num_double))
        self.single_blocks = nn.ModuleList(Block() for _ in range(num_single))


class UndeclaredDiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))


class OpaqueDiT(nn.Module):
    """Nothing dlo can find: no declaration, no repeated classes, one block (no structure)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block()])


class LegacyDiT(nn.Module):
    _layerwise_offload_blocks_attr = "layers"

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))


class Encoder(nn.Module):
    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(Block() for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(4)


class Vae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Conv2d(4, 3, 1)


class Inner(nn.Module):
    """Holds the components one level down, so declared paths are dotted."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = DiT()
        self.text_encoder = Encoder()
        self.vae = Vae()


class DeclaredPipeline:
    """A plain object (not an nn.Module) declaring nested components."""

    _dit_modules: ClassVar[list[str]] = ["pipe.transformer"]
    _encoder_modules: ClassVar[list[str]] = ["pipe.text_encoder"]
    _vae_modules: ClassVar[list[str]] = ["pipe.vae"]
    _resident_modules: ClassVar[list[str]] = ["pipe.transformer.embed"]

    def __init__(self, plan: OffloadPlan | None = None) -> None:
        self.pipe = Inner()
        if plan is not None:
            self._offload_plan = plan


def make_pipeline(
    dits: dict[str, nn.Module],
    encoders: dict[str, nn.Module] | None = None,
    plan: OffloadPlan | None = None,
    resident: list[str] | None = None,
) -> Any:
    """A pipeline of a fresh class declaring the given components by attribute name."""
    encoders = encoders or {}
    attrs: dict[str, Any] = {
        "_dit_modules": list(dits),
        "_encoder_modules": list(encoders),
        "_vae_modules": [],
        "_resident_modules": resident or [],
    }
    if plan is not None:
        attrs["_offload_plan"] = plan
    pipe = type("Pipe", (), attrs)()
    for name, module in {**dits, **encoders}.items():
        setattr(pipe, name, module)
    return pipe


def stack_summary(plan: ResolvedOffloadPlan) -> list[tuple[str, int, int]]:
    return [(s.container_path, len(s.block_paths), s.num_resident) for s in plan.stacks]


# ----------------------------------------------------------------------------- paths and types
def test_get_by_path_walks_dots_and_module_lists() -> None:
    dit = DiT()
    assert get_by_path(dit, "") is dit
    assert get_by_path(dit, "blocks.1") is dit.blocks[1]
    assert get_by_path(dit, "blocks.1.proj") is dit.blocks[1].proj


def test_get_by_path_names_full_path_and_missing_part() -> None:
    with pytest.raises(AttributeError, match=r"'blocks\.9\.proj'.*'blocks'.*'9'"):
        get_by_path(DiT(), "blocks.9.proj")
    with pytest.raises(ValueError, match="empty segment"):
        get_by_path(DiT(), "blocks..0")
    with pytest.raises(TypeError, match="path"):
        get_by_path(DiT(), 3)  # type: ignore[arg-type]


def test_offload_plan_freezes_lists_and_validates_types() -> None:
    plan = OffloadPlan(
        block_attrs={"transformer": ["blocks", "other"]},
        encoder_block_attrs={"text_encoder": ["encoder.layers"]},
        on_demand_component_paths=["vae"],
        resident_dit_paths=frozenset({"b", "a"}),  # type: ignore[arg-type]
        encoder_dlo_weight_replication=["text_encoder"],
    )
    assert plan.block_attrs["transformer"] == ("blocks", "other")
    assert isinstance(plan.block_attrs, types.MappingProxyType)
    assert plan.on_demand_component_paths == ("vae",)
    assert plan.resident_dit_paths == ("a", "b")
    assert OffloadPlan().resident_dit_paths is None
    assert plan == OffloadPlan(
        block_attrs={"transformer": ("blocks", "other")},
        encoder_block_attrs={"text_encoder": ("encoder.layers",)},
        on_demand_component_paths=("vae",),
        resident_dit_paths=("a", "b"),
        encoder_dlo_weight_replication=("text_encoder",),
    )
    with pytest.raises(TypeError, match=r"block_attrs\['transformer'\]"):
        OffloadPlan(block_attrs={"transformer": "blocks"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="block_attrs must be a mapping"):
        OffloadPlan(block_attrs=["blocks"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="encoder_dlo_weight_replication"):
        OffloadPlan(encoder_dlo_weight_replication="text_encoder")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="resident_dit_paths"):
        OffloadPlan(resident_dit_paths=[1])  # type: ignore[list-item]


def test_block_stack_validates_and_splits_paths() -> None:
    stack = BlockStack(
        component="dit",
        component_path="t",
        container_path="t.blocks",
        block_paths=("t.blocks.0", "t.blocks.1", "t.blocks.2"),
        transfer="rank-local",
        num_resident=1,
        group_axis="local",
        group_size=1,
    )
    assert stack.resident_block_paths == ("t.blocks.0",)
    assert stack.streamed_block_paths == ("t.blocks.1", "t.blocks.2")
    with pytest.raises(ValueError, match="num_resident"):
        BlockStack(
            component="dit",
            component_path="t",
            container_path="t.blocks",
            block_paths=("t.blocks.0",),
            transfer="rank-local",
            num_resident=2,
            group_axis="local",
            group_size=1,
        )
    with pytest.raises(ValueError, match="component"):
        BlockStack(
            component="vae",
            component_path="t",
            container_path="t.blocks",
            block_paths=(),
            transfer="rank-local",
            num_resident=0,
            group_axis="local",
            group_size=1,
        )


def test_protocols_are_runtime_checkable() -> None:
    assert isinstance(DeclaredPipeline(), SupportsComponentDiscovery)
    assert not isinstance(object(), SupportsComponentDiscovery)

    class Split:
        def enable_model_offload(self, *, device: torch.device, pin_memory: bool) -> None:
            pass

        def disable_model_offload(self) -> None:
            pass

    assert isinstance(Split(), SupportsModelOffload)
    assert not isinstance(DiT(), SupportsModelOffload)


# ----------------------------------------------------------------------------- discovery
def test_declared_components_with_dotted_paths() -> None:
    pipe = DeclaredPipeline()
    plan = resolve_offload_plan(pipe, LAYER)
    assert plan.dits == ("pipe.transformer",)
    assert plan.encoders == ("pipe.text_encoder",)
    assert plan.vaes == ("pipe.vae",)
    assert plan.resident_modules == ("pipe.transformer.embed",)
    assert plan.warnings == ()
    (stack,) = plan.stacks
    assert stack.component == "dit"
    assert stack.component_path == "pipe.transformer"
    assert stack.container_path == "pipe.transformer.blocks"
    assert stack.block_paths == tuple(f"pipe.transformer.blocks.{i}" for i in range(4))
    for path in stack.block_paths:
        assert get_by_path(pipe, path) in list(pipe.pipe.transformer.blocks)
    assert (stack.transfer, stack.num_resident, stack.group_axis, stack.group_size) == (
        "rank-local",
        0,
        "local",
        1,
    )
    assert plan.all_block_paths == stack.block_paths
    assert plan.num_streamed_blocks == 4
    assert plan.num_resident_blocks == 0


def test_missing_declaration_lists_are_empty() -> None:
    class OnlyDits:
        _dit_modules: ClassVar[list[str]] = ["transformer"]

        def __init__(self) -> None:
            self.transformer = DiT()
            self.vae = Vae()  # not declared, not scanned

    plan = resolve_offload_plan(OnlyDits(), DIT_ONLY)
    assert (plan.dits, plan.encoders, plan.vaes) == (("transformer",), (), ())


def test_bare_model_declaring_blocks_is_a_pipeline_with_one_dit() -> None:
    plan = resolve_offload_plan(DiT(num_blocks=3), DIT_ONLY)
    assert plan.dits == ("",)
    (stack,) = plan.stacks
    assert stack.component_path == ""
    assert stack.container_path == "blocks"
    assert stack.block_paths == ("blocks.0", "blocks.1", "blocks.2")


def test_bare_model_declaring_blocks_through_its_offload_plan() -> None:
    model = UndeclaredDiT()
    model._offload_plan = OffloadPlan(block_attrs={"": ["blocks"]})
    plan = resolve_offload_plan(model, DIT_ONLY)
    assert plan.all_block_paths == ("blocks.0", "blocks.1")


def test_bare_model_with_resident_modules_keeps_itself_as_the_dit() -> None:
    class Model(DiT):
        _resident_modules: ClassVar[list[str]] = ["embed"]

    plan = resolve_offload_plan(Model(num_blocks=2), DIT_ONLY)
    assert plan.dits == ("",)
    assert plan.resident_modules == ("embed",)
    assert plan.all_block_paths == ("blocks.0", "blocks.1")


def _scan_message_count(caplog: pytest.LogCaptureFixture) -> int:
    return sum("falling back to a scan" in r.getMessage() for r in caplog.records)


def test_fallback_scan_warns_once_per_class(caplog: pytest.LogCaptureFixture) -> None:
    class LegacyPipeline:
        def __init__(self) -> None:
            self.transformer = DiT(num_blocks=2)
            self.model = self.transformer  # an alias: kept once
            self.text_encoder = Encoder()
            self.vae = Vae()
            self.audio_vae = None  # not a module: ignored
            self.dit = "not a module"

    class OtherLegacyPipeline(LegacyPipeline):
        pass

    caplog.set_level(logging.WARNING, logger="dlo.plan")
    plan = resolve_offload_plan(LegacyPipeline(), LAYER)
    assert (plan.dits, plan.encoders, plan.vaes) == (("transformer",), ("text_encoder",), ("vae",))
    assert plan.all_block_paths == ("transformer.blocks.0", "transformer.blocks.1")
    assert any("scanning well-known names" in w for w in plan.warnings)
    assert _scan_message_count(caplog) == 1
    scans = [r.getMessage() for r in caplog.records if "falling back to a scan" in r.getMessage()]
    assert scans and "LegacyPipeline" in scans[-1]

    again = resolve_offload_plan(LegacyPipeline(), LAYER)
    assert _scan_message_count(caplog) == 1
    assert again == plan

    resolve_offload_plan(OtherLegacyPipeline(), LAYER)
    assert _scan_message_count(caplog) == 2
    assert "OtherLegacyPipeline" in caplog.records[-1].getMessage()


def test_fallback_scan_finds_all_well_known_names() -> None:
    class Everything:
        pass

    pipe = Everything()
    for name in (
        "transformer",
        "transformer_2",
        "dit",
        "sr_dit",
        "language_model",
        "transformer_blocks",
        "model",
    ):
        setattr(pipe, name, DiT(num_blocks=1))
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder"):
        setattr(pipe, name, Encoder())
    pipe.vae, pipe.audio_vae = Vae(), Vae()
    plan = resolve_offload_plan(pipe, OffloadConfig(mode="module"))
    assert len(plan.dits) == 7 and len(plan.encoders) == 4
    assert plan.vaes == ("vae", "audio_vae")
    assert plan.stacks == ()


@pytest.mark.parametrize("bad", ["transformer", 3, ["transformer", 3]])
def test_malformed_declaration_is_a_type_error(bad: Any) -> None:
    cls = type("BadPipe", (), {"_dit_modules": bad})
    pipe = cls()
    pipe.transformer = DiT()
    with pytest.raises(TypeError, match=r"BadPipe\._dit_modules"):
        resolve_offload_plan(pipe, LAYER)


def test_offload_plan_attribute_must_be_an_offload_plan() -> None:
    pipe = make_pipeline({"transformer": DiT()})
    pipe._offload_plan = {"block_attrs": {}}
    with pytest.raises(TypeError, match=r"_offload_plan must be a dlo\.OffloadPlan"):
        resolve_offload_plan(pipe, LAYER)


@pytest.mark.parametrize("value", ["missing", "none"])
def test_missing_declared_path_explicit_errors_compat_skips(value: str) -> None:
    pipe = make_pipeline({"transformer": DiT(num_blocks=2)}, {"text_encoder": Encoder()})
    type(pipe)._encoder_modules = ["text_encoder", "text_encoder_2"]
    if value == "none":
        pipe.text_encoder_2 = None
    with pytest.raises(ValueError, match=r"'text_encoder_2' of Pipe"):
        resolve_offload_plan(pipe, DIT_ONLY)
    plan = resolve_offload_plan(pipe, LAYER)
    assert plan.encoders == ("text_encoder",)
    assert plan.all_block_paths == ("transformer.blocks.0", "transformer.blocks.1")
    assert len(plan.warnings) == 1 and "text_encoder_2" in plan.warnings[0]


def test_component_declared_twice_explicit_errors_compat_keeps_first() -> None:
    dit = DiT(num_blocks=2)
    pipe = make_pipeline({"transformer": dit}, {"text_encoder": dit})
    with pytest.raises(ValueError, match="same module"):
        resolve_offload_plan(pipe, DIT_ONLY)
    plan = resolve_offload_plan(pipe, LAYER)
    assert (plan.dits, plan.encoders) == (("transformer",), ())
    assert any("same module" in w for w in plan.warnings)


# ----------------------------------------------------------------------------- DiT blocks
def test_plan_block_attrs_take_precedence_over_class_attrs() -> None:
    plan_decl = OffloadPlan(block_attrs={"transformer": ["other"]})
    pipe = make_pipeline({"transformer": DiT()}, plan=plan_decl)
    plan = resolve_offload_plan(pipe, DIT_ONLY)
    assert plan.all_block_paths == ("transformer.other.0", "transformer.other.1")


def test_deprecated_singular_blocks_attr_warns() -> None:
    pipe = make_pipeline({"transformer": LegacyDiT()})
    with pytest.warns(
        FutureWarning,
        match=r"LegacyDiT\._layerwise_offload_blocks_attr .*"
        r"_layerwise_offload_blocks_attrs",
    ):
        plan = resolve_offload_plan(pipe, DIT_ONLY)
    assert plan.all_block_paths == tuple(f"transformer.layers.{i}" for i in range(3))


def test_deprecated_singular_blocks_attr_must_be_a_str() -> None:
    class Bad(UndeclaredDiT):
        _layerwise_offload_blocks_attr = ["blocks"]

    with pytest.raises(TypeError, match=r"Bad\._layerwise_offload_blocks_attr must be a str"):
        resolve_offload_plan(make_pipeline({"transformer": Bad()}), LAYER)


def test_plural_blocks_attrs_must_be_a_list() -> None:
    class Bad(UndeclaredDiT):
        _layerwise_offload_blocks_attrs = "blocks"

    with pytest.raises(TypeError, match=r"Bad\._layerwise_offload_blocks_attrs"):
        resolve_offload_plan(make_pipeline({"transformer": Bad()}), LAYER)


def test_multiple_containers_keep_declared_order() -> None:
    plan = resolve_offload_plan(make_pipeline({"transformer": TwoStackDiT(2, 3)}), DIT_ONLY)
    assert stack_summary(plan) == [
        ("transformer.double_blocks", 2, 0),
        ("transformer.single_blocks", 3, 0),
    ]
    assert plan.all_block_paths[1:3] == (
        "transformer.double_blocks.1",
        "transformer.single_blocks.0",
    )


def test_sequential_container_uses_child_names() -> None:
    class SeqDiT(nn.Module):
        _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["seq"]

        def __init__(self) -> None:
            super().__init__()
            self.seq = nn.Sequential()
            self.seq.add_module("first", Block())
            self.seq.add_module("second", Block())

    plan = resolve_offload_plan(make_pipeline({"dit": SeqDiT()}), DIT_ONLY)
    assert plan.all_block_paths == ("dit.seq.first", "dit.seq.second")


def test_two_dits_each_get_their_stacks() -> None:
    pipe = make_pipeline({"transformer": DiT(num_blocks=2), "transformer_2": TwoStackDiT(1, 1)})
    plan = resolve_offload_plan(pipe, OffloadConfig(mode="layer", resident_layers=1))
    assert stack_summary(plan) == [
        ("transformer.blocks", 2, 1),
        ("transformer_2.double_blocks", 1, 1),
        ("transformer_2.single_blocks", 1, 0),
    ]


def test_dit_without_block_declaration_explicit_errors_compat_skips() -> None:
    pipe = make_pipeline({"transformer": DiT(num_blocks=2), "aux": OpaqueDiT()})
    with pytest.raises(
        ValueError, match=r"dit 'aux' \(OpaqueDiT\) has no blocks dlo can find"
    ) as e:
        resolve_offload_plan(pipe, DIT_ONLY)
    # the message says what was looked for and offers a declaration that works as written
    message = str(e.value)
    for looked_for in ("OpaqueDiT._layerwise_offload_blocks_attrs", "_no_split_modules"):
        assert looked_for in message
    offered = "pipe._offload_plan = dlo.OffloadPlan(block_attrs={'aux': ['blocks']})"
    assert offered in message
    pipe._offload_plan = OffloadPlan(block_attrs={"aux": ["blocks"]})
    assert resolve_offload_plan(pipe, DIT_ONLY).all_block_paths[-1] == "aux.blocks.0"
    del pipe._offload_plan
    plan = resolve_offload_plan(pipe, LAYER)
    assert plan.dits == ("transformer", "aux")
    assert plan.all_block_paths == ("transformer.blocks.0", "transformer.blocks.1")
    assert len(plan.warnings) == 1 and "'aux'" in plan.warnings[0]


def test_undeclared_dit_streams_the_module_lists_found_by_structure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class StructureOnly(UndeclaredDiT):  # its own class: the warning is this test's alone
        pass

    caplog.set_level(logging.WARNING, logger="dlo.plan")
    for _ in range(2):
        plan = resolve_offload_plan(make_pipeline({"transformer": StructureOnly()}), DIT_ONLY)
        assert plan.all_block_paths == ("transformer.blocks.0", "transformer.blocks.1")
    told = [r.getMessage() for r in caplog.records if "found by structure" in r.getMessage()]
    assert len(told) == 1, told
    assert "StructureOnly._layerwise_offload_blocks_attrs = ['blocks']" in told[0]


def test_an_instance_declaration_is_honoured() -> None:
    dit = OpaqueDiT()
    dit._layerwise_offload_blocks_attrs = ["blocks"]
    plan = resolve_offload_plan(make_pipeline({"transformer": dit}), DIT_ONLY)
    assert plan.all_block_paths == ("transformer.blocks.0",)
    assert getattr(OpaqueDiT, "_layerwise_offload_blocks_attrs", None) is None


def test_a_module_list_is_never_a_component() -> None:
    """A bare model holding a ``transformer_blocks`` list is the DiT itself, not a pipeline
    whose DiT is the (never called) list; a declared list is a problem naming it."""

    class Bare(nn.Module):
        _no_split_modules: ClassVar[list[str]] = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.transformer_blocks = nn.ModuleList(Block() for _ in range(2))

    for mode in ("layer", "module"):
        plan = resolve_offload_plan(Bare(), OffloadConfig(mode=mode))
        assert plan.dits == ("",)
    assert resolve_offload_plan(Bare(), LAYER).all_block_paths == (
        "transformer_blocks.0",
        "transformer_blocks.1",
    )
    pipe = make_pipeline({"transformer": DiT()})
    pipe._dit_modules = ["transformer.blocks"]
    with pytest.raises(ValueError, match=r"'transformer.blocks' of Pipe is a ModuleList"):
        resolve_offload_plan(pipe, OffloadConfig(mode="module", components=("dit",)))


def test_container_that_does_not_resolve() -> None:
    plan_decl = OffloadPlan(block_attrs={"transformer": ["blocks", "nope"]})
    pipe = make_pipeline({"transformer": DiT(num_blocks=2)}, plan=plan_decl)
    with pytest.raises(ValueError, match="'nope' does not resolve"):
        resolve_offload_plan(pipe, DIT_ONLY)
    plan = resolve_offload_plan(pipe, LAYER)
    assert stack_summary(plan) == [("transformer.blocks", 2, 0)]


def test_container_that_is_not_a_module_list() -> None:
    plan_decl = OffloadPlan(block_attrs={"transformer": ["embed"]})
    pipe = make_pipeline({"transformer": DiT()}, plan=plan_decl)
    with pytest.raises(
        ValueError, match=r"must be an nn\.ModuleList or nn\.Sequential, got Linear"
    ):
        resolve_offload_plan(pipe, DIT_ONLY)


def test_empty_container_explicit_errors_compat_warns() -> None:
    pipe = make_pipeline({"transformer": DiT(num_blocks=0)})
    with pytest.raises(ValueError, match="'blocks' is empty"):
        resolve_offload_plan(pipe, DIT_ONLY)
    plan = resolve_offload_plan(pipe, LAYER)
    assert plan.stacks == ()
    assert any("is empty" in w for w in plan.warnings)
    assert any("no block to stream" in w for w in plan.warnings)


def test_module_list_given_as_a_block() -> None:
    dit = UndeclaredDiT()
    dit.nested = nn.ModuleList([nn.ModuleList([Block()]), Block()])
    plan_decl = OffloadPlan(block_attrs={"transformer": ["nested", "blocks"]})
    pipe = make_pipeline({"transformer": dit}, plan=plan_decl)
    with pytest.raises(ValueError, match=r"'transformer\.nested\.0' is a ModuleList"):
        resolve_offload_plan(pipe, DIT_ONLY)
    plan = resolve_offload_plan(pipe, LAYER)
    assert stack_summary(plan) == [("transformer.blocks", 2, 0)]
    assert any("ModuleList" in w for w in plan.warnings)


def test_block_attrs_key_that_is_not_a_dit() -> None:
    plan_decl = OffloadPlan(block_attrs={"transformer": ["blocks"], "ghost": ["blocks"]})
    pipe = make_pipeline({"transformer": DiT(num_blocks=1)}, plan=plan_decl)
    with pytest.raises(ValueError, match="'ghost' is not a discovered DiT"):
        resolve_offload_plan(pipe, DIT_ONLY)
    assert resolve_offload_plan(pipe, LAYER).all_block_paths == ("transformer.blocks.0",)


# ----------------------------------------------------------------------------- always errors
@pytest.mark.parametrize("cfg", [LAYER, DIT_ONLY])
def test_container_claimed_twice_is_an_error(cfg: OffloadConfig) -> None:
    dit = DiT(num_blocks=2)
    dit.alias = dit.blocks
    plan_decl = OffloadPlan(block_attrs={"transformer": ["blocks", "alias"]})
    pipe = make_pipeline({"transformer": dit}, plan=plan_decl)
    with pytest.raises(ValueError, match=r"'transformer\.alias\.0'.*'transformer\.blocks\.0'"):
        resolve_offload_plan(pipe, cfg)


@pytest.mark.parametrize("cfg", [LAYER, DIT_ONLY])
def test_block_claimed_by_two_dits_is_an_error(cfg: OffloadConfig) -> None:
    first, second = DiT(num_blocks=2), DiT(num_blocks=2)
    second.blocks[1] = first.blocks[0]
    pipe = make_pipeline({"transformer": first, "transformer_2": second})
    with pytest.raises(ValueError, match=r"'transformer_2\.blocks\.1'.*'transformer\.blocks\.0'"):
        resolve_offload_plan(pipe, cfg)


def test_block_listed_twice_in_one_container_is_an_error() -> None:
    dit = DiT(num_blocks=1)
    dit.blocks.append(dit.blocks[0])
    with pytest.raises(ValueError, match=r"'transformer\.blocks\.1'.*'transformer\.blocks\.0'"):
        resolve_offload_plan(make_pipeline({"transformer": dit}), LAYER)


@pytest.mark.parametrize("cfg", [LAYER, DIT_ONLY])
def test_nested_block_is_an_error(cfg: OffloadConfig) -> None:
    dit = DiT(num_blocks=2)
    dit.blocks[0].inner = nn.ModuleList([Block()])
    plan_decl = OffloadPlan(block_attrs={"transformer": ["blocks", "blocks.0.inner"]})
    pipe = make_pipeline({"transformer": dit}, plan=plan_decl)
    with pytest.raises(
        ValueError,
        match=r"'transformer\.blocks\.0\.inner\.0' is nested inside "
        r"block 'transformer\.blocks\.0'",
    ):
        resolve_offload_plan(pipe, cfg)


@pytest.mark.parametrize("cfg", [LAYER, DIT_ONLY])
@pytest.mark.parametrize(
    ("resident", "relation"),
    [
        ("transformer.blocks.1", "is the streamed block"),
        ("transformer.blocks.1.proj", "is inside the streamed block"),
        ("transformer", "contains the streamed block"),
    ],
)
def test_resident_module_overlapping_a_block_is_an_error(
    cfg: OffloadConfig, resident: str, relation: str
) -> None:
    pipe = make_pipeline({"transformer": DiT(num_blocks=2)}, resident=[resident])
    with pytest.raises(ValueError, match=f"resident module '{resident}' {relation}"):
        resolve_offload_plan(pipe, cfg)
    # outside layer mode nothing streams, so nothing overlaps
    resolve_offload_plan(pipe, OffloadConfig(mode="module"))


def test_resident_module_beside_blocks_is_fine() -> None:
    pipe = make_pipeline({"transformer": DiT(num_blocks=2)}, resident=["transformer.embed"])
    plan = resolve_offload_plan(pipe, DIT_ONLY)
    assert plan.resident_modules == ("transformer.embed",)


# ----------------------------------------------------------------------------- resident layers
def test_resident_layers_split_across_containers() -> None:
    pipe = make_pipeline({"transformer": TwoStackDiT(2, 5)})
    plan = resolve_offload_plan(pipe, OffloadConfig(mode="layer", resident_layers=3))
    assert stack_summary(plan) == [
        ("transformer.double_blocks", 2, 2),
        ("transformer.single_blocks", 5, 1),
    ]
    assert plan.num_resident_blocks == 3
    assert plan.num_streamed_blocks == 4
    assert plan.stacks[1].resident_block_paths == ("transformer.single_blocks.0",)


def test_resident_layers_from_layer_options() -> None:
    cfg = OffloadConfig(mode="layer", layer_options={"dit": {"resident_layers": 1}})
    plan = resolve_offload_plan(make_pipeline({"transformer": TwoStackDiT(2, 5)}), cfg)
    assert [s.num_resident for s in plan.stacks] == [1, 0]


@pytest.mark.parametrize("components", [None, ("dit",)])
def test_too_many_resident_layers_is_always_an_error(components: Any) -> None:
    pipe = make_pipeline({"transformer": TwoStackDiT(2, 5)})
    cfg = OffloadConfig(mode="layer", components=components, resident_layers=8)
    with pytest.raises(
        ValueError,
        match=r"resident_layers=8 exceeds the 7 blocks of DiT "
        r"'transformer'",
    ):
        resolve_offload_plan(pipe, cfg)
    all_resident = resolve_offload_plan(pipe, cfg.replace(resident_layers=7))
    assert all_resident.num_resident_blocks == 7 and all_resident.num_streamed_blocks == 0


def test_resident_dit_paths_limit_which_dits_keep_blocks() -> None:
    plan_decl = OffloadPlan(resident_dit_paths=["transformer"])
    pipe = make_pipeline(
        {"transformer": DiT(num_blocks=3), "transformer_2": DiT(num_blocks=1)}, plan=plan_decl
    )
    compat = resolve_offload_plan(pipe, OffloadConfig(mode="layer", resident_layers=2))
    assert stack_summary(compat) == [("transformer.blocks", 3, 2), ("transformer_2.blocks", 1, 0)]
    assert len(compat.warnings) == 1 and "resident_dit_paths" in compat.warnings[0]
    explicit = OffloadConfig(mode="layer", components=("dit",), resident_layers=2)
    with pytest.raises(ValueError, match=r"'transformer_2' is not in OffloadPlan\.resident_dit_"):
        resolve_offload_plan(pipe, explicit)
    none_resident = resolve_offload_plan(pipe, explicit.replace(resident_layers=0))
    assert none_resident.warnings == ()


def test_resident_dit_paths_entry_that_is_not_a_dit() -> None:
    plan_decl = OffloadPlan(resident_dit_paths=["ghost"])
    pipe = make_pipeline({"transformer": DiT(num_blocks=1)}, plan=plan_decl)
    with pytest.raises(ValueError, match="'ghost' is not a discovered DiT"):
        resolve_offload_plan(pipe, DIT_ONLY)


def test_resident_layers_without_dit_selected_is_an_error() -> None:
    plan_decl = OffloadPlan(encoder_block_attrs={"text_encoder": ["encoder.layers"]})
    pipe = make_pipeline({"transformer": DiT()}, {"text_encoder": Encoder()}, plan=plan_decl)
    with pytest.raises(ValueError, match="does not select 'dit'"):
        cfg = OffloadConfig(mode="layer", components=("encoder",), resident_layers=1)
        resolve_offload_plan(pipe, cfg)


# ----------------------------------------------------------------------------- encoders
def encoder_pipeline(replicated: bool, on_demand: bool = False) -> Any:
    plan_decl = OffloadPlan(
        encoder_block_attrs={"text_encoder": ["encoder.layers"]},
        encoder_dlo_weight_replication=["text_encoder"] if replicated else [],
        on_demand_component_paths=["text_encoder"] if on_demand else [],
    )
    return make_pipeline(
        {"transformer": DiT(num_blocks=2)}, {"text_encoder": Encoder()}, plan=plan_decl
    )


def test_encoder_stack_after_dit_stacks() -> None:
    plan = resolve_offload_plan(
        encoder_pipeline(replicated=False),
        OffloadConfig(mode="layer", components=("dit", "encoder")),
    )
    assert [s.component for s in plan.stacks] == ["dit", "encoder"]
    enc = plan.stacks[1]
    assert enc.component_path == "text_encoder"
    assert enc.container_path == "text_encoder.encoder.layers"
    assert enc.block_paths[0] == "text_encoder.encoder.layers.0"
    assert (enc.transfer, enc.group_axis, enc.group_size, enc.num_resident) == (
        "rank-local",
        "local",
        1,
        0,
    )


@pytest.mark.parametrize("transfer", ["allgather", "auto"])
def test_replicated_encoder_may_allgather(transfer: str) -> None:
    cfg = OffloadConfig(mode="layer", components=("encoder",), transfer=transfer)
    plan = resolve_offload_plan(
        encoder_pipeline(replicated=True), cfg, ParallelConfig(data_parallel_size=4)
    )
    (enc,) = plan.stacks
    assert (enc.transfer, enc.group_axis, enc.group_size) == (transfer, "data", 4)


def test_unreplicated_encoder_allgather_explicit_errors_compat_falls_back() -> None:
    par = ParallelConfig(data_parallel_size=2)
    explicit = OffloadConfig(mode="layer", components=("dit", "encoder"), transfer="allgather")
    with pytest.raises(ValueError, match="encoder_dlo_weight_replication"):
        resolve_offload_plan(encoder_pipeline(replicated=False), explicit, par)
    compat = OffloadConfig(mode="layer", transfer="allgather")
    plan = resolve_offload_plan(encoder_pipeline(replicated=False), compat, par)
    dit, enc = plan.stacks
    assert (dit.transfer, dit.group_axis, dit.group_size) == ("allgather", "data", 2)
    assert (enc.transfer, enc.group_axis, enc.group_size) == ("rank-local", "local", 1)
    assert len(plan.warnings) == 1 and "'text_encoder'" in plan.warnings[0]


def test_encoder_layer_option_overrides_transfer() -> None:
    cfg = OffloadConfig(
        mode="layer",
        components=("dit", "encoder"),
        transfer="allgather",
        layer_options={"encoder": {"weight_transfer": "rank-local"}},
    )
    plan = resolve_offload_plan(
        encoder_pipeline(replicated=False), cfg, ParallelConfig(data_parallel_size=2)
    )
    assert [(s.transfer, s.group_size) for s in plan.stacks] == [
        ("allgather", 2),
        ("rank-local", 1),
    ]


def test_encoder_selected_without_any_stack() -> None:
    pipe = make_pipeline({"transformer": DiT(num_blocks=2)}, {"text_encoder": Encoder()})
    with pytest.raises(ValueError, match="no encoder of Pipe has a block stack"):
        resolve_offload_plan(pipe, OffloadConfig(mode="layer", components=("dit", "encoder")))
    plan = resolve_offload_plan(pipe, LAYER)  # compat: encoders without stacks stay, silently
    assert [s.component for s in plan.stacks] == ["dit"]
    assert plan.warnings == ()


def test_encoder_not_selected_does_not_stream() -> None:
    plan = resolve_offload_plan(encoder_pipeline(replicated=True), DIT_ONLY)
    assert [s.component for s in plan.stacks] == ["dit"]


def test_encoder_block_attrs_key_that_is_not_an_encoder() -> None:
    plan_decl = OffloadPlan(encoder_block_attrs={"ghost": ["layers"]})
    pipe = make_pipeline({"transformer": DiT(num_blocks=1)}, plan=plan_decl)
    with pytest.raises(ValueError, match="'ghost' is not a discovered encoder"):
        resolve_offload_plan(pipe, OffloadConfig(mode="layer", components=("dit", "encoder")))
    plan = resolve_offload_plan(pipe, LAYER)
    assert any("'ghost'" in w for w in plan.warnings)


def test_on_demand_component_is_reported_and_never_streamed() -> None:
    pipe = encoder_pipeline(replicated=False, on_demand=True)
    with pytest.raises(ValueError, match="on-demand"):
        resolve_offload_plan(pipe, OffloadConfig(mode="layer", components=("dit", "encoder")))
    plan = resolve_offload_plan(pipe, LAYER)
    assert plan.on_demand == ("text_encoder",)
    assert [s.component for s in plan.stacks] == ["dit"]
    assert any("on-demand" in w for w in plan.warnings)
    assert resolve_offload_plan(pipe, OffloadConfig(mode="module")).on_demand == ("text_encoder",)


# ----------------------------------------------------------------------------- nothing to stream
def test_nothing_to_stream() -> None:
    pipe = make_pipeline({})
    with pytest.raises(ValueError, match="selects 'dit' but Pipe has no DiT"):
        resolve_offload_plan(pipe, DIT_ONLY)
    plan = resolve_offload_plan(pipe, LAYER)
    assert plan.stacks == ()
    assert any("no block to stream" in w for w in plan.warnings)


def test_module_and_none_modes_discover_without_stacks() -> None:
    pipe = DeclaredPipeline()
    module = resolve_offload_plan(pipe, OffloadConfig(mode="module"))
    assert (module.mode, module.stacks, module.dits) == ("module", (), ("pipe.transformer",))
    assert module.num_streamed_blocks == 0 and module.all_block_paths == ()
    broken = make_pipeline({"transformer": UndeclaredDiT()})
    type(broken)._dit_modules = ["transformer", "missing"]
    none = resolve_offload_plan(broken, OffloadConfig(mode="none", components=("dit",)))
    assert (none.mode, none.explicit, none.stacks, none.dits) == (
        "none",
        True,
        (),
        ("transformer",),
    )


# ----------------------------------------------------------------------------- parallel
@pytest.mark.parametrize(
    ("par", "transfer", "group"),
    [
        (None, "allgather", ("local", 1)),
        (ParallelConfig(data_parallel_size=4), "allgather", ("data", 4)),
        (ParallelConfig(data_parallel_size=4), "rank-local", ("local", 1)),
        (ParallelConfig(data_parallel_size=4), "auto", ("data", 4)),
        (
            ParallelConfig(data_parallel_size=4, hsdp_replicate_size=2, hsdp_shard_size=2),
            "allgather",
            ("shard", 2),
        ),
        (ParallelConfig(sequence_parallel_size=2), "allgather", ("sequence", 2)),
        (ParallelConfig(tensor_parallel_size=2), "allgather", ("local", 1)),
        (ParallelConfig(data_parallel_size=2, sequence_parallel_size=3), "allgather", ("data", 2)),
    ],
)
def test_weight_groups_follow_the_parallel_config(
    par: ParallelConfig | None, transfer: str, group: tuple[str, int]
) -> None:
    cfg = OffloadConfig(mode="layer", transfer=transfer)
    plan = resolve_offload_plan(make_pipeline({"transformer": TwoStackDiT()}), cfg, par)
    for stack in plan.stacks:
        assert (stack.transfer, (stack.group_axis, stack.group_size)) == (transfer, group)


def test_weight_axis_override() -> None:
    cfg = OffloadConfig(mode="layer", transfer="allgather", weight_axis="sequence")
    par = ParallelConfig(data_parallel_size=2, sequence_parallel_size=2)
    plan = resolve_offload_plan(make_pipeline({"transformer": DiT()}), cfg, par)
    assert (plan.stacks[0].group_axis, plan.stacks[0].group_size) == ("sequence", 2)


# ----------------------------------------------------------------------------- purity
def module_snapshot(root: Any) -> list[Any]:
    """Identity of every module, parameter and buffer, and every module's attribute names."""
    out: list[Any] = []
    for m in root.modules():
        out.append(
            (
                id(m),
                sorted(m.__dict__),
                sorted(m._parameters),
                sorted(m._buffers),
                sorted(m._modules),
                len(m._forward_hooks),
                len(m._forward_pre_hooks),
            )
        )
        out += [(n, id(p), p.device) for n, p in m.named_parameters(recurse=False)]
        out += [(n, id(b), b.device) for n, b in m.named_buffers(recurse=False)]
    return out


class CountTorchCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


class CountDispatch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def full_pipeline() -> DeclaredPipeline:
    return DeclaredPipeline(
        OffloadPlan(
            encoder_block_attrs={"pipe.text_encoder": ["encoder.layers"]},
            encoder_dlo_weight_replication=["pipe.text_encoder"],
        )
    )


FULL_CFG = OffloadConfig(
    mode="layer", components=("dit", "encoder"), transfer="allgather", resident_layers=1
)
FULL_PAR = ParallelConfig(data_parallel_size=2)


def test_resolver_is_pure_and_deterministic() -> None:
    pipe = full_pipeline()
    before = module_snapshot(pipe.pipe)
    pipe_dict = dict(vars(pipe))
    first = resolve_offload_plan(pipe, FULL_CFG, FULL_PAR)
    second = resolve_offload_plan(pipe, FULL_CFG, FULL_PAR)
    assert first == second
    assert module_snapshot(pipe.pipe) == before
    assert vars(pipe) == pipe_dict
    assert first.num_resident_blocks == 1
    assert first.num_streamed_blocks == 3 + 3


def test_meta_device_models_resolve_identically_without_touching_tensors() -> None:
    cpu_plan = resolve_offload_plan(full_pipeline(), FULL_CFG, FULL_PAR)
    with torch.device("meta"):
        meta_pipe = full_pipeline()
    assert next(meta_pipe.pipe.parameters()).is_meta
    before = module_snapshot(meta_pipe.pipe)
    with CountTorchCalls() as fn_calls, CountDispatch() as op_calls:
        meta_plan = resolve_offload_plan(meta_pipe, FULL_CFG, FULL_PAR)
    assert meta_plan == cpu_plan
    assert fn_calls.calls == [] and op_calls.calls == []
    assert module_snapshot(meta_pipe.pipe) == before


def test_resolve_with_none_parallel_equals_default_parallel() -> None:
    pipe = make_pipeline({"transformer": DiT()})
    assert resolve_offload_plan(pipe, LAYER) == resolve_offload_plan(pipe, LAYER, ParallelConfig())


def test_an_encoder_without_blocks_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    class UnstreamedEncoder(Encoder):  # its own class: the message is this test's alone
        pass

    class Pipe:
        _dit_modules = ["transformer"]
        _encoder_modules = ["text_encoder"]
        _vae_modules: list[str] = []

        def __init__(self) -> None:
            self.transformer = DiT(num_blocks=2)
            self.text_encoder = UnstreamedEncoder()

    caplog.set_level(logging.WARNING, logger="dlo.plan")
    for _ in range(2):
        plan = resolve_offload_plan(Pipe(), LAYER)
        assert plan.encoders == ("text_encoder",)
    told = [r.getMessage() for r in caplog.records if "no blocks dlo can find" in r.getMessage()]
    assert len(told) == 1 and "'text_encoder' (UnstreamedEncoder)" in told[0], told
    assert "encoder_block_attrs={'text_encoder': ['encoder.layers']}" in told[0]


def test_every_unstreamed_component_is_placed_but_on_demand_ones() -> None:
    """The layerwise contract: encoders, VAEs and non-block modules are device resident
    unless streamed or pipeline-managed (``on_demand_component_paths``)."""
    from dlo.plan.checks import non_block_state

    pipe = make_pipeline({"transformer": DiT(num_blocks=2)}, {"text_encoder": Encoder()})
    pipe.vae = Vae()
    pipe._vae_modules = ["vae"]
    plan = resolve_offload_plan(pipe, DIT_ONLY)
    block_ids = {id(t) for p in plan.all_block_paths for t in get_by_path(pipe, p).parameters()}
    placed = {id(t) for _, t in non_block_state(pipe, plan, block_ids)}
    for module in (pipe.text_encoder, pipe.vae, pipe.transformer.embed):
        assert all(id(t) in placed for t in module.parameters())
    assert not placed & block_ids
    pipe._offload_plan = OffloadPlan(on_demand_component_paths=["vae"])
    plan = resolve_offload_plan(pipe, DIT_ONLY)
    placed = {id(t) for _, t in non_block_state(pipe, plan, block_ids)}
    assert not any(id(t) in placed for t in pipe.vae.parameters())
    assert all(id(t) in placed for t in pipe.text_encoder.parameters())


def test_the_offered_declaration_names_the_block_list_not_an_embedder() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.time_embed = nn.Sequential(nn.Linear(4, 4), nn.SiLU(), nn.Linear(4, 4))
            self.blocks = nn.ModuleList([Block()])

    with pytest.raises(ValueError, match="has no blocks dlo can find") as e:
        resolve_offload_plan(make_pipeline({"transformer": Model()}), DIT_ONLY)
    assert (
        "e.g. pipe._offload_plan = dlo.OffloadPlan(block_attrs={'transformer': ['blocks']})"
        in str(e.value)
    )


def test_tied_blocks_are_not_a_stack() -> None:
    """A ModuleList holding one module several times (ALBERT-style) or a block already in
    another list is never found as a stack: one module cannot be two blocks."""

    class Tied(nn.Module):
        _repeated_blocks: ClassVar[list[str]] = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            shared = Block()
            self.blocks = nn.ModuleList([shared] * 3)
            self.more = nn.ModuleList([Block(), Block()])
            self.again = nn.ModuleList([self.more[0], Block()])

    plan = resolve_offload_plan(make_pipeline({"transformer": Tied()}), LAYER)
    assert plan.all_block_paths == ("transformer.more.0", "transformer.more.1")
