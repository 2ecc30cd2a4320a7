"""Pure tests of dlo.config: every validation rule, the legacy flags, the derived strategy and
the weight-collective group. No process group, no device, no tensor."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

import dlo
from dlo.config.fields import COMPONENTS, MODES, PIN_FAILURE_POLICIES, TRANSFERS, WEIGHT_AXES
from dlo.config.offload import LEGACY_FLAG_DEFAULTS, LayerOptions, OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.config.unset import codec_by_measurement, for_device, unset_fields


@contextlib.contextmanager
def _raises(exc: type[Exception], *needles: object) -> Iterator[None]:
    """``pytest.raises`` whose message must contain every needle (a ``str``, else its repr)."""
    with pytest.raises(exc) as info:
        yield
    msg = str(info.value)
    for n in needles:
        text = n if isinstance(n, str) else repr(n)
        assert text in msg, f"{text!r} not in {msg!r}"


# ----------------------------------------------------------------------------- public names
def test_public_names() -> None:
    assert dlo.OffloadConfig is OffloadConfig
    assert dlo.ParallelConfig is ParallelConfig
    assert dlo.LayerOptions is LayerOptions


# ----------------------------------------------------------------------------- dataclass shape
CLASSES = (OffloadConfig, ParallelConfig, LayerOptions)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls: type) -> None:
    from tests.reference_tables import field_docs  # the reading the reference tables use

    documented = {k: v for k, v in field_docs(cls).items() if v.strip()}
    fields = {f.name for f in dataclasses.fields(cls)}
    assert not fields - set(documented), (
        f"{cls.__name__}: no docstring for {fields - set(documented)}"
    )
    assert set(documented) == fields
    assert cls.__doc__ and cls.__doc__.strip()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_frozen(cls: type) -> None:
    obj = cls()
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, getattr(obj, name))


@pytest.mark.parametrize(
    "cls, arg", [(OffloadConfig, "layer"), (ParallelConfig, 2), (LayerOptions, "allgather")]
)
def test_keyword_only(cls: type, arg: Any) -> None:
    with pytest.raises(TypeError):
        cls(arg)
    assert all(f.kw_only for f in dataclasses.fields(cls))


def test_defaults() -> None:
    cfg = OffloadConfig()
    assert cfg.mode == "layer" and cfg.strategy == "layer" and cfg.enabled
    assert cfg.components is None
    assert cfg.transfer == "rank-local"
    assert (cfg.resident_layers, cfg.num_slots) == (None, None)  # unset: decided per device
    assert dict(cfg.layer_options) == {}
    assert cfg.pin_memory is True
    assert cfg.chunk_mb == 64
    assert cfg.pin_budget_gb is None
    assert cfg.pin_failure_policy == "fail"
    assert cfg.weight_axis == "auto"
    assert cfg.collective_timeout_s == 300.0
    assert cfg.verify_block_sequence is True
    par = ParallelConfig()
    assert par.world_size == 1 and not par.use_hsdp


def test_equal_configs_compare_equal() -> None:
    a = OffloadConfig(mode="layer", layer_options={"dit": {"weight_transfer": "allgather"}})
    b = OffloadConfig(
        mode="layer", layer_options={"dit": LayerOptions(weight_transfer="allgather")}
    )
    assert a == b
    assert a != b.replace(num_slots=3)


# ----------------------------------------------------------------------------- OffloadConfig fields
def test_choices_are_accepted() -> None:
    for mode in MODES:
        assert OffloadConfig(mode=mode).strategy == mode
        assert OffloadConfig(mode=mode).enabled == (mode != "none")
    for transfer in TRANSFERS:
        assert OffloadConfig(transfer=transfer).transfer == transfer
    for policy in PIN_FAILURE_POLICIES:
        assert OffloadConfig(pin_failure_policy=policy).pin_failure_policy == policy
    for axis in WEIGHT_AXES:
        assert OffloadConfig(weight_axis=axis).weight_axis == axis
    for n in range(1, len(COMPONENTS) + 1):
        for combo in itertools.permutations(COMPONENTS, n):
            assert OffloadConfig(components=combo).components == combo


BAD_OFFLOAD_FIELDS = [
    # (field, value, exception)
    ("mode", "bogus", ValueError),
    ("mode", "layerwise", ValueError),
    ("mode", "Layer", ValueError),
    ("mode", None, TypeError),
    ("mode", 1, TypeError),
    ("block_compute_ms", 0, ValueError),
    ("block_compute_ms", float("nan"), ValueError),
    ("block_compute_ms", "5", TypeError),
    ("transfer", "nccl", ValueError),
    ("transfer", "all_gather", ValueError),
    ("transfer", None, TypeError),
    ("transfer", True, TypeError),
    ("resident_layers", -1, ValueError),
    ("resident_layers", True, TypeError),
    ("resident_layers", False, TypeError),
    ("resident_layers", 1.0, TypeError),
    ("resident_layers", "2", TypeError),
    ("pin_memory", 1, TypeError),
    ("pin_memory", 0, TypeError),
    ("pin_memory", "yes", TypeError),
    ("pin_memory", None, TypeError),
    ("num_slots", 0, ValueError),
    ("num_slots", -2, ValueError),
    ("num_slots", True, TypeError),
    ("num_slots", 2.0, TypeError),
    ("num_slots", "2", TypeError),
    ("chunk_mb", 0, ValueError),
    ("chunk_mb", -64, ValueError),
    ("chunk_mb", False, TypeError),
    ("chunk_mb", 64.0, TypeError),
    ("chunk_mb", None, TypeError),
    ("pin_budget_gb", 0, ValueError),
    ("pin_budget_gb", -1.5, ValueError),
    ("pin_budget_gb", math.inf, ValueError),
    ("pin_budget_gb", math.nan, ValueError),
    ("pin_budget_gb", True, TypeError),
    ("pin_budget_gb", "8", TypeError),
    ("pin_failure_policy", "fallback", ValueError),
    ("pin_failure_policy", None, TypeError),
    ("weight_axis", "tensor", ValueError),
    ("weight_axis", "tp", ValueError),
    ("weight_axis", "replicate", ValueError),
    ("weight_axis", None, TypeError),
    ("collective_timeout_s", 0, ValueError),
    ("collective_timeout_s", -1.0, ValueError),
    ("collective_timeout_s", math.inf, ValueError),
    ("collective_timeout_s", math.nan, ValueError),
    ("collective_timeout_s", None, TypeError),
    ("collective_timeout_s", False, TypeError),
    ("verify_block_sequence", 1, TypeError),
    ("verify_block_sequence", None, TypeError),
]


@pytest.mark.parametrize("name, value, exc", BAD_OFFLOAD_FIELDS)
def test_bad_offload_field_names_field_and_value(name: str, value: Any, exc: type) -> None:
    with _raises(exc, name, value):
        OffloadConfig(**{name: value})


@pytest.mark.parametrize("name", ["device_budget_gb", "pin_budget_gb", "collective_timeout_s"])
def test_an_int_too_large_for_a_float_is_a_value_error_naming_the_field(name: str) -> None:
    # math.isfinite(10**400) raises OverflowError
    with _raises(ValueError, f"{name} must be a finite number > 0", "(too large)"):
        OffloadConfig(**{name: 10**400})


@pytest.mark.parametrize("name, value, exc", BAD_OFFLOAD_FIELDS)
def test_replace_revalidates(name: str, value: Any, exc: type) -> None:
    cfg = OffloadConfig(mode="layer")
    with _raises(exc, name, value):
        cfg.replace(**{name: value})


def test_replace_returns_a_validated_copy() -> None:
    cfg = OffloadConfig(mode="layer", layer_options={"dit": {"resident_layers": 2}})
    new = cfg.replace(transfer="allgather", components=["dit"])
    assert new is not cfg and new.transfer == "allgather" and new.components == ("dit",)
    assert new.layer_options["dit"] == LayerOptions(resident_layers=2)
    assert cfg.transfer == "rank-local"
    with _raises(ValueError, "layer_options['dit']", "('encoder',)"):
        cfg.replace(components=("encoder",))
    with _raises(ValueError, "layer_options"):
        cfg.replace(mode="module")
    with pytest.raises(TypeError):
        cfg.replace(no_such_field=1)


@pytest.mark.parametrize("value", [0, 1, 7, 1023])
def test_int_fields_accept_valid(value: int) -> None:
    cfg = OffloadConfig(resident_layers=value, num_slots=value + 1, chunk_mb=value + 1)
    assert (cfg.resident_layers, cfg.num_slots, cfg.chunk_mb) == (value, value + 1, value + 1)
    assert OffloadConfig(resident_layers=10**6).resident_layers == 10**6  # no bound of its own


@pytest.mark.parametrize("value", [1, 0.5, 1e-3, 512])
def test_positive_numbers_accept_int_and_float(value: float) -> None:
    cfg = OffloadConfig(pin_budget_gb=value, collective_timeout_s=value)
    assert cfg.pin_budget_gb == value and cfg.collective_timeout_s == value


# ----------------------------------------------------------------------------- components
def test_components_list_becomes_tuple() -> None:
    cfg = OffloadConfig(components=["dit", "encoder"])
    assert cfg.components == ("dit", "encoder") and isinstance(cfg.components, tuple)


@pytest.mark.parametrize(
    "value, exc, needles",
    [
        ("dit", TypeError, ("components", "'dit'")),
        ({"dit"}, TypeError, ("components", "{'dit'}")),
        ({"dit": 1}, TypeError, ("components",)),
        (3, TypeError, ("components", "3")),
        (("unet",), ValueError, ("components", "'unet'")),
        (("dit", "text-encoder"), ValueError, ("components", "'text-encoder'")),
        (("dit", "text_encoder", "encoder"), ValueError, ("components", "duplicates")),
        (("dit", 1), TypeError, ("components", "1")),
        (("dit", "dit"), ValueError, ("components", "('dit', 'dit')", "duplicates")),
        ((), ValueError, ("components", "()")),
        ([], ValueError, ("components",)),
    ],
)
def test_bad_components(value: Any, exc: type, needles: tuple[str, ...]) -> None:
    with _raises(exc, *needles):
        OffloadConfig(components=value)


# ----------------------------------------------------------------------------- layer options
def test_layer_options_from_nested_dicts() -> None:
    cfg = OffloadConfig(
        layer_options={
            "dit": {"weight_transfer": "allgather", "resident_layers": 3},
            "encoder": {"weight_transfer": "rank-local"},
        }
    )
    assert cfg.layer_options["dit"] == LayerOptions(weight_transfer="allgather", resident_layers=3)
    assert cfg.layer_options["encoder"] == LayerOptions(weight_transfer="rank-local")
    with pytest.raises(TypeError):
        cfg.layer_options["dit"] = LayerOptions()  # type: ignore[index]


def test_layer_options_are_a_read_only_copy() -> None:
    source: dict[str, Any] = {"dit": {"weight_transfer": "allgather"}}
    cfg = OffloadConfig(layer_options=source)
    source["encoder"] = {"weight_transfer": "allgather"}
    assert set(cfg.layer_options) == {"dit"}


@pytest.mark.parametrize(
    "layer_options, exc, needles",
    [
        (None, TypeError, ("layer_options", "None")),
        ([("dit", {})], TypeError, ("layer_options",)),
        ({"vae": {}}, ValueError, ("layer_options key", "'vae'")),
        ({1: {}}, TypeError, ("layer_options key", "1")),
        ({"dit": "allgather"}, TypeError, ("layer_options['dit']", "'allgather'")),
        ({"dit": None}, TypeError, ("layer_options['dit']", "None")),
        ({"dit": {"transfer": "allgather"}}, ValueError, ("layer_options['dit']", "transfer")),
        ({"dit": {"resident": 1}}, ValueError, ("layer_options['dit']", "resident")),
        (
            {"dit": {"weight_transfer": "nccl"}},
            ValueError,
            ("layer_options['dit']", "weight_transfer", "'nccl'"),
        ),
        (
            {"dit": {"weight_transfer": 1}},
            TypeError,
            ("layer_options['dit']", "weight_transfer", "1"),
        ),
        (
            {"dit": {"resident_layers": -1}},
            ValueError,
            ("layer_options['dit']", "resident_layers", "-1"),
        ),
        (
            {"dit": {"resident_layers": True}},
            TypeError,
            ("layer_options['dit']", "resident_layers", "True"),
        ),
        (
            {"dit": {"resident_layers": 1.0}},
            TypeError,
            ("layer_options['dit']", "resident_layers", "1.0"),
        ),
        (
            {"encoder": {"resident_layers": 1}},
            ValueError,
            ("layer_options['encoder'].resident_layers=1", "DiT"),
        ),
    ],
)
def test_bad_layer_options(layer_options: Any, exc: type, needles: tuple[str, ...]) -> None:
    with _raises(exc, *needles):
        OffloadConfig(layer_options=layer_options)


@pytest.mark.parametrize(
    "kwargs, exc, needles",
    [
        ({"weight_transfer": "nccl"}, ValueError, ("weight_transfer", "'nccl'")),
        ({"weight_transfer": 3}, TypeError, ("weight_transfer", "3")),
        ({"resident_layers": -2}, ValueError, ("resident_layers", "-2")),
        ({"resident_layers": False}, TypeError, ("resident_layers", "False")),
    ],
)
def test_bad_layer_options_direct(kwargs: dict[str, Any], exc: type, needles: Any) -> None:
    with _raises(exc, *needles):
        LayerOptions(**kwargs)


def test_layer_options_encoder_zero_resident_is_fine() -> None:
    cfg = OffloadConfig(layer_options={"encoder": {"resident_layers": 0}})
    assert cfg.resident_layers_for("encoder") == 0


def test_layer_options_from_dict_passes_instances_through() -> None:
    opts = LayerOptions(weight_transfer="allgather")
    assert LayerOptions.from_dict("dit", opts) is opts


def test_layer_options_refused_with_mode_module() -> None:
    with _raises(ValueError, "layer_options", "'module'"):
        OffloadConfig(mode="module", layer_options={"dit": {"weight_transfer": "allgather"}})


def test_mode_none_ignores_layer_settings_so_a_config_can_be_switched_off() -> None:
    cfg = OffloadConfig(
        mode="layer", resident_layers=2, layer_options={"dit": {"weight_transfer": "allgather"}}
    )
    off = cfg.replace(mode="none")
    assert not off.enabled and off.transfer_for("dit") == "allgather"


def test_config_is_hashable() -> None:
    cfg = OffloadConfig(layer_options={"dit": {"weight_transfer": "allgather"}})
    assert hash(cfg) == hash(OffloadConfig(layer_options={"dit": {"weight_transfer": "allgather"}}))


def test_legacy_dlo_flag_conflicts_with_a_rank_local_compact_transfer() -> None:
    # both amount to distributed layerwise; the transfers differ, and the message says so
    # (it used to say "selects 'distributed_layerwise' but ... selects 'distributed_layerwise'")
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_dict(
            {"mode": "layer", "resident_layers": 2, "enable_distributed_layerwise_offload": True}
        )
    msg = str(info.value)
    assert "enable_distributed_layerwise_offload=True" in msg
    assert "has transfer='rank-local'" in msg and "selects transfer='allgather'" in msg
    assert "selects 'distributed_layerwise'" not in msg


def test_legacy_dlo_flag_with_compact_transfer_auto_names_both_transfers() -> None:
    with _raises(ValueError, "has transfer='auto'", "selects transfer='allgather'"):
        OffloadConfig.from_dict(
            {"mode": "layer", "transfer": "auto", "enable_distributed_layerwise_offload": True}
        )


def test_layer_options_must_be_selected_by_components() -> None:
    with _raises(ValueError, "layer_options['encoder']", "('dit',)"):
        OffloadConfig(components=("dit",), layer_options={"encoder": {}})
    cfg = OffloadConfig(components=("dit", "encoder"), layer_options={"encoder": {}})
    assert cfg.layer_options["encoder"] == LayerOptions()


# ----------------------------------------------------------------------------- cross-field rules
@pytest.mark.parametrize(
    "name, value",
    [
        ("transfer", "allgather"),
        ("transfer", "auto"),
        ("resident_layers", 1),
        ("weight_axis", "data"),
        ("weight_axis", "local"),
        ("block_compute_ms", 5.0),
        ("transfer", "node-shared"),
        ("codec", "ans"),
        ("codec", "auto"),
    ],
)
def test_mode_module_refuses_layer_only_fields(name: str, value: Any) -> None:
    with _raises(ValueError, name, repr(value), "module"):
        OffloadConfig(mode="module", **{name: value})


def test_mode_module_accepts_shared_fields() -> None:
    cfg = OffloadConfig(mode="module", pin_memory=False, collective_timeout_s=5.0)
    assert cfg.strategy == "module" and cfg.pin_memory is False


def test_mode_module_accepts_the_layer_fields_unset_or_at_their_old_defaults() -> None:
    """The fields unset by default ([Note: automatic by default]) may also be given at the
    value they had before, which a module swap ignores as it did then."""
    assert OffloadConfig(mode="module").codec is None
    old = OffloadConfig(mode="module", resident_layers=0, num_slots=2, codec="none")
    assert (old.resident_layers, old.num_slots, old.codec) == (0, 2, "none")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"components": ("encoder",), "resident_layers": 2},
        {
            "components": ("encoder",),
            "transfer": "allgather",
            "resident_layers": 1,
        },
    ],
)
def test_resident_layers_need_dit_component(kwargs: dict[str, Any]) -> None:
    with _raises(ValueError, f"resident_layers={kwargs['resident_layers']}", "('encoder',)"):
        OffloadConfig(**kwargs)


def test_resident_layers_with_dit_component() -> None:
    for comps in (("dit",), ("dit", "encoder"), ("encoder", "dit"), None):
        cfg = OffloadConfig(components=comps, resident_layers=2)
        assert cfg.resident_layers_for("dit") == 2
        assert cfg.resident_layers_for("encoder") == 0
    # a DiT override of zero makes the global resident layers moot for encoder-only configs
    cfg = OffloadConfig(components=("encoder",), resident_layers=0)
    assert cfg.resident_layers_for("dit") == 0


# ----------------------------------------------------------------------------- derived values
@pytest.mark.parametrize(
    "transfer, options, expected",
    [
        ("rank-local", {}, {"dit": "rank-local", "encoder": "rank-local"}),
        ("allgather", {}, {"dit": "allgather", "encoder": "allgather"}),
        (
            "rank-local",
            {"dit": {"weight_transfer": "allgather"}},
            {"dit": "allgather", "encoder": "rank-local"},
        ),
        (
            "allgather",
            {"encoder": {"weight_transfer": "rank-local"}},
            {"dit": "allgather", "encoder": "rank-local"},
        ),
        (
            "allgather",
            {"dit": {"resident_layers": 1}},  # no transfer override: inherits
            {"dit": "allgather", "encoder": "allgather"},
        ),
        ("auto", {"dit": {"weight_transfer": "auto"}}, {"dit": "auto", "encoder": "auto"}),
    ],
)
def test_transfer_for(transfer: str, options: dict[str, Any], expected: dict[str, str]) -> None:
    cfg = OffloadConfig(transfer=transfer, layer_options=options)
    assert {c: cfg.transfer_for(c) for c in COMPONENTS} == expected


@pytest.mark.parametrize(
    "resident, options, expected_dit",
    [
        (0, {}, 0),
        (3, {}, 3),
        (3, {"dit": {}}, 3),
        (3, {"dit": {"resident_layers": 0}}, 0),
        (0, {"dit": {"resident_layers": 5}}, 5),
        (2, {"encoder": {"resident_layers": 0}}, 2),
    ],
)
def test_resident_layers_for(resident: int, options: dict[str, Any], expected_dit: int) -> None:
    cfg = OffloadConfig(resident_layers=resident, layer_options=options)
    assert cfg.resident_layers_for("dit") == expected_dit
    assert cfg.resident_layers_for("encoder") == 0


HSDP_2x2 = ParallelConfig(data_parallel_size=4, hsdp_replicate_size=2, hsdp_shard_size=2)


@pytest.mark.parametrize(
    "par, expected",
    [
        (ParallelConfig(), ("local", 1)),
        (ParallelConfig(data_parallel_size=4), ("data", 4)),
        (ParallelConfig(data_parallel_size=2), ("data", 2)),
        (HSDP_2x2, ("shard", 2)),
        (
            ParallelConfig(data_parallel_size=8, hsdp_replicate_size=2, hsdp_shard_size=4),
            ("shard", 4),
        ),
        (ParallelConfig(data_parallel_size=4, hsdp_shard_size=4), ("shard", 4)),
        (ParallelConfig(sequence_parallel_size=3), ("sequence", 3)),
        (ParallelConfig(sequence_parallel_size=4), ("sequence", 4)),
        (ParallelConfig(data_parallel_size=2, sequence_parallel_size=4), ("data", 2)),
        (ParallelConfig(tensor_parallel_size=4), ("local", 1)),
        (ParallelConfig(tensor_parallel_size=2, sequence_parallel_size=2), ("sequence", 2)),
        (ParallelConfig(tensor_parallel_size=2, data_parallel_size=3), ("data", 3)),
        (
            ParallelConfig(
                data_parallel_size=4,
                sequence_parallel_size=2,
                hsdp_replicate_size=2,
                hsdp_shard_size=4,
            ),
            ("shard", 4),
        ),
    ],
)
def test_weight_group_auto(par: ParallelConfig, expected: tuple[str, int]) -> None:
    cfg = OffloadConfig(transfer="allgather")
    assert cfg.weight_group(par) == expected
    assert cfg.weight_group(par, "encoder") == expected
    assert cfg.weight_group_size(par) == expected[1]
    assert expected[0] != "tensor"


@pytest.mark.parametrize(
    "par",
    [
        ParallelConfig(),
        ParallelConfig(data_parallel_size=4),
        HSDP_2x2,
        ParallelConfig(sequence_parallel_size=2),
        ParallelConfig(tensor_parallel_size=8),
    ],
)
@pytest.mark.parametrize("axis", WEIGHT_AXES)
def test_weight_group_rank_local_is_always_local(par: ParallelConfig, axis: str) -> None:
    cfg = OffloadConfig(transfer="rank-local", weight_axis=axis)
    assert cfg.weight_group(par) == ("local", 1)
    assert cfg.weight_group_size(par) == 1


@pytest.mark.parametrize("mode", ["module", "none"])
def test_weight_group_without_layer_mode_is_local(mode: str) -> None:
    cfg = OffloadConfig(mode=mode)
    assert cfg.weight_group(ParallelConfig(data_parallel_size=4)) == ("local", 1)


def test_weight_group_is_per_component() -> None:
    cfg = OffloadConfig(
        transfer="allgather", layer_options={"encoder": {"weight_transfer": "rank-local"}}
    )
    par = ParallelConfig(data_parallel_size=4)
    assert cfg.weight_group(par) == ("data", 4)
    assert cfg.weight_group(par, "dit") == ("data", 4)
    assert cfg.weight_group(par, "encoder") == ("local", 1)
    assert cfg.weight_group_size(par, "encoder") == 1


FULL = ParallelConfig(
    data_parallel_size=8,
    sequence_parallel_size=2,
    hsdp_replicate_size=4,
    hsdp_shard_size=4,
)


@pytest.mark.parametrize(
    "axis, par, expected",
    [
        ("shard", HSDP_2x2, ("shard", 2)),
        ("shard", FULL, ("shard", 4)),
        ("data", FULL, ("data", 8)),
        ("data", HSDP_2x2, ("data", 4)),
        ("data", ParallelConfig(sequence_parallel_size=2), ("data", 1)),
        ("sequence", FULL, ("sequence", 2)),
        ("sequence", ParallelConfig(data_parallel_size=2), ("sequence", 1)),
        ("local", FULL, ("local", 1)),
        ("auto", FULL, ("shard", 4)),
    ],
)
def test_weight_group_explicit_axis(
    axis: str, par: ParallelConfig, expected: tuple[str, int]
) -> None:
    cfg = OffloadConfig(transfer="allgather", weight_axis=axis)
    assert cfg.weight_group(par) == expected


@pytest.mark.parametrize(
    "par",
    [
        ParallelConfig(),
        ParallelConfig(data_parallel_size=4),
        ParallelConfig(sequence_parallel_size=2, tensor_parallel_size=2),
    ],
)
@pytest.mark.parametrize("transfer", ["allgather", "auto"])
def test_weight_axis_shard_needs_hsdp(par: ParallelConfig, transfer: str) -> None:
    cfg = OffloadConfig(transfer=transfer, weight_axis="shard")
    with _raises(ValueError, "weight_axis='shard'", "HSDP"):
        cfg.weight_group(par)


def test_weight_group_never_touches_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("config consulted a live process group")

    for name in ("is_initialized", "get_world_size", "get_rank", "new_group"):
        monkeypatch.setattr(dist, name, boom)
    cfg = OffloadConfig(transfer="allgather")
    assert cfg.weight_group(HSDP_2x2) == ("shard", 2)
    assert cfg.strategy == "layer"


# ----------------------------------------------------------------------------- ParallelConfig
PAR_FIELDS = [f.name for f in dataclasses.fields(ParallelConfig)]


@pytest.mark.parametrize("name", PAR_FIELDS)
@pytest.mark.parametrize(
    "value, exc",
    [(0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError), ("2", TypeError)],
)
def test_bad_parallel_field(name: str, value: Any, exc: type) -> None:
    with _raises(exc, name, value):
        ParallelConfig(**{name: value})


@pytest.mark.parametrize(
    "dp, sp, tp", [(1, 1, 1), (2, 1, 1), (1, 3, 1), (1, 1, 4), (2, 2, 2), (3, 1, 5)]
)
def test_parallel_world_size(dp: int, sp: int, tp: int) -> None:
    par = ParallelConfig(data_parallel_size=dp, sequence_parallel_size=sp, tensor_parallel_size=tp)
    assert par.world_size == dp * sp * tp
    assert not par.use_hsdp
    par.check_world_size(dp * sp * tp)


@pytest.mark.parametrize(
    "replicate, shard, use",
    [(1, 1, False), (2, 2, True), (4, 1, True), (1, 4, True)],
)
def test_use_hsdp(replicate: int, shard: int, use: bool) -> None:
    par = ParallelConfig(
        data_parallel_size=replicate * shard, hsdp_replicate_size=replicate, hsdp_shard_size=shard
    )
    assert par.use_hsdp is use


@pytest.mark.parametrize(
    "kwargs, world",
    [
        ({"data_parallel_size": 4, "hsdp_shard_size": 2}, 4),
        ({"data_parallel_size": 4, "hsdp_replicate_size": 2, "hsdp_shard_size": 4}, 4),
        ({"data_parallel_size": 2, "sequence_parallel_size": 2, "hsdp_replicate_size": 3}, 4),
    ],
)
def test_hsdp_product_mismatch(kwargs: dict[str, Any], world: int) -> None:
    r = kwargs.get("hsdp_replicate_size", 1)
    s = kwargs.get("hsdp_shard_size", 1)
    with _raises(
        ValueError,
        f"hsdp_replicate_size={r}",
        f"hsdp_shard_size={s}",
        "data_parallel_size=",
        "sequence_parallel_size=",
        "tensor_parallel_size=",
        f"= {world}",
    ):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_for_world(world: int) -> None:
    par = ParallelConfig.for_world(world)
    assert par == ParallelConfig(data_parallel_size=world)
    assert par.world_size == world
    par.check_world_size(world)


@pytest.mark.parametrize("world", [0, -1, True])
def test_for_world_validates(world: Any) -> None:
    with _raises(TypeError if world is True else ValueError, "data_parallel_size", world):
        ParallelConfig.for_world(world)


@pytest.mark.parametrize(
    "par, live",
    [
        (ParallelConfig(), 2),
        (ParallelConfig(data_parallel_size=2), 1),
        (ParallelConfig(data_parallel_size=2, sequence_parallel_size=2), 2),
        (ParallelConfig(tensor_parallel_size=3), 4),
    ],
)
def test_check_world_size_mismatch(par: ParallelConfig, live: int) -> None:
    with _raises(
        ValueError,
        f"multiply to {par.world_size}",
        f"data_parallel_size={par.data_parallel_size}",
        f"sequence_parallel_size={par.sequence_parallel_size}",
        f"tensor_parallel_size={par.tensor_parallel_size}",
        f"WORLD_SIZE={live}",
    ):
        par.check_world_size(live)


# ----------------------------------------------------------------------------- from_flags
FLAG_NAMES = (
    "enable_cpu_offload",
    "enable_layerwise_offload",
    "enable_distributed_layerwise_offload",
)


def _expected_from_flags(cpu: bool, lw: bool, dlo_: bool) -> tuple[str, str]:
    if dlo_:
        return ("layer", "allgather")
    if lw:
        return ("layer", "rank-local")
    if cpu:
        return ("module", "rank-local")
    return ("none", "rank-local")


@pytest.mark.parametrize("cpu, lw, dlo_", list(itertools.product([False, True], repeat=3)))
def test_from_flags_priority(cpu: bool, lw: bool, dlo_: bool) -> None:
    cfg = OffloadConfig.from_flags(
        enable_cpu_offload=cpu,
        enable_layerwise_offload=lw,
        enable_distributed_layerwise_offload=dlo_,
    )
    assert (cfg.mode, cfg.transfer) == _expected_from_flags(cpu, lw, dlo_)
    assert cfg.strategy == cfg.mode
    assert cfg.resident_layers == 0 and cfg.pin_memory is True
    assert (cfg.num_slots, cfg.chunk_mb) == (2, 64)
    assert cfg.components is None and dict(cfg.layer_options) == {}
    # the same through the dict form with only legacy keys
    same = OffloadConfig.from_dict(
        {
            "enable_cpu_offload": cpu,
            "enable_layerwise_offload": lw,
            "enable_distributed_layerwise_offload": dlo_,
        }
    )
    assert same == cfg


def test_from_flags_no_flags_is_disabled() -> None:
    cfg = OffloadConfig.from_flags()
    assert cfg.mode == "none" and not cfg.enabled


def test_from_flags_dlo_tuning() -> None:
    cfg = OffloadConfig.from_flags(
        enable_distributed_layerwise_offload=True,
        dlo_use_allgather=False,
        dlo_resident_layers=3,
        dlo_num_slots=4,
        dlo_chunk_mb=16,
        pin_cpu_memory=False,
    )
    assert cfg.mode == "layer" and cfg.transfer == "rank-local"
    assert (cfg.resident_layers, cfg.num_slots, cfg.chunk_mb) == (3, 4, 16)
    assert cfg.pin_memory is False
    cfg = OffloadConfig.from_flags(
        enable_distributed_layerwise_offload=True, enable_layerwise_offload=True
    )
    assert cfg.transfer == "allgather"


@pytest.mark.parametrize(
    "flags", [{"enable_layerwise_offload": True}, {"enable_cpu_offload": True}, {}]
)
def test_from_flags_pin_cpu_memory(flags: dict[str, bool]) -> None:
    assert OffloadConfig.from_flags(**flags, pin_cpu_memory=False).pin_memory is False
    assert OffloadConfig.from_flags(**flags, pin_cpu_memory=True).pin_memory is True


@pytest.mark.parametrize(
    "name, value",
    [
        ("dlo_use_allgather", False),
        ("dlo_resident_layers", 1),
        ("dlo_num_slots", 3),
        ("dlo_chunk_mb", 8),
    ],
)
@pytest.mark.parametrize(
    "enabled", [{}, {"enable_layerwise_offload": True}, {"enable_cpu_offload": True}]
)
def test_from_flags_dlo_tuning_without_dlo(name: str, value: Any, enabled: dict[str, bool]) -> None:
    with _raises(ValueError, f"{name}={value!r}", "enable_distributed_layerwise_offload"):
        OffloadConfig.from_flags(**enabled, **{name: value})


def test_from_flags_dlo_tuning_at_default_without_dlo_is_fine() -> None:
    defaults = {k: LEGACY_FLAG_DEFAULTS[k] for k in LEGACY_FLAG_DEFAULTS if k.startswith("dlo_")}
    cfg = OffloadConfig.from_flags(enable_layerwise_offload=True, **defaults)
    assert (cfg.mode, cfg.transfer) == ("layer", "rank-local")


@pytest.mark.parametrize(
    "name, value, exc",
    [
        *[(n, 1, TypeError) for n in FLAG_NAMES],
        *[(n, "true", TypeError) for n in FLAG_NAMES],
        *[(n, None, TypeError) for n in FLAG_NAMES],
        ("dlo_use_allgather", 1, TypeError),
        ("pin_cpu_memory", 0, TypeError),
        ("dlo_resident_layers", True, TypeError),
        ("dlo_resident_layers", False, TypeError),
        ("dlo_resident_layers", 1.0, TypeError),
        ("dlo_resident_layers", -1, ValueError),
        ("dlo_num_slots", True, TypeError),
        ("dlo_num_slots", 0, ValueError),
        ("dlo_chunk_mb", False, TypeError),
        ("dlo_chunk_mb", 0, ValueError),
        ("dlo_chunk_mb", 64.0, TypeError),
    ],
)
def test_from_flags_bad_types(name: str, value: Any, exc: type) -> None:
    flags: dict[str, Any] = {"enable_distributed_layerwise_offload": True, name: value}
    with _raises(exc, name, value):
        OffloadConfig.from_flags(**flags)


def test_from_flags_unknown_flag() -> None:
    with _raises(ValueError, "enable_offload", "unknown"):
        OffloadConfig.from_flags(enable_offload=True)
    with _raises(ValueError, "mode"):
        OffloadConfig.from_flags(mode="layer")


# ----------------------------------------------------------------------------- from_dict
def test_from_dict_compact_form() -> None:
    cfg = OffloadConfig.from_dict(
        {
            "mode": "layer",
            "components": ["dit", "encoder"],
            "layer_options": {
                "dit": {"weight_transfer": "allgather", "resident_layers": 2},
                "encoder": {"weight_transfer": "rank-local"},
            },
            "pin_memory": False,
            "num_slots": 3,
            "chunk_mb": 32,
        }
    )
    assert cfg.mode == "layer"
    assert cfg.components == ("dit", "encoder") and isinstance(cfg.components, tuple)
    assert isinstance(cfg.layer_options["dit"], LayerOptions)
    assert cfg.transfer_for("dit") == "allgather"
    assert cfg.transfer_for("encoder") == "rank-local"
    assert cfg.resident_layers_for("dit") == 2
    assert cfg.pin_memory is False
    assert (cfg.num_slots, cfg.chunk_mb) == (3, 32)


def test_from_dict_docstring_example() -> None:
    cfg = OffloadConfig.from_dict(
        {
            "mode": "layer",
            "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": "allgather"}},
        }
    )
    assert cfg.transfer_for("dit") == "allgather"
    assert cfg.weight_group(ParallelConfig(data_parallel_size=2)) == ("data", 2)


def test_from_dict_round_trips_every_field() -> None:
    cfg = OffloadConfig(
        mode="layer",
        components=("dit",),
        transfer="allgather",
        resident_layers=1,
        layer_options={"dit": {"weight_transfer": "auto"}},
        pin_memory=False,
        num_slots=3,
        chunk_mb=8,
        pin_budget_gb=1.5,
        pin_failure_policy="whole_block_fallback",
        weight_axis="data",
        collective_timeout_s=7.0,
        verify_block_sequence=False,
        codec="auto",
    )
    data = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    data["layer_options"] = {k: dataclasses.asdict(v) for k, v in cfg.layer_options.items()}
    data["components"] = list(cfg.components or ())
    back = OffloadConfig.from_dict(data)
    assert back == cfg
    for f in dataclasses.fields(cfg):
        assert getattr(back, f.name) == getattr(cfg, f.name), f.name


@pytest.mark.parametrize(
    "data, exc, needles",
    [
        ({"mode": "layer", "slots": 2}, ValueError, ("unknown", "slots")),
        ({"mode": "layer", "Mode": "layer"}, ValueError, ("unknown", "Mode")),
        ({"enable_layerwise": True}, ValueError, ("unknown", "enable_layerwise")),
        ({"mode": "layer", "transfer": "nccl"}, ValueError, ("transfer", "'nccl'")),
        ({"mode": "bogus"}, ValueError, ("mode", "'bogus'")),
        ({"components": ["vae", "unet"]}, ValueError, ("components", "'unet'")),
        ({"components": "dit"}, TypeError, ("components", "'dit'")),
        ({"layer_options": {"dit": {"bogus": 1}}}, ValueError, ("layer_options['dit']", "bogus")),
        (
            {"layer_options": {"dit": {"weight_transfer": "nccl"}}},
            ValueError,
            ("weight_transfer", "'nccl'"),
        ),
        ({"layer_options": {"vae": {}}}, ValueError, ("layer_options key", "'vae'")),
        ({"resident_layers": True}, TypeError, ("resident_layers", "True")),
        ({"resident_layers": -3}, ValueError, ("resident_layers", "-3")),
        (
            {"mode": "layer", "components": ["encoder"], "resident_layers": 1},
            ValueError,
            ("resident_layers=1", "'encoder'"),
        ),
        (
            {"mode": "module", "layer_options": {"dit": {"weight_transfer": "allgather"}}},
            ValueError,
            ("layer_options", "'module'"),
        ),
        (
            {"mode": "layer", "components": ["encoder", "text_encoder"]},
            ValueError,
            ("components", "duplicates"),
        ),
        (
            {"layer_options": {"encoder": {}, "text_encoder": {}}},
            ValueError,
            ("'encoder' twice", "'text_encoder'"),
        ),
        ({"mode": "layer", "components": ["unet"]}, ValueError, ("components", "'unet'")),
        ({"pin_memory": "yes"}, TypeError, ("pin_memory", "'yes'")),
    ],
)
def test_from_dict_errors(data: dict[str, Any], exc: type, needles: tuple[str, ...]) -> None:
    with _raises(exc, *needles):
        OffloadConfig.from_dict(data)


@pytest.mark.parametrize("data", [None, [("mode", "layer")], "layer", 3])
def test_from_dict_needs_a_mapping(data: Any) -> None:
    with _raises(TypeError, "mapping", type(data).__name__):
        OffloadConfig.from_dict(data)


# vLLM-Omni's compact diffusion_offload_config, as its users write it
VLLM_OMNI_CONFIGS = [
    (
        {
            "mode": "layer",
            "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": "allgather"}},
        },
        {"mode": "layer", "components": ("dit",), "dit": "allgather", "encoder": "rank-local"},
    ),
    (
        {
            "mode": "layer",
            "components": ["text_encoder"],
            "layer_options": {"text_encoder": {"weight_transfer": "allgather"}},
        },
        {"mode": "layer", "components": ("encoder",), "dit": "rank-local", "encoder": "allgather"},
    ),
    (
        {"mode": "layer", "components": ["dit", "text_encoder"]},
        {"mode": "layer", "components": ("dit", "encoder"), "dit": "rank-local"},
    ),
    (
        {
            "mode": "layer",
            "components": ["dit", "text_encoder"],
            "layer_options": {
                "dit": {"weight_transfer": "rank-local"},
                "text_encoder": {"weight_transfer": "allgather"},
            },
        },
        {
            "mode": "layer",
            "components": ("dit", "encoder"),
            "dit": "rank-local",
            "encoder": "allgather",
        },
    ),
    (
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 20}}},
        {"mode": "layer", "components": ("dit",), "resident": 20},
    ),
    (
        {"mode": "layer", "components": ["dit"], "pin_memory": False},
        {"mode": "layer", "components": ("dit",), "pin_memory": False},
    ),
    (
        {"mode": "module", "components": ["dit", "text_encoder"]},
        {"mode": "module", "components": ("dit", "encoder")},
    ),
    ({"mode": "module", "components": ["dit"]}, {"mode": "module", "components": ("dit",)}),
    (
        {"mode": "layer", "components": ["dit", "text_encoder", "vae"]},
        {"mode": "layer", "components": ("dit", "encoder", "vae")},
    ),
]


@pytest.mark.parametrize("data, expected", VLLM_OMNI_CONFIGS)
def test_from_dict_reads_vllm_omni_compact_configs_verbatim(
    data: dict[str, Any], expected: dict[str, Any]
) -> None:
    cfg = OffloadConfig.from_dict(data)
    assert cfg.mode == expected["mode"] and cfg.components == expected["components"]
    for kind in ("dit", "encoder"):
        if kind in expected:
            assert cfg.transfer_for(kind) == expected[kind], kind
    assert cfg.resident_layers_for("dit") == expected.get("resident")
    assert cfg.pin_memory is expected.get("pin_memory", True)
    assert OffloadConfig.from_dict(json.loads(json.dumps(data))) == cfg  # from JSON alike


def test_hsdp_sizes_alone_give_the_data_parallel_size() -> None:
    par = ParallelConfig(hsdp_replicate_size=2, hsdp_shard_size=2)
    assert (par.data_parallel_size, par.world_size, par.use_hsdp) == (4, 4, True)
    assert ParallelConfig(hsdp_shard_size=4).data_parallel_size == 4
    with _raises(ValueError, "hsdp_replicate_size=2", "world size"):
        ParallelConfig(data_parallel_size=2, hsdp_replicate_size=2, hsdp_shard_size=2)


@pytest.mark.parametrize("codec", [None, "none", "auto", "ans"])
def test_from_dict_keeps_the_codec_unset_or_as_given(codec: str | None) -> None:
    """An unset codec stays unset through from_dict and repr (the device decides at enable);
    a value given, "none" included, is kept."""
    data = {"mode": "layer"} if codec is None else {"mode": "layer", "codec": codec}
    cfg = OffloadConfig.from_dict(data)
    assert cfg.codec == codec and cfg.codec_for("dit") == codec
    assert f"codec={codec!r}" in repr(cfg)
    assert OffloadConfig.from_dict(json.loads(json.dumps(data))) == cfg


def test_from_dict_does_not_mutate_input() -> None:
    data: dict[str, Any] = {"mode": "layer", "components": ["dit"]}
    OffloadConfig.from_dict(data)
    assert data == {"mode": "layer", "components": ["dit"]}


@pytest.mark.parametrize(
    "legacy, expected",
    [
        ({"enable_cpu_offload": True}, ("module", "rank-local")),
        ({"enable_layerwise_offload": True}, ("layer", "rank-local")),
        ({"enable_distributed_layerwise_offload": True}, ("layer", "allgather")),
        (
            {"enable_distributed_layerwise_offload": True, "dlo_use_allgather": False},
            ("layer", "rank-local"),
        ),
        ({"enable_layerwise_offload": False}, ("none", "rank-local")),
    ],
)
def test_from_dict_legacy_only(legacy: dict[str, Any], expected: tuple[str, str]) -> None:
    cfg = OffloadConfig.from_dict(legacy)
    assert (cfg.mode, cfg.transfer) == expected
    assert cfg == OffloadConfig.from_flags(**legacy)
    # the flags keep their historical meaning on a GPU too: no codec, never measured
    assert cfg.codec == "none" and for_device(cfg, "cuda").codec == "none"


def test_from_dict_legacy_only_validates_like_from_flags() -> None:
    with _raises(ValueError, "dlo_resident_layers=2", "enable_distributed_layerwise_offload"):
        OffloadConfig.from_dict({"enable_layerwise_offload": True, "dlo_resident_layers": 2})
    with _raises(TypeError, "dlo_resident_layers", "True"):
        OffloadConfig.from_dict(
            {"enable_distributed_layerwise_offload": True, "dlo_resident_layers": True}
        )
    with _raises(TypeError, "enable_cpu_offload", "1"):
        OffloadConfig.from_dict({"enable_cpu_offload": 1})


# ----------------------------------------------------------------------------- compact + legacy
AGREEING = [
    {"mode": "module", "enable_cpu_offload": True},
    {"mode": "layer", "enable_layerwise_offload": True},
    {"mode": "layer", "transfer": "rank-local", "enable_layerwise_offload": True},
    {"mode": "layer", "transfer": "allgather", "enable_distributed_layerwise_offload": True},
    {
        "mode": "layer",
        "layer_options": {"dit": {"weight_transfer": "allgather"}},
        "enable_distributed_layerwise_offload": True,
    },
    {"mode": "none", "enable_cpu_offload": False},
    {"mode": "layer", "enable_cpu_offload": False, "enable_layerwise_offload": False},
    {"mode": "layer", "dlo_num_slots": 2, "dlo_chunk_mb": 64, "dlo_use_allgather": True},
    {"mode": "layer", "pin_memory": False, "pin_cpu_memory": False},
    {"mode": "layer", "pin_cpu_memory": True},
    {
        "mode": "layer",
        "transfer": "allgather",
        "enable_distributed_layerwise_offload": True,
        "enable_layerwise_offload": True,
        "enable_cpu_offload": True,
    },
]


@pytest.mark.parametrize("data", AGREEING)
def test_compact_and_agreeing_legacy_accepted(data: dict[str, Any]) -> None:
    compact = {k: v for k, v in data.items() if k not in LEGACY_FLAG_DEFAULTS}
    assert OffloadConfig.from_dict(data) == OffloadConfig.from_dict(compact)


CONFLICTING = [
    # (data, the legacy flag the message must name)
    ({"mode": "layer", "enable_cpu_offload": True}, "enable_cpu_offload"),
    ({"mode": "none", "enable_cpu_offload": True}, "enable_cpu_offload"),
    ({"mode": "module", "enable_layerwise_offload": True}, "enable_layerwise_offload"),
    ({"mode": "none", "enable_layerwise_offload": True}, "enable_layerwise_offload"),
    (
        {"mode": "layer", "transfer": "allgather", "enable_layerwise_offload": True},
        "enable_layerwise_offload",
    ),
    (
        {"mode": "layer", "resident_layers": 1, "enable_layerwise_offload": True},
        "enable_layerwise_offload",
    ),
    (
        {"mode": "layer", "enable_distributed_layerwise_offload": True},
        "enable_distributed_layerwise_offload",
    ),
    (
        {"mode": "module", "enable_distributed_layerwise_offload": True},
        "enable_distributed_layerwise_offload",
    ),
    (
        {
            "mode": "module",
            "enable_cpu_offload": True,
            "enable_distributed_layerwise_offload": True,
        },
        "enable_distributed_layerwise_offload",
    ),
    (
        {"mode": "layer", "transfer": "allgather", "dlo_use_allgather": False},
        "dlo_use_allgather",
    ),
    ({"mode": "layer", "resident_layers": 2, "dlo_resident_layers": 2}, "dlo_resident_layers"),
    ({"mode": "layer", "dlo_num_slots": 4}, "dlo_num_slots"),
    ({"mode": "layer", "dlo_chunk_mb": 16}, "dlo_chunk_mb"),
    ({"mode": "layer", "pin_cpu_memory": False}, "pin_cpu_memory"),
    ({"mode": "layer", "pin_memory": False, "pin_cpu_memory": True}, "pin_cpu_memory"),
]


@pytest.mark.parametrize("data, flag", CONFLICTING)
def test_compact_conflicting_with_legacy_flag(data: dict[str, Any], flag: str) -> None:
    with _raises(ValueError, flag, repr(data[flag])):
        OffloadConfig.from_dict(data)


def test_conflict_message_names_both_strategies() -> None:
    with _raises(ValueError, "mode='layer'", "'layerwise'", "enable_cpu_offload=True", "'module'"):
        OffloadConfig.from_dict({"mode": "layer", "enable_cpu_offload": True})


@pytest.mark.parametrize(
    "name, value",
    [
        ("dlo_resident_layers", False),
        ("dlo_num_slots", 2.0),
        ("enable_cpu_offload", 0),
        ("pin_cpu_memory", 1),
    ],
)
def test_compact_with_badly_typed_legacy_flag(name: str, value: Any) -> None:
    with _raises(TypeError, name, value):
        OffloadConfig.from_dict({"mode": "layer", name: value})


@pytest.mark.parametrize(("value", "exc"), [(0, ValueError), (True, TypeError), (2.0, TypeError)])
def test_nccl_max_ctas_validated(value: Any, exc: type[Exception]) -> None:
    with _raises(exc, "nccl_max_ctas", repr(value)):
        OffloadConfig(nccl_max_ctas=value)
    assert OffloadConfig(nccl_max_ctas=8).nccl_max_ctas == 8


@pytest.mark.parametrize(("value", "exc"), [("ce", ValueError), (None, TypeError), (1, TypeError)])
def test_gather_engine_validated(value: Any, exc: type[Exception]) -> None:
    with _raises(exc, "gather_engine", repr(value)):
        OffloadConfig(gather_engine=value)
    assert OffloadConfig(gather_engine="copy").gather_engine == "copy"
    assert OffloadConfig(gather_engine="auto").gather_engine == "auto"
    assert OffloadConfig().gather_engine == "auto"


@pytest.mark.parametrize(
    ("value", "exc"), [("spin", ValueError), (None, TypeError), (0, TypeError)]
)
def test_gather_sync_validated(value: Any, exc: type[Exception]) -> None:
    with _raises(exc, "gather_sync", repr(value)):
        OffloadConfig(gather_sync=value)
    assert OffloadConfig().gather_sync == "auto"
    assert OffloadConfig(gather_sync="kernel").gather_sync == "kernel"
    assert OffloadConfig.from_dict({"gather_sync": "stream"}).gather_sync == "stream"


@pytest.mark.parametrize(
    "sizes",
    [
        {"tensor_parallel_size": 2, "hsdp_shard_size": 2},
        {"tensor_parallel_size": 2, "data_parallel_size": 2, "hsdp_replicate_size": 2},
        {
            "tensor_parallel_size": 2,
            "data_parallel_size": 2,
            "hsdp_replicate_size": 2,
            "hsdp_shard_size": 2,
        },
    ],
)
def test_hsdp_with_tensor_parallelism_is_refused(sizes: dict[str, int]) -> None:
    """HSDP's shard groups are consecutive ranks, with TP > 1 the tensor groups: dlo would
    gather weights over TP."""
    with _raises(ValueError, "tensor_parallel_size=2", "hsdp_shard_size=", "HSDP"):
        ParallelConfig(**sizes)


@pytest.mark.parametrize(
    "name", ["pin_budget_gb", "device_budget_gb", "collective_timeout_s", "block_compute_ms"]
)
def test_numbers_that_would_overflow_later_are_refused_naming_the_field(name: str) -> None:
    """Issue 26 (6): 1e308 is finite but overflows later (a timeout in ms, GB in bytes)."""
    with pytest.raises(ValueError, match=rf"{name} must be <= 1e\+07, got 1e\+308"):
        dlo.OffloadConfig(mode="layer", **{name: 1e308})


@pytest.mark.parametrize(("name", "bound"), [("num_slots", 1024), ("chunk_mb", 65536)])
def test_counts_beyond_any_model_are_refused_naming_the_field(name: str, bound: int) -> None:
    """Issue 26 (6): num_slots=10**6 allocated 14 GB of host memory and kept going."""
    with pytest.raises(ValueError, match=rf"{name} must be <= {bound}, got 1000000"):
        dlo.OffloadConfig(mode="layer", **{name: 10**6})
    assert getattr(dlo.OffloadConfig(mode="layer", **{name: bound}), name) == bound


@pytest.mark.parametrize(
    "given, device, want",
    [
        ({}, "cuda", ("auto", "auto", "auto")),  # a GPU: the policy decides
        ({}, "cpu", (0, 2, "none")),  # a CPU device: every block streams raw through 2 slots
        ({"device_budget_gb": 1.0}, "cpu", ("auto", 2, "none")),  # the budget sizes residency
        ({"device_budget_gb": 1.0, "resident_layers": 0}, "cuda", (0, "auto", "auto")),  # kept
        ({"resident_layers": 3}, "cuda", (3, "auto", "auto")),  # a value given is kept
        ({"num_slots": 4}, "cuda", ("auto", 4, "auto")),
        ({"resident_layers": "auto", "num_slots": "auto"}, "cpu", ("auto", "auto", "none")),
        # nothing else left to the policy: enable's codec could only be "none", and the
        # policy must not run for it (the late codec still may: codec_by_measurement)
        ({"resident_layers": 0, "num_slots": 2}, "cuda", (0, 2, "none")),
        ({"resident_layers": 0, "num_slots": 2, "block_compute_ms": 3.0}, "cuda", (0, 2, "auto")),
        ({"resident_layers": 0, "num_slots": 2, "transfer": "auto"}, "cuda", (0, 2, "auto")),
        ({"components": ("encoder",)}, "cuda", (0, "auto", "auto")),  # no DiT: none resident
        ({"layer_options": {"dit": {"resident_layers": 2}}}, "cuda", ("auto", "auto", "auto")),
        ({"codec": "none"}, "cuda", ("auto", "auto", "none")),  # never encoded on a GPU
        ({"codec": "auto"}, "cpu", (0, 2, "auto")),  # measured on a CPU device too
        ({"codec": "ans"}, "cuda", ("auto", "auto", "ans")),
        ({"layer_options": {"dit": {"codec": "none"}}}, "cuda", ("auto", "auto", "auto")),
    ],
)
def test_unset_residency_slots_and_codec_resolve_per_device(
    given: dict[str, Any], device: str, want: tuple[Any, Any, Any]
) -> None:
    """[Note: automatic by default]: unset values become "auto" on a GPU and the streaming
    defaults on a CPU device; values given are never changed."""
    cfg = OffloadConfig(**given)
    got = for_device(cfg, device)
    assert (got.resident_layers, got.num_slots, got.codec) == want
    dit = given.get("layer_options", {}).get("dit", {})
    assert got.resident_layers_for("dit") == dit.get("resident_layers", got.resident_layers)
    assert got.codec_for("dit") == dit.get("codec", got.codec)  # a per-component value wins
    assert got.codec_for("encoder") == got.codec
    per_component = {n for n in ("resident_layers", "codec") if n in dit}
    fields = ("resident_layers", "num_slots", "codec")
    assert unset_fields(cfg) == {n for n in fields if n not in given} - per_component
    assert (cfg.resident_layers, cfg.num_slots, cfg.codec) == tuple(
        given.get(n) for n in fields
    )  # the config itself is unchanged
    assert for_device(OffloadConfig(mode="module"), device) == OffloadConfig(mode="module")


@pytest.mark.parametrize(
    "given, device, want",
    [
        ({}, "cuda", True),
        ({"resident_layers": 0, "num_slots": 2}, "cuda", True),  # enable's codec: "none"
        ({}, "cpu", False),
        ({"codec": "auto"}, "cpu", True),
        ({"codec": "none"}, "cuda", False),
        ({"codec": "ans"}, "cuda", False),
        ({"layer_options": {"dit": {"codec": "none"}}}, "cuda", False),
    ],
)
def test_the_codec_turned_on_by_measurement_follows_an_unset_or_auto_codec(
    given: dict[str, Any], device: str, want: bool
) -> None:
    """An unset codec on a GPU leaves the codec to measurement even where enable resolves
    it to "none" without running the policy; an explicit value, "none" above all, never."""
    assert codec_by_measurement(OffloadConfig(**given), device) is want
