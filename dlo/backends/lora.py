"""PEFT adapters (LoRA) loaded, switched and removed while dlo streams a model's blocks.

[Note: adapters while streaming]
An adapter call (diffusers' ``load_lora_weights`` / ``load_lora_adapter``,
``unload_lora_weights``, ``delete_adapters``, PEFT's ``add_adapter``) wraps the blocks'
linear layers in PEFT layers whose ``base_layer`` is the original module, so the Parameter
objects dlo rebinds stay the same objects and the blocks keep streaming. Four things would
still go wrong with a streamed block's empty placeholders, and dlo handles each for the
duration of the call:

- diffusers reads the base weights' shapes (Flux's check for LoRAs that widen a layer would
  "expand" a placeholder's zero width into a new layer): every streamed tensor that holds its
  placeholder holds a *stub* instead, one element expanded to the tensor's real shape, dtype
  and device (a write into it fails: no call may write block weights that way);
- PEFT puts each adapter on its base layer's device and dtype: the stub's, so an adapter of a
  streamed block is created on the compute device, where it stays (the adapter's bytes are
  small beside the block's, and a block's layout is fixed at enable; an adapter loaded before
  enable is part of its block and streams with it);
- diffusers reads ``state_dict()`` for those shapes (twice a load): during an adapter call a
  streamed block's ``state_dict`` holds the stubs, not its host copy (nothing is decoded or
  copied; a rank that holds 1/N of a gathered block refuses it outside adapter calls);
- PEFT loads the adapter's tensors with ``load_state_dict``, which dlo refuses on the modules
  it streams: during an adapter call a load is allowed when none of its keys names a tensor
  that was in the model at enable (the new adapter's keys only).

Outside adapter calls the refusals stand. A call that fails takes the adapters it added off
again (a LoRA that also writes a block's norms, Flux Control's, is refused by its keys after
its adapter layers went in); every block's weights must still be reachable in it before and
after a call (a loader that replaced a layer, reading a placeholder outside a shadowed
method, is an error naming the block). At disable, once the base weights are back where they
were, the adapters made while enabled follow them (a journal step deferred to the end).

Where blocks gather (AllGather, node-shared) the same holds rank by rank: an adapter loaded
while enabled is the rank's own (on the device, not in a block's layout), so ranks may serve
different adapters, as they serve different prompts, and their gathers stay in step (the
blocks and their order do not change; re-planning, which could, is off where blocks gather).
An adapter loaded before enable is in its block's layout: the startup agreement refuses ranks
whose layouts differ.

``fuse_lora`` / ``unfuse_lora`` write the base weights, which live in dlo's host copies: the
backend runs PEFT's merge block by block on real tensors and writes the host copies back
([Note: fusing while streaming] in :mod:`dlo.backends.lora_fuse`); blocks whose host copy
cannot be rewritten (encoded, mapped, node-shared, gathered) refuse it by name. Refused while
enabled, naming what to do instead: hotswap (``hotswap=True``, ``enable_lora_hotswap``: it
copies into the old adapter's tensors, which may be a block's); adapters made from the base
weights' values (DoRA, PiSSA, OLoRA, CorDA, LoftQ, EVA inits). ``set_adapters``,
``enable_lora`` and ``disable_lora`` only change scales and flags and are never wrapped.
Adapter calls run between pipeline calls, from the thread that runs them (one inside a block
forward is refused; dlo takes no lock against other threads).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dlo.backends.lora_fuse import BlockFuse, is_tuner, unguard
from dlo.errors import OffloadError, refuse_in_forward
from dlo.hooks.foreign import foreign_offloader
from dlo.hooks.registry import HookRegistry
from dlo.journal import Journal
from dlo.plan.checks import named_tensors
from dlo.plan.declarations import get_by_path
from dlo.plan.layout import TensorSpec
from dlo.runtime.streamed import StreamedBlock

ADAPTER_CALLS = (
    "load_lora_adapter",
    "add_adapter",
    "load_adapter",
    "unload_lora",
    "delete_adapters",
    "delete_adapter",
)
"""A model's PEFT methods that add or remove adapter layers (diffusers' ``PeftAdapterMixin``,
transformers' PEFT integration): run while streaming, inside :meth:`AdapterCalls.call`."""

FUSE_CALLS = ("fuse_lora", "unfuse_lora")
"""Methods that write the base weights: run block by block, the host copies rewritten
([Note: fusing while streaming] in :mod:`dlo.backends.lora_fuse`; refused by name on a
block whose host copy cannot be)."""

