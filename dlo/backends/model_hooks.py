"""Pieces both backends install the same way: state-dict hooks that serve real tensors from
host storage, the refusal of ``load_state_dict``, and the record of tensors whose bytes a
backend released for good."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dlo.codec.blocks import EncodedShard
from dlo.errors import OffloadError
from dlo.hooks.dispatch import ModelHook
from dlo.hooks.foreign import foreign_offloader
from dlo.hooks.registry import HookRegistry
from dlo.host.mapped import MappedBlock
from dlo.host.shards import shard_view
from dlo.plan.checks import named_tensors
from dlo.plan.declarations import get_by_path
from dlo.plan.layout import BlockLayout, module_wrappers

# id -> (weak reference, why) of tensors whose bytes a disable could not restore (an
# AllGather rank held 1/G of them; a mapped block's checkpoint changed). Keyed by id because
# tensors compare elementwise, not by identity.
_RELEASED: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}


def gathered_loss(group_size: int) -> str:
    """Why an AllGather block's weights are gone after a plain disable."""
    return (
        "when AllGather offload of the model was disabled (each rank held only its "
        f"1/{group_size} shard; a disable with restore=True gathers them back instead)"
    )


def mark_released(tensors: list[torch.Tensor], why: str) -> None:
    """Remember that these tensors lost their bytes, and ``why`` (a clause after "lost their
    weights"; see [Note: what disable restores])."""
    for t in tensors:
        _RELEASED[id(t)] = (weakref.ref(t, functools.partial(_forget, id(t))), why)


RELEASED_OWNER = "dlo.released"
_RELEASED_HOOKS = HookRegistry(owner=RELEASED_OWNER)
"""Holds, for good, the refusal on blocks whose weights a disable released: the model is
not usable without dlo any more, so its forward says so (the hook dies with the module)."""


class _ReleasedBlock(ModelHook):
    def __init__(self, name: str, why: str, rank: int) -> None:
        self.name, self.why, self.rank = name, why, rank

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise OffloadError(
            f"this block lost its weights {self.why}: reload the model",
            rank=self.rank,
            block=self.name,
        )


def refuse_released_forward(blocks: list[tuple[str, nn.Module, str]], *, rank: int) -> None:
    """After a disable that released ``(name, module, why)`` blocks, their forward raises a
    dlo error instead of failing inside torch on an empty tensor."""
    for name, module, why in blocks:
        if RELEASED_OWNER not in {o for o, _ in HookRegistry.owners_on(module)}:
            _RELEASED_HOOKS.register(module, "released", _ReleasedBlock(name, why, rank))


def _forget(key: int, _ref: object) -> None:
    _RELEASED.pop(key, None)


def _released_why(t: torch.Tensor) -> str | None:
    entry = _RELEASED.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def check_not_released(named: list[tuple[str, torch.Tensor]], *, rank: int) -> None:
    """Refuse a model whose tensors a previous disable could not restore."""
    gone = [(name, why) for name, t in named if (why := _released_why(t)) is not None]
    if gone:
        raise OffloadError(
            f"{len(gone)} tensors (first: {', '.join(n for n, _ in gone[:4])}) lost their "
            f"weights {gone[0][1]}; reload the model before enabling again",
            rank=rank,
        )


LoadAllowed = Callable[[nn.Module, dict[str, Any], str], bool]
"""``allow(module, state_dict, prefix)``: whether a load may go on after all (an adapter's
own tensors during an adapter call: [Note: adapters while streaming])."""


