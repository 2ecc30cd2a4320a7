"""Step caches on a model dlo streams: diffusers' FirstBlockCache, MagCache, SeaCache,
TaylorSeer, PyramidAttentionBroadcast and FasterCache, attached before or after enable.

[Note: loads inside step caches]
A step cache skips a block by not calling the forward it wraps (its hook is part of
diffusers' forward chain, ``module.forward``), while dlo's ring hook is a torch forward hook
around the whole call: left there, every block a cache skips would still be loaded. On a ring
of its own (group size 1) dlo therefore moves its ring hook *inside* the cache's chain while a
cache is enabled: a diffusers hook registered on each streamed block before the cache's hooks,
so the cache wraps it, and a block the cache skips is never entered, loaded or prefetched for
again (the ring keeps the blocks that ran: [Note: kept after exit] in
:mod:`dlo.runtime.ring`). The DiT's ``enable_cache`` / ``disable_cache`` are shadowed while dlo
is enabled so the move follows them; a cache enabled before enable is taken off and put back
around dlo's hooks at enable, and at disable the same the other way (diffusers removes an inner
hook of a chain by relinking the hook after it, which a cache hook calling its
``original_forward`` never sees: it would keep calling dlo's removed hook).

Where the blocks gather (AllGather, group size > 1), every rank must load the same blocks in
the same order whatever its cache decides (the caches decide per rank, from its own
activations): there the ring hook stays outside and loads every block, so a skip saves compute
but no transfer, never a collective out of step. cache-dit skips a block by not calling it
at all (its wrappers call the blocks they run): on a ring of its own that needs nothing from
dlo (a block not called is not loaded), and where blocks gather it is refused, at enable or at
the DiT's first forward after it was applied.

A torch forward pre-hook on each block moved inside counts the block's calls, so the blocks a
cache skipped are ``calls - runs`` (``stats()["num_skipped_blocks"]``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dlo.errors import OffloadError, refuse_in_forward
from dlo.hooks.dispatch import ModelHook
from dlo.hooks.foreign import INNER_RING_HOOK as INNER_HOOK
from dlo.hooks.registry import HookRegistry

logger = logging.getLogger(__name__)

CALLS_HOOK = "dlo.calls"


@dataclass(eq=False)
class CachedBlock:
    """A streamed block whose ring hook follows the DiT's step cache."""

    module: nn.Module
    hook: ModelHook
    """Its ring hook (:class:`dlo.runtime.ring._BlockHook`)."""
    calls: int = 0
    """Calls while the hook was inside a cache's chain (a skipped call included)."""
    runs: int = 0
    """Of those, the calls that ran the block (entered the ring)."""