REFUSED_CALLS = ("enable_lora_hotswap",)
"""Refused while enabled: hotswap copies into tensors that may be a block's (an adapter
loaded before enable streams with its block)."""

PIPELINE_CALLS = ("load_lora_weights", "unload_lora_weights", "delete_adapters")
"""A diffusers pipeline's LoRA methods that reach the components' :data:`ADAPTER_CALLS`
after reading base weight shapes."""

WEIGHT_FREE_INITS = (True, False, "gaussian")
"""PEFT ``init_lora_weights`` values that never read the base weights (the others, PiSSA,
OLoRA, CorDA, LoftQ, EVA, ..., decompose them)."""


def stub(spec: TensorSpec, device: torch.device) -> torch.Tensor:
    """One element of ``spec``'s dtype on ``device``, expanded to ``spec``'s shape."""
    one = torch.empty((1,) * len(spec.shape), dtype=spec.dtype, device=device)
    return one.expand(spec.shape)


class AdapterCalls:
    """Adapter calls on a model whose blocks stream (see [Note: adapters while streaming])."""

    def __init__(
        self,
        streamed: Callable[[], Sequence[StreamedBlock]],
        device: torch.device,
        *,
        busy: Callable[[], bool],
        rank: int,
        fuser: BlockFuse | None = None,
    ) -> None:
        self.streamed, self.device, self.busy, self.rank = streamed, device, busy, rank
        self.fuser = fuser
        self.fusing = False
        """A fuse or unfuse runs: the adapter layers' merges go to :attr:`fuser` (None: no
        block of the model can be fused, and a fuse is refused)."""
        self.depth = 0
        self.known: set[int] = set()
        """ids of the tensors in the model at enable (a load naming one stays refused)."""
        self.modules: list[nn.Module] = []
        """The modules whose adapter methods are shadowed (those enclosing streamed blocks)."""

    # ------------------------------------------------------------------ install
    def install(
        self, registry: HookRegistry, root: Any, paths: Sequence[str], journal: Journal
    ) -> None:
        """Wrap the adapter methods of every module at ``paths`` (those enclosing a streamed
        block), and on a pipeline that is not a module its :data:`PIPELINE_CALLS`; the
        :data:`REFUSED_CALLS` refused. At disable, after everything else is given back,
        adapters created while enabled follow their base layers (:meth:`send_home`)."""
        if not isinstance(root, nn.Module):
            for method in PIPELINE_CALLS + FUSE_CALLS + REFUSED_CALLS:
                if callable(getattr(type(root), method, None)):
                    _PipelineShadow(
                        root, method, self._shadow(type(root).__name__, method)
                    ).install(journal)
        seen: set[int] = set()
        for path in sorted(paths):
            module = get_by_path(root, path)
            if not isinstance(module, nn.Module) or foreign_offloader(module) is not None:
                continue
            if id(module) in seen:  # one module under two paths
                continue
            seen.add(id(module))
            self.modules.append(module)
            self.known.update(id(t) for t in _tensors(module))
            name = path or type(root).__name__
            for method in ADAPTER_CALLS + FUSE_CALLS + REFUSED_CALLS:
                if callable(getattr(type(module), method, None)):
                    real = functools.partial(getattr(type(module), method), module)
                    registry.register_method(
                        module,
                        f"dlo.{method}",
                        method,
                        functools.partial(self._shadow(name, method), real),
                    )
        self._guard_merges()
        journal.record("merge guards", lambda: unguard(self._tuners()))
        journal.defer("adapters home", self.send_home)

    def _shadow(self, name: str, method: str) -> Callable[..., Any]:
        """``fn(real, *args, **kwargs)``: ``real`` inside :meth:`call`, or the refusal."""

        def shadow(real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if method in REFUSED_CALLS or kwargs.get("hotswap"):
                why = "hotswap" if kwargs.get("hotswap") else method
                raise OffloadError(_refusal(name, method, why), rank=self.rank)
            if method in ("add_adapter", "load_adapter"):
                config = kwargs.get("adapter_config", kwargs.get("peft_config"))
                self._check_config(name, method, config if config is not None else args[:1])
            with self.call(method):
                if method in FUSE_CALLS and not self.fusing:  # block by block
                    if self.fuser is None:
                        raise OffloadError(
                            f"{method}() on {name!r}: no fusing here (fuse before enabling)",
                            rank=self.rank,
                        )
                    self.fusing = True
                    try:
                        return self.fuser.run(self.modules, method, lambda: real(*args, **kwargs))
                    finally:
                        self.fusing = False
                return real(*args, **kwargs)

        return shadow

    def _check_config(self, name: str, method: str, config: Any) -> None:
        """Refuse a PEFT config whose adapters are made from the base weights' values."""
        config = config[0] if isinstance(config, tuple) and config else config
        init = getattr(config, "init_lora_weights", True)
        if getattr(config, "use_dora", False) or init not in WEIGHT_FREE_INITS:
            what = "DoRA" if getattr(config, "use_dora", False) else f"init_lora_weights={init!r}"
            raise OffloadError(_refusal(name, method, what), rank=self.rank)

    # ------------------------------------------------------------------ calls
    @contextlib.contextmanager
    def call(self, method: str) -> Iterator[None]:
        """An adapter call: streamed tensors hold stubs, loads of new keys are allowed; a
        call that fails takes the adapters it added off again; at the end placeholders are
        back, every new adapter tensor of a streamed block is on the device, and every
        block's weights are still reachable in it."""
        outer = self.depth == 0
        if outer:
            refuse_in_forward(self.busy(), method, self.rank)
        stubbed: list[tuple[torch.Tensor, torch.Tensor]] = []
        before: dict[int, set[str]] = {}
        if outer:
            self._check_intact(method)
            before = self._adapter_names()
            for b in self.streamed():
                for t, spec, ph in zip(b.tensors, b.layout.tensors, b.placeholders):
                    if t.numel() == 0 and _plain(t):
                        t.data = stub(spec, self.device)
                        stubbed.append((t, ph))
        self.depth += 1
        try:
            yield
            if outer:
                dora = self._new_dora(before)
                if dora:
                    raise OffloadError(_refusal(method, method, "DoRA"), rank=self.rank)
        except BaseException:
            if outer:
                self._take_off_new(before)
            raise
        finally:
            self.depth -= 1
            for t, ph in stubbed:
                t.data = ph
            if outer:
                self._settle()
        if outer:
            self._check_intact(method)

    def active(self) -> bool:
        """Whether an adapter call runs (streamed tensors hold stubs)."""
        return self.depth > 0

    def allows_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> bool:
        """Whether a ``load_state_dict`` reaching ``module`` may go on: inside an adapter
        call, when no key it would load names a tensor the model had at enable (one that
        does is refused naming the keys: a LoRA that replaces base weights, Flux Control's
        norms for one)."""
        if self.depth == 0:
            return False
        named = [prefix + n for n, t in named_tensors(module) if id(t) in self.known]
        touched = [k for k in named if k in state_dict]
        if touched:
            raise OffloadError(
                f"an adapter load would write {touched[:3]} (weights dlo streams, not adapter "
                "tensors; a Flux Control LoRA's norms, for one): load it before enabling",
                rank=self.rank,
            )
        return True

    # ------------------------------------------------------------------ internals
    def _tuners(self) -> Iterator[nn.Module]:
        """PEFT's adapter layers under the shadowed modules."""
        for root in self.modules:
            yield from (m for m in root.modules() if is_tuner(m))

    def _adapter_names(self) -> dict[int, set[str]]:
        """Adapter names per shadowed module (its ``peft_config``) and per adapter layer."""
        out = {id(m): set(getattr(m, "peft_config", {}) or {}) for m in self.modules}
        for t in self._tuners():
            out[id(t)] = set(_layer_adapters(t))
        return out

    def _take_off_new(self, before: dict[int, set[str]]) -> None:
        """Delete the adapters added since ``before`` (a failed call leaves none behind)."""
        for m in self.modules:
            new = sorted(set(getattr(m, "peft_config", {}) or {}) - before.get(id(m), set()))
            delete = getattr(type(m), "delete_adapters", None)
            if new and delete is not None:
                try:
                    delete(m, new)
                except Exception:  # the layers below are cleared one by one next
                    pass
        for t in self._tuners():
            for name in sorted(set(_layer_adapters(t)) - before.get(id(t), set())):
                t.delete_adapter(name)  # type: ignore[operator]

    def _new_dora(self, before: dict[int, set[str]]) -> list[str]:
        """Adapters added since ``before`` that are DoRA (made from base weight values)."""
        return [
            name
            for t in self._tuners()
            for name in set(_layer_adapters(t)) - before.get(id(t), set())
            if getattr(t, "use_dora", {}).get(name)
        ]

    def _guard_merges(self) -> None:
        if self.fuser is not None:
            self.fuser.guard(self.modules, lambda: self.fusing)

    def _settle(self) -> None:
        """Every adapter tensor of a streamed block that is not a block tensor onto the
        device (where PEFT put it already, unless it was created elsewhere); the adapter
        layers' merges guarded."""
        self._guard_merges()
        for b in self.streamed():
            held = {id(t) for t in b.tensors}
            for t in _tensors(b.module):
                if id(t) not in held and t.device != self.device:
                    t.data = t.data.to(self.device)

    def _check_intact(self, method: str) -> None:
        """Every streamed block's weights (its adapters' aside) still reachable in it: a
        call that replaced a layer holding one (diffusers' Flux shape check reading a
        placeholder when it was not called through a shadowed pipeline method) is an error
        naming the layer."""
        for b in self.streamed():
            reachable = {id(t) for t in _tensors(b.module)}
            lost = [
                spec.name
                for spec, t in zip(b.layout.tensors, b.tensors)
                if id(t) not in reachable and not _is_adapter(spec.name)
            ]
            if lost:
                raise OffloadError(
                    f"{method}(): block {b.name!r} no longer holds {lost[:3]}: a layer dlo "
                    "streams was replaced while enabled (diffusers' Flux LoRA loader widens "
                    "layers whose weights look empty: call pipe.load_lora_weights on the "
                    "pipeline dlo was enabled on, or transformer.load_lora_adapter). The "
                    "model is changed: disable and reload it",
                    rank=self.rank,
                    block=b.name,
                )

    def send_home(self) -> None:
        """At disable, once the base weights are back where they were: every adapter tensor
        created while enabled moves to its base layer's device."""
        for t in self._tuners():
            base = next(t.get_base_layer().parameters(), None)  # type: ignore[operator]
            if base is None:
                continue
            for name, x in named_tensors(t):
                new = not name.startswith("base_layer.") and id(x) not in self.known
                if new and x.device != base.device:
                    x.data = x.data.to(base.device)


def _layer_adapters(t: nn.Module) -> Iterator[str]:
    for attr in getattr(t, "adapter_layer_names", ()):
        layer = getattr(t, attr, None)
        if isinstance(layer, (nn.ModuleDict, nn.ParameterDict)):
            yield from layer.keys()


def _is_adapter(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return (t for _, t in named_tensors(module))


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def _refusal(path: str, method: str, why: str) -> str:
    if why in ("hotswap", "enable_lora_hotswap"):
        return (
            f"{method}() on {path!r} with hotswap while dlo streams its blocks: a hotswap "
            "copies into the old adapter's tensors, which may be a block's. Load the new "
            "adapter under a new name and delete_adapters() the old one, or hotswap before "
            "enabling"
        )
    return (
        f"{method}() on {path!r} with {why} while dlo streams its blocks: such an adapter is "
        "made from the base weights' values, which are in dlo's host shards. Create it "
        "before enabling (it then streams with its block)"
    )


class _PipelineShadow:
    """A pipeline's LoRA method shadowed (an instance attribute) while this backend streams.
    Two backends on one pipeline stack theirs; a shadow taken off out of order goes inactive
    (it then calls what it shadowed, and holds nothing of its backend), is skipped by every
    later call and removal, so none outlives its backend and none is removed by the other's
    disable."""

    def __init__(self, root: Any, method: str, shadow: Callable[..., Any]) -> None:
        self.root, self.method, self.active = root, method, True
        self.shadow: Callable[..., Any] | None = shadow
        self.previous = _live(vars(root).get(method))

    def _inner(self, *args: Any, **kwargs: Any) -> Any:
        previous = _live(self.previous)
        if previous is not None:
            return previous(*args, **kwargs)
        return getattr(type(self.root), self.method)(self.root, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.active and self.shadow is not None:
            return self.shadow(self._inner, *args, **kwargs)
        return self._inner(*args, **kwargs)

    def install(self, journal: Journal) -> None:
        vars(self.root)[self.method] = self
        journal.record(f"shadow {self.method}", self.remove)

    def remove(self) -> None:
        self.active, self.shadow = False, None
        state = vars(self.root)
        if state.get(self.method) is self:
            previous = _live(self.previous)
            if previous is None:
                del state[self.method]
            else:
                state[self.method] = previous


def _live(method: Any) -> Any:
    """``method``, past any shadow already taken off."""
    while isinstance(method, _PipelineShadow) and not method.active:
        method = method.previous
    return method