def install_state_dict_hooks(
    registry: HookRegistry,
    module: nn.Module,
    name: str,
    layout: BlockLayout,
    shard: torch.Tensor | MappedBlock | EncodedShard | Callable[[], Any],
    tensors: Sequence[torch.Tensor],
    *,
    rank: int,
    copy: bool = False,
    allow: LoadAllowed | None = None,
    shapes_only: Callable[[], bool] | None = None,
) -> None:
    """Make ``module.state_dict()`` return real tensors (views of the host shard, or with
    ``host_backing="mapped"`` views of the checkpoint's private mapping, with a codec the
    block decoded into private memory; with ``copy``
    private copies, for a node-shared copy that an in-place edit would change under every
    rank of the node) instead of placeholders, and refuse ``load_state_dict`` while offload
    is enabled.

    With a group size above 1 the host holds only 1/G of the module, so ``state_dict`` raises.
    The returned views alias dlo's host memory; they stay valid after disable (the memory is
    released when the last view dies) but are not updated by anything. ``tensors`` are the
    module's Parameter and buffer objects in ``layout`` order: every name under which one of
    them is reachable gets its view (tied weights have several), and a name the user has
    since bound to another tensor keeps that tensor.
    """
    # weak, by identity: a replaced tensor may die and its id be reused
    index = {id(t): (i, weakref.ref(t)) for i, t in enumerate(tensors)}
    wrapped = {id(w.tensor): (w, weakref.ref(w.tensor)) for w in module_wrappers(module)}

    def state_dict_hook(mod: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        if shapes_only is not None and shapes_only():  # stubs: an adapter call reads shapes
            return
        if layout.group_size > 1:
            raise OffloadError(
                "state_dict() of a module streamed with AllGather is not available: this rank "
                f"holds 1/{layout.group_size} of it; save the weights from the checkpoint they "
                "were loaded from",
                rank=rank,
                block=name,
            )
        named = named_tensors(mod)
        raw: torch.Tensor | None = None  # an encoded block, decoded once per call
        # as it is now: a LoRA fuse encodes an encoded block again into a new host copy
        host = shard() if callable(shard) else shard

        def host_tensor(i: int) -> torch.Tensor:
            nonlocal raw
            if isinstance(host, MappedBlock):
                t = host.tensor(i)
            elif isinstance(host, EncodedShard):
                raw = host.raw() if raw is None else raw
                t = shard_view(raw, layout.tensors[i])  # private memory already
            else:
                t = shard_view(host, layout.tensors[i])
            return t.clone() if copy else t

        for local, t in named:
            key = prefix + local
            if key not in state_dict:
                continue
            i, ref = index.get(id(t), (-1, None))
            w, wref = wrapped.get(id(t), (None, None))
            if ref is not None and ref() is t:
                state_dict[key] = host_tensor(i)
            elif w is not None and wref is not None and wref() is t:  # [Note: tensor subclasses]
                state_dict[key] = w.rebuild(lambda x: host_tensor(index[id(x)][0]))

    registry.register_state_dict_hook(module, "dlo.state_dict", state_dict_hook)
    registry.register_load_state_dict_pre_hook(
        module, LOAD_REFUSAL, _refuse_load(name, rank, allow)
    )


LOAD_REFUSAL = "dlo.load_state_dict"


def _refuse_load(name: str, rank: int, allow: LoadAllowed | None = None) -> Any:
    def refuse_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        if allow is not None and allow(module, state_dict, prefix):
            return
        raise OffloadError(
            "load_state_dict() into a module dlo is offloading: disable offload first, load, "
            "then enable again",
            rank=rank,
            block=name,
        )

    return refuse_load


def install_load_refusal_on_ancestors(
    registry: HookRegistry,
    root: nn.Module,
    managed: Sequence[str],
    *,
    rank: int,
    allow: LoadAllowed | None = None,
) -> None:
    """Refuse ``load_state_dict`` on ``root`` and on every module containing one of the
    ``managed`` paths too, so that a refused load changes nothing: torch runs a module's
    load pre-hooks before it copies that module's own tensors and before its children, so
    without this a load from the root would overwrite the tensors it reaches before the first
    managed module. A module another mechanism manages (FSDP2's root under HSDP) is skipped:
    its hooks are its own."""
    for path in sorted(enclosing_paths(managed) - set(managed)):
        module = get_by_path(root, path)
        if isinstance(module, nn.Module) and foreign_offloader(module) is None:
            registry.register_load_state_dict_pre_hook(
                module, LOAD_REFUSAL, _refuse_load(path or type(root).__name__, rank, allow)
            )


def enclosing_paths(managed: Sequence[str]) -> set[str]:
    """The root (``""``) and every module path strictly above one of ``managed``."""
    out = {""}
    for path in managed:
        parts = path.split(".")
        out.update(".".join(parts[:k]) for k in range(1, len(parts)))
    return out


APPLY_REFUSAL = "dlo._apply"


def _refuse_apply(path: str, rank: int) -> Any:
    def refuse_apply() -> None:
        raise OffloadError(
            f"to() / half() / float() / cuda() / type() on {path!r}, which is or contains a "
            "module dlo is offloading: it would convert dlo's placeholders, not the weights "
            "dlo holds; disable dlo first (backend.disable()), convert, then enable again",
            rank=rank,
        )

    return refuse_apply


def install_apply_refusal(
    registry: HookRegistry, root: nn.Module, managed: Sequence[str], *, rank: int
) -> None:
    """Refuse ``Module._apply`` (behind ``to``, ``half``, ``float``, ``cuda``, ``type``) on
    every module that is, contains or lies inside one of the ``managed`` paths, before torch
    converts anything: torch converts a module's children first, so the refusal must sit on
    the module the user calls. dlo's own enable and disable rebind ``.data`` and never call
    ``_apply``. A module another mechanism manages is skipped (its hooks are its own)."""
    managed_set = set(managed)
    seen: set[int] = set()
    for path in sorted(enclosing_paths(managed) | managed_set):
        module = get_by_path(root, path)
        if not isinstance(module, nn.Module):
            continue
        inner = module.named_modules() if path in managed_set else [("", module)]
        for sub, m in inner:
            if id(m) in seen or foreign_offloader(m) is not None:
                continue
            seen.add(id(m))
            name = ".".join(p for p in (path, sub) if p) or type(root).__name__
            registry.register_apply_refusal(m, APPLY_REFUSAL, _refuse_apply(name, rank))