@dataclass(eq=False)
class StepCaches:
    """The DiTs whose step caches dlo's ring hooks follow, for one enable (see [Note: loads
    inside step caches])."""

    registry: HookRegistry
    ring_hook_name: str
    busy: Callable[[], bool]
    """Whether a block forward runs now (no hook moves then)."""
    rank: int = 0
    dits: dict[int, tuple[nn.Module, list[CachedBlock], bool]] = field(default_factory=dict)
    """id(DiT) -> (the DiT, its streamed blocks, whether its hooks may go inside)."""
    inside: set[int] = field(default_factory=set)

    def manage(
        self, dit: nn.Module, blocks: list[tuple[nn.Module, ModelHook]], *, inner: bool
    ) -> None:
        """Follow ``dit``'s step cache (a diffusers ``CacheMixin``); ``inner``: its blocks'
        loads may go inside the cache's chain (a ring of its own)."""
        if not inner:  # cache-dit skips blocks by not calling them: per rank, so refused
            self._refuse_cache_dit(dit)
            self.registry.register(dit, "dlo.cache_dit", _CacheDitGuard(self._refuse_cache_dit))
        if not callable(getattr(type(dit), "enable_cache", None)):
            return
        cached = [CachedBlock(m, h) for m, h in blocks]
        self.dits[id(dit)] = (dit, cached, inner)
        self.registry.register_method(
            dit, "dlo.enable_cache", "enable_cache", functools.partial(self.enable_cache, dit)
        )
        self.registry.register_method(
            dit, "dlo.disable_cache", "disable_cache", functools.partial(self.disable_cache, dit)
        )
        config = getattr(dit, "_cache_config", None)
        if config is not None and inner:  # enabled before dlo: put back around dlo's hooks
            _real(dit, "disable_cache")
            try:
                self.enable_cache(dit, config)
            except BaseException:
                if getattr(dit, "_cache_config", None) is None:  # the user's cache, as it was
                    _real(dit, "enable_cache", config)
                raise

    def enable_cache(self, dit: nn.Module, config: Any) -> None:
        """``dit.enable_cache(config)`` while dlo streams its blocks."""
        _, blocks, inner = self.dits[id(dit)]
        if inner and getattr(dit, "_cache_config", None) is None:
            refuse_in_forward(self.busy(), "enable_cache", self.rank)
            try:
                self._move_inside(dit, blocks)
                _real(dit, "enable_cache", config)
            except BaseException:
                if getattr(dit, "_cache_config", None) is not None:  # its hooks outside dlo's
                    _real(dit, "disable_cache")
                self._move_outside(dit, blocks)
                raise
            return
        _real(dit, "enable_cache", config)

    def disable_cache(self, dit: nn.Module) -> None:
        """``dit.disable_cache()`` while dlo streams its blocks."""
        _, blocks, _ = self.dits[id(dit)]
        if id(dit) in self.inside:
            refuse_in_forward(self.busy(), "disable_cache", self.rank)
        try:
            _real(dit, "disable_cache")
        finally:  # dlo's inner hooks are the last of their chains only with the cache off
            if id(dit) in self.inside and getattr(dit, "_cache_config", None) is None:
                self._move_outside(dit, blocks)

    def close(self) -> None:
        """At disable, before dlo's hooks go: each cache taken off dlo's inner hooks and put
        back on the blocks alone (the user's cache outlives dlo)."""
        for key, (dit, blocks, _) in self.dits.items():
            config = getattr(dit, "_cache_config", None)
            if key in self.inside:
                _real(dit, "disable_cache")
                self._move_outside(dit, blocks, restore_hooks=False)
                if config is not None:
                    _real(dit, "enable_cache", config)
        self.dits.clear()
        self.busy = _never  # it held the scheduler, which holds this: no cycle is left

    def stats(self) -> dict[str, int]:
        blocks = [b for _, bs, _ in self.dits.values() for b in bs]
        return {
            "num_skipped_blocks": sum(b.calls - b.runs for b in blocks),
            "num_cache_inner_blocks": sum(
                len(bs) for key, (_, bs, _) in self.dits.items() if key in self.inside
            ),
        }

    def _refuse_cache_dit(self, dit: nn.Module) -> None:
        """cache-dit on a DiT whose blocks gather: each rank would skip by its own residuals
        and the ranks' gathers would part (the lock-step check would end the run): refused
        at enable, and at the DiT's forward when it was applied after."""
        if getattr(dit, "_is_cached", False):
            raise OffloadError(
                f"cache-dit is enabled on {type(dit).__name__}, whose blocks dlo gathers across "
                "ranks (AllGather or node-shared): cache-dit decides per rank which blocks to "
                "call, and every rank must gather the same blocks. Use a diffusers cache "
                "(transformer.enable_cache(...): every block is loaded, the skipped ones not "
                "computed), or rank-local transfer, where cache-dit's skipped blocks load nothing",
                rank=self.rank,
            )

    # ------------------------------------------------------------------ moving
    def _move_inside(self, dit: nn.Module, blocks: list[CachedBlock]) -> None:
        """Each block's ring hook into its diffusers chain (idempotent: a move cut short is
        finished or undone by :meth:`_move_outside`)."""
        from diffusers.hooks import HookRegistry as DiffusersRegistry

        self.inside.add(id(dit))  # first: close() undoes a move cut short
        for b in blocks:
            chain = DiffusersRegistry.check_if_exists_or_initialize(b.module)
            if INNER_HOOK in chain.hooks:
                continue
            self.registry.remove(b.module, self.ring_hook_name)
            if CALLS_HOOK not in self.registry.names_on(b.module):
                self.registry.register(b.module, CALLS_HOOK, _Calls(b))
            chain.register_hook(_inner_class()(b), INNER_HOOK)

    def _move_outside(
        self, dit: nn.Module, blocks: list[CachedBlock], *, restore_hooks: bool = True
    ) -> None:
        """Called with the cache off, so dlo's inner hook is the last of each chain and
        diffusers unlinks it cleanly (a hook registered after it would keep calling it through
        its ``original_forward``). Idempotent."""
        for b in blocks:
            chain = getattr(b.module, "_diffusers_hook", None)
            if chain is not None and INNER_HOOK in chain.hooks:
                chain.remove_hook(INNER_HOOK, recurse=False)
            self.registry.remove(b.module, CALLS_HOOK)
            if restore_hooks and self.ring_hook_name not in self.registry.names_on(b.module):
                self.registry.register(b.module, self.ring_hook_name, b.hook)
        self.inside.discard(id(dit))


def _never() -> bool:
    return False


def _real(dit: nn.Module, method: str, *args: Any) -> Any:
    """The DiT class's own ``method`` (the instance's is dlo's shadow while enabled)."""
    return getattr(type(dit), method)(dit, *args)


class _CacheDitGuard(ModelHook):
    """Before a DiT forward where blocks gather: refuse cache-dit applied since enable."""

    def __init__(self, check: Callable[[nn.Module], None]) -> None:
        self.check = check

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.check(module)


class _Calls(ModelHook):
    """Counts a block's calls (outside every diffusers hook: skipped ones too)."""

    def __init__(self, block: CachedBlock) -> None:
        self.block = block

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.block.calls += 1
        return None


@torch.compiler.disable
def _enter(block: CachedBlock, module: nn.Module, args: tuple, kwargs: dict) -> None:
    block.hook.pre_forward(module, args, kwargs)
    block.runs += 1


@torch.compiler.disable
def _leave(block: CachedBlock, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    return block.hook.post_forward(module, args, kwargs, output)


_INNER: list[type] = []


def _inner_class() -> type:
    """dlo's ring hook as a diffusers hook (its ``new_forward`` runs the block between the
    ring's enter and exit): one class for every block, so compiled blocks share their
    frames' guards (a class per block recompiled every block)."""
    if _INNER:
        return _INNER[0]
    from diffusers.hooks.hooks import ModelHook as DiffusersHook

    class InnerRingHook(DiffusersHook):  # type: ignore[misc]
        _is_stateful = False

        def __init__(self, block: CachedBlock) -> None:
            super().__init__()
            self.block = block

        def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            _enter(self.block, module, args, kwargs)
            try:
                output = self.fn_ref.original_forward(*args, **kwargs)  # type: ignore[misc]
            except BaseException:
                _leave(self.block, module, args, kwargs, None)
                raise
            return _leave(self.block, module, args, kwargs, output)

    _INNER.append(InnerRingHook)
    return InnerRingHook
