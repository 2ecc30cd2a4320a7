"""Diffusers pipeline folders: a ``model_index.json`` and one folder per component.

[Note: pipeline folders]
A folder written by ``DiffusionPipeline.save_pretrained`` names the pipeline class and, per
component, its library and class (``"transformer": ["diffusers", "WanTransformer3DModel"]``).
:func:`read_index` checks that file and every component folder before anything is built;
:func:`build_modules` builds every ``nn.Module`` component from its ``config.json`` with its
parameters on ``meta`` (no memory, no initialization) and its buffers real, computed by the
class's ``__init__`` as the library computes them (rotary tables, position ids), which is what
diffusers' own ``from_pretrained`` does (``init_empty_weights`` keeps buffers). The weights
then come from the component's safetensors through :mod:`dlo.io.materialize`, so each rank
reads only its byte ranges of the streamed blocks. Tokenizers, schedulers and processors load
with their own ``from_pretrained`` from their folders.

Dtypes: with ``torch_dtype`` every floating tensor runs in that dtype (cast on load) except
the class's keep-in-fp32 modules, the rules of diffusers and of transformers; without it each
tensor keeps its stored dtype (diffusers would upcast to float32, see docs/design.md). The
component is built under the default dtype it runs in, so the buffers its ``__init__``
computes get the dtype diffusers gives them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch import nn

from dlo.io.checkpoint import Checkpoint, CheckpointError, TensorEntry
from dlo.io.files import access_denied
from dlo.io.header_checks import loads_json
from dlo.pipelines.classes import import_class

INDEX = "model_index.json"

_WEIGHTS = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}
"""The weight file stem each library's ``save_pretrained`` writes."""

_LIBRARIES = ("diffusers", "transformers")


@dataclass(frozen=True)
class ComponentSpec:
    """One entry of ``model_index.json``."""

    name: str
    library: str
    class_name: str
    path: Path


@dataclass(frozen=True)
class FolderIndex:
    """A checked ``model_index.json``."""

    root: Path
    pipeline_class: str
    components: tuple[ComponentSpec, ...]
    """Every component with a value; ``[null, null]`` entries are left out."""
    absent: tuple[str, ...]
    """Components the folder leaves empty (passed as None to the pipeline class)."""
    options: Mapping[str, Any]
    """The pipeline's other saved ``__init__`` arguments (``boundary_ratio`` of Wan 2.2)."""


def is_pipeline_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding a ``model_index.json``."""
    return (Path(path) / INDEX).is_file()


def read_index(root: str | os.PathLike[str]) -> FolderIndex:
    """Parse and check ``root/model_index.json`` and that every component's folder exists.

    Raises:
        CheckpointError: naming the file and the field: no index, not JSON, no
            ``_class_name``, an entry that is not ``[library, class]``, a library other than
            diffusers or transformers, a class name that is no public name
            (``__spec__``), a component named by a path (``../x``, ``/x``: outside the
            folder), or a component folder that is missing or this process cannot read.
    """
    base = Path(root)
    path = base / INDEX
    if not base.is_dir():
        raise CheckpointError(f"pipeline folder {base} does not exist or is not a directory")
    try:
        raw = loads_json(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{base} is not a diffusers pipeline folder: it has no {INDEX}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a JSON object ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object (got {type(raw).__name__})")
    cls = raw.get("_class_name")
    if not _is_class_name(cls):
        raise CheckpointError(f"{path}: _class_name must name the pipeline class, got {cls!r}")
    specs: list[ComponentSpec] = []
    absent: list[str] = []
    options: dict[str, Any] = {}
    for name, value in raw.items():
        if name.startswith("_"):
            continue
        if not isinstance(value, list):
            options[name] = value  # an __init__ argument of the pipeline, not a component
            continue
        if len(value) != 2:
            raise CheckpointError(f"{path}: {name} must be [library, class], got {value!r}")
        library, class_name = value
        if library is None and class_name is None:
            absent.append(name)
            continue
        if library not in _LIBRARIES:
            raise CheckpointError(
                f"{path}: {name} = {value!r}: dlo loads components of "
                f"{' and '.join(_LIBRARIES)} only"
            )
        if not _is_class_name(class_name):
            raise CheckpointError(f"{path}: {name} = {value!r}: {class_name!r} is not a class name")
        if Path(name).name != name or name in ("", ".."):  # a folder outside the pipeline's
            raise CheckpointError(
                f"{path}: component {name!r} is not a plain folder name; components are "
                f"folders inside {base}"
            )
        folder = base / name
        if not folder.is_dir():
            raise CheckpointError(f"{path} lists {name} ({class_name}) but {folder} is missing")
        why = access_denied(folder, os.R_OK | os.X_OK)
        if why:
            raise CheckpointError(f"{path} lists {name} ({class_name}) but {why}")
        specs.append(ComponentSpec(name, library, class_name, folder))
    if not specs:
        raise CheckpointError(f"{path}: lists no components")
    return FolderIndex(base, cls, tuple(specs), tuple(absent), options)


def _is_class_name(value: object) -> TypeGuard[str]:
    """A public Python name (``__spec__`` and the like are a module's, never a class)."""
    return isinstance(value, str) and value.isidentifier() and not value.startswith("_")


def pipeline_class(index: FolderIndex) -> type:
    """The pipeline class ``index`` names, or a CheckpointError naming it: it must be a
    ``diffusers.DiffusionPipeline`` (``AutoPipelineForText2Image`` only picks one)."""
    where = f"{index.root / INDEX}: _class_name"
    cls = import_class("diffusers", index.pipeline_class, where)
    if not issubclass(cls, import_class("diffusers", "DiffusionPipeline", where)):
        raise CheckpointError(
            f"{where} = {index.pipeline_class!r} is not a pipeline class (a "
            "diffusers.DiffusionPipeline)"
        )
    return cls


def weights_of(spec: ComponentSpec) -> Path:
    """The safetensors file, or its index, that ``spec``'s library writes."""
    stem = _WEIGHTS[spec.library]
    for name in (f"{stem}.safetensors.index.json", f"{stem}.safetensors"):
        if (spec.path / name).is_file():
            return spec.path / name
    other = sorted(p.name for p in spec.path.iterdir() if p.suffix in (".bin", ".safetensors"))
    found = f" (it holds {', '.join(other)})" if other else ""
    raise CheckpointError(
        f"{spec.path}: no {stem}.safetensors or {stem}.safetensors.index.json for "
        f"{spec.name} ({spec.class_name}){found}; dlo reads safetensors only"
    )


def module_components(index: FolderIndex) -> dict[str, tuple[ComponentSpec, type]]:
    """The components of ``index`` whose classes are ``nn.Module`` s, by name, with them."""
    out: dict[str, tuple[ComponentSpec, type]] = {}
    for spec in index.components:
        cls = import_class(spec.library, spec.class_name, f"{index.root / INDEX}: {spec.name}")
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            out[spec.name] = (spec, cls)
    return out


def open_checkpoint(specs: Iterable[ComponentSpec], *, verify_checksum: bool = False) -> Checkpoint:
    """One :class:`Checkpoint` over the weights of ``specs``, each prefixed by its name."""
    return Checkpoint({s.name: weights_of(s) for s in specs}, verify_checksum=verify_checksum)


# ----------------------------------------------------------------------------- building
@contextlib.contextmanager
def params_on_meta(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside get their parameters on ``meta`` (buffers stay real) under the
    default dtype ``dtype``. Not thread-safe (it patches ``nn.Module.register_parameter``)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = torch.Tensor._make_subclass(
                type(param), param.data.to("meta"), param.requires_grad
            )
            meta.__dict__.update(param.__dict__)
            param = meta
        original(self, name, param)

    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(
            f"dtype={dtype}: components are built in a float16, bfloat16 or float32 "
            "default dtype (float8 and integer weights load as stored: dtype=None)"
        )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        torch.set_default_dtype(previous)


def _stored_dtype(ckpt: Checkpoint, name: str) -> torch.dtype:
    """The floating dtype holding most of component ``name``'s bytes (float32 if none)."""
    nbytes: dict[torch.dtype, int] = {}
    for key, e in ckpt.entries.items():
        if key.startswith(f"{name}.") and e.dtype.is_floating_point:
            nbytes[e.dtype] = nbytes.get(e.dtype, 0) + e.nbytes
    return max(nbytes, key=lambda d: nbytes[d]) if nbytes else torch.float32


def _keep_fp32(model: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """Module names the model keeps in float32 when loaded in ``dtype`` (diffusers: always
    when a dtype is given; transformers: ``_keep_in_fp32_modules`` for float16, the strict
    list for float16 and bfloat16). Read from the built instance: transformers 5 merges its
    sub-models' lists into it."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if type(model).__module__.startswith("transformers"):
        keep = keep if dtype == torch.float16 else set()
        if dtype in (torch.float16, torch.bfloat16):
            keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return tuple(sorted(keep))


def dtype_kwarg() -> str:
    """transformers' name for the dtype argument: ``dtype`` from 4.56, ``torch_dtype``
    before."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _build_one(cls: type, path: Path, dtype: torch.dtype) -> nn.Module:
    with params_on_meta(dtype):
        if cls.__module__.startswith("diffusers"):
            config = cls.load_config(path)  # type: ignore[attr-defined]
            model = cls.from_config(config)  # type: ignore[attr-defined]
            model.register_to_config(_name_or_path=str(path))
        else:
            config = cls.config_class.from_pretrained(path)  # type: ignore[attr-defined]
            model = cls._from_config(config, **{dtype_kwarg(): dtype})  # type: ignore[attr-defined]
    model.eval()
    return model  # type: ignore[no-any-return]


def _rename_entries(ckpt: Checkpoint, name: str, model: nn.Module) -> None:
    """Rename component ``name``'s checkpoint entries to ``model``'s state-dict names where
    its library renames on load (transformers 5's conversion mapping, or the
    ``_checkpoint_conversion_mapping`` of transformers 4: Qwen2.5-VL stores
    ``model.layers.*`` for ``model.language_model.layers.*``). A tensor the library would
    convert (split, fuse, permute) is refused: dlo serves stored bytes as they are."""
    prefix = f"{name}."
    rename: Any
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}

        def rename(key: str) -> tuple[str, str | None]:
            for pattern, replacement in mapping.items():
                new, n = re.subn(pattern, replacement, key)
                if n:
                    return new, None
            return key, None
    else:
        transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        names = model.state_dict(keep_vars=True)
        base = getattr(model, "base_model_prefix", None)

        def rename(key: str) -> tuple[str, str | None]:
            return rename_source_key(key, renamings, converters, base, names)  # type: ignore[no-any-return]

    entries: dict[str, TensorEntry] = {}
    for key, e in ckpt.entries.items():
        if key.startswith(prefix):
            new, converted = rename(key[len(prefix) :])
            if converted is not None:
                raise CheckpointError(
                    f"{e.file}: {key} is stored in a layout {type(model).__name__} converts on "
                    f"load ({converted}); dlo serves stored tensors as they are"
                )
            key = prefix + new
            e = dataclasses.replace(e, name=key)
        if key in entries:
            raise CheckpointError(
                f"{e.file}: two stored tensors load as {key!r} ({entries[key].file.name} and "
                f"{e.file.name})"
            )
        entries[key] = e
    ckpt.entries = entries


def _retype(
    model: nn.Module, name: str, ckpt: Checkpoint, dtype: torch.dtype | None, keep: tuple[str, ...]
) -> None:
    """Give every parameter and persistent buffer of ``model`` the dtype it runs in: the
    stored one, or ``dtype`` for floating tensors outside ``keep`` (float32 inside). A tensor
    stored as integers where the class makes a floating one (an F32 weight relabelled I32:
    the same bytes), or the reverse, is a CheckpointError naming the file and the tensor."""
    seen: set[int] = set()
    for mpath, module in model.named_modules(remove_duplicate=False):
        tensors = list(module._parameters.items()) + [
            (k, b)
            for k, b in module._buffers.items()
            if k not in module._non_persistent_buffers_set
        ]
        for local, t in tensors:
            if t is None or id(t) in seen:
                continue
            key = ".".join(p for p in (name, mpath, local) if p)
            entry = ckpt.entries.get(key)
            if entry is None:
                continue  # another name of a tied tensor, or reported missing by plan_load
            seen.add(id(t))
            if _is_float(t.dtype) != _is_float(entry.dtype):
                raise CheckpointError(
                    f"{entry.file}: tensor {key!r} is stored as {entry.dtype}, but "
                    f"{type(model).__name__} makes it {t.dtype}: floating and integer data "
                    "do not load as each other"
                )
            want = entry.dtype
            if dtype is not None and entry.dtype.is_floating_point:
                kept = any(m in key.split(".") for m in keep)
                want = torch.float32 if kept else dtype
            if t.dtype != want:
                t.data = torch.empty_like(t.data, dtype=want)


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def build_modules(
    components: Mapping[str, tuple[ComponentSpec, type]],
    ckpt: Checkpoint,
    torch_dtype: torch.dtype | None,
) -> dict[str, nn.Module]:
    """Every ``nn.Module`` component (:func:`module_components`) built with its parameters
    on ``meta``, each tensor in the dtype it will run in (see [Note: pipeline folders])."""
    out: dict[str, nn.Module] = {}
    for name, (spec, cls) in components.items():
        dtype = torch_dtype if torch_dtype is not None else _stored_dtype(ckpt, name)
        if torch_dtype is None and dtype.itemsize < 2:
            dtype = torch.float32  # built in float32; the tensors keep their stored dtypes
        # a config.json that is not JSON is a ValueError, one nested too deep a RecursionError
        try:
            model = _build_one(cls, spec.path, dtype)
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as e:
            raise CheckpointError(
                f"{spec.path}: cannot build {cls.__name__} from its config: {e}"
            ) from e
        if spec.library == "transformers":
            _rename_entries(ckpt, name, model)
        _retype(model, name, ckpt, torch_dtype, _keep_fp32(model, dtype))
        out[name] = model
    return out


def load_others(index: FolderIndex, modules: Mapping[str, nn.Module]) -> dict[str, Any]:
    """Every component that is not a module (tokenizers, schedulers, processors), loaded
    with its own ``from_pretrained`` from its folder."""
    out: dict[str, Any] = {}
    for spec in index.components:
        if spec.name in modules:
            continue
        where = f"{index.root / INDEX}: {spec.name}"
        cls = import_class(spec.library, spec.class_name, where)
        if not callable(getattr(cls, "from_pretrained", None)):
            raise CheckpointError(
                f"{where} = {spec.class_name!r}: not a component class (it has no from_pretrained)"
            )
        try:
            out[spec.name] = cls.from_pretrained(spec.path)  # type: ignore[attr-defined]
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as e:  # as _build_one's
            raise CheckpointError(f"{spec.path}: cannot load {spec.class_name}: {e}") from e
    return out


def assemble(index: FolderIndex, components: Mapping[str, Any]) -> Any:
    """The pipeline class of ``index`` built from ``components``."""
    cls = pipeline_class(index)
    kwargs = dict(components)
    kwargs.update(dict.fromkeys(index.absent))
    accepted = inspect.signature(cls).parameters
    kwargs.update({k: v for k, v in index.options.items() if k in accepted})
    try:
        pipe = cls(**kwargs)
    except TypeError as e:
        raise CheckpointError(
            f"{index.root / INDEX}: {index.pipeline_class} does not take these components "
            f"({', '.join(sorted(kwargs))}): {e}"
        ) from e
    pipe.register_to_config(_name_or_path=str(index.root))
    return pipe
