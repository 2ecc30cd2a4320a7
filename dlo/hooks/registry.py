"""Named, owned, removable module hooks: the only dlo module that touches ``nn.Module`` hooks.

Backends never call ``register_forward_hook`` and friends themselves. They subclass
:class:`ModelHook` and register instances through a :class:`HookRegistry`, one registry per
backend instance, labelled with an *owner* name such as ``"dlo.layerwise"``. Every hook has a
name that is unique per (module, owner), so a backend can remove exactly what it installed
and nothing else: not another backend's hooks, not the user's, not a foreign offloader's.

Design, in the spirit of the diffusers hook registry but built on torch's hook handles:

* **No forward is replaced.** diffusers and accelerate rebind ``module.forward``; dlo only
  adds hook handles, so ``vars(module)`` after :meth:`HookRegistry.remove_all` is exactly what
  it was before the first registration, and whatever else wraps ``forward`` keeps working.
* **One dispatcher pair per module.** See [Note: one dispatcher pair per module].
* **No attribute on the module.** The per-module state (named hooks, torch handles, the stack
  of in-flight calls) lives in a module-level :class:`weakref.WeakKeyDictionary`; it dies with
  the module and nothing in it refers back to the module. The exceptions are instance
  attributes torch offers no hook for, each removed with what installed it: the refusal of
  ``Module._apply`` (:meth:`HookRegistry.register_apply_refusal`), and on a module with a
  forward hook the interposer in ``_compiled_call_impl`` and the ``compile`` shim that keep
  dlo's hooks outside compiled frames ([Note: hooks outside compiled frames] in
  :mod:`dlo.hooks.compiled`).
* **Not copyable.** What dlo leaves on a module refuses ``deepcopy`` and pickling with an
  :class:`~dlo.errors.OffloadError` saying to disable first.
* **One owner per module.** At most one strategy owns offload hooks: registering on a module
  that another registry (another backend, even of the same kind) or a foreign mechanism
  (accelerate, diffusers hooks, FSDP, DTensor parameters) already manages is refused with
  :class:`~dlo.errors.OffloadError` naming the other party. Foreign hooks are never touched.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from dlo.errors import OffloadError
from dlo.hooks.compiled import CompiledCall
from dlo.hooks.dispatch import (
    _APPLY,
    _FORWARD,
    _LOAD_STATE_DICT_PRE,
    _STATE_DICT,
    ModelHook,
    _ApplyHandle,
    _Callback,
    _Entry,
    _ModuleState,
    _names_of_hook,
    _rank,
    _remove_dispatchers,
)
from dlo.hooks.foreign import foreign_offloader
from dlo.journal import atomic

logger = logging.getLogger(__name__)


# Per-module state, keyed weakly by the module (see module docstring).
_STATES: weakref.WeakKeyDictionary[nn.Module, _ModuleState] = weakref.WeakKeyDictionary()


# id(ModelHook) -> state of the module it is registered on; enforces one module per hook.
# The state holds the hook, so a live entry always refers to the same hook object.
_HOOK_HOMES: weakref.WeakValueDictionary[int, _ModuleState] = weakref.WeakValueDictionary()


def _describe(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


# ----------------------------------------------------------------------------- registry
class HookRegistry:
    """Named hooks of one owner (one backend instance) over any number of modules.

    Args:
        owner: a label such as ``"dlo.layerwise"``, used in messages and by
            :meth:`owners_on`. Ownership itself is the registry object: two registries with
            the same label are still two owners.

    Raises:
        ValueError: ``owner`` is not a non-empty string.

    Example:
        >>> reg = HookRegistry("dlo.layerwise")
        >>> block = nn.Linear(4, 4)
        >>> reg.register(block, "stream", ModelHook())
        >>> reg.names_on(block)
        ['stream']
        >>> HookRegistry.owners_on(block)
        [('dlo.layerwise', 'stream')]
        >>> reg.remove(block, "stream"), reg.remove(block, "stream")
        (True, False)
        >>> reg.is_empty
        True
    """

    def __init__(self, owner: str) -> None:
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"HookRegistry owner must be a non-empty string, got {owner!r}")
        self._owner = owner
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    @property
    def owner(self) -> str:
        """The owner label given at construction."""
        return self._owner

    @property
    def is_empty(self) -> bool:
        """True when this registry has nothing registered on any live module."""
        return len(self._modules) == 0

    def __repr__(self) -> str:
        return f"HookRegistry(owner={self._owner!r}, num_modules={len(self._modules)})"

    # -- registration
    def register(self, module: nn.Module, name: str, hook: ModelHook) -> None:
        """Register ``hook`` on ``module`` under ``name``.

        Args:
            module: the module whose forward the hook wraps.
            name: unique per (module, owner) across forward and state-dict hooks.
            hook: a :class:`ModelHook` not registered on any module yet.

        Raises:
            TypeError: ``module`` is not an ``nn.Module`` or ``hook`` not a ``ModelHook``.
            ValueError: ``name`` is empty or already used by this owner on ``module``, or
                ``hook`` is already registered.
            OffloadError: another mechanism or another owner manages ``module``.

        Example:
            >>> reg = HookRegistry("example")
            >>> reg.register(nn.Linear(2, 2), "noop", ModelHook())
        """
        if not isinstance(hook, ModelHook):
            raise TypeError(f"hook must be a dlo.ModelHook, got {type(hook).__qualname__}")
        state = self._admit(module, name)
        home = _HOOK_HOMES.get(id(hook))
        if home is not None:
            raise ValueError(
                f"{type(hook).__qualname__} instance is already registered on a module "
                f"(as {_names_of_hook(home, hook)}); one ModelHook instance serves one module"
            )
        with atomic():  # registered and known to remove_all, or neither
            if state.pre_handle is None:
                state.pre_handle = module.register_forward_pre_hook(
                    state.dispatch_pre, prepend=True, with_kwargs=True
                )
                try:
                    state.post_handle = module.register_forward_hook(
                        state.dispatch_post, with_kwargs=True, always_call=True
                    )
                    # [Note: hooks outside compiled frames] in dlo.hooks.compiled
                    state.compiled = CompiledCall(module, state)
                except BaseException:
                    _remove_dispatchers(state)
                    raise
            state.entries.append(_Entry(self, name, _FORWARD, hook=hook))
            state.hooks = (*state.hooks, hook)
            _HOOK_HOMES[id(hook)] = state
            self._commit(module, state)
        logger.debug("%s: registered forward hook %r on %s", self._owner, name, _describe(module))

    def register_state_dict_hook(
        self, module: nn.Module, name: str, fn: Callable[[nn.Module, dict[str, Any], str], None]
    ) -> None:
        """Register ``fn(module, state_dict, prefix)`` to run after ``module.state_dict()``.

        It runs once the module has collected its own entries (keys start with ``prefix``) and
        may replace them in place, e.g. placeholders by real tensors. Its return value is
        ignored.

        Args:
            module: the module whose state-dict entries ``fn`` rewrites.
            name: unique per (module, owner) across forward and state-dict hooks.
            fn: the callback.

        Raises:
            TypeError: ``fn`` is not callable or ``module`` not an ``nn.Module``.
            ValueError: ``name`` is empty or already used by this owner on ``module``.
            OffloadError: another mechanism or another owner manages ``module``.

        Example:
            >>> reg = HookRegistry("example")
            >>> lin = nn.Linear(2, 2)
            >>> def zero(module, sd, prefix):
            ...     sd[prefix + "bias"] = torch.zeros(2)
            >>> reg.register_state_dict_hook(lin, "real_weights", zero)
            >>> lin.state_dict()["bias"].tolist()
            [0.0, 0.0]
        """
        if not callable(fn):
            raise TypeError(f"state-dict hook {name!r} must be callable, got {fn!r}")
        state = self._admit(module, name)

        # A fresh object per registration: torch marks hooks registered through the public
        # API with an attribute, and the same callable may serve several modules.
        state_dict_post_hook = _Callback(lambda mod, sd, prefix, _metadata: fn(mod, sd, prefix))
        public = getattr(module, "register_state_dict_post_hook", None)
        with atomic():
            if public is not None:
                handle = public(state_dict_post_hook)
            else:
                handle = module._register_state_dict_hook(state_dict_post_hook)
            state.entries.append(_Entry(self, name, _STATE_DICT, handle=handle))
            self._commit(module, state)
        logger.debug(
            "%s: registered state-dict hook %r on %s", self._owner, name, _describe(module)
        )

    def register_load_state_dict_pre_hook(
        self, module: nn.Module, name: str, fn: Callable[..., None]
    ) -> None:
        """Register ``fn`` to run before ``module`` loads its part of a state dict.

        ``fn`` is called as torch calls load-state-dict pre-hooks: ``fn(module, state_dict,
        prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)``. Raising
        from it refuses ``load_state_dict`` with that error.

        Args:
            module: the module being loaded.
            name: unique per (module, owner) across forward and state-dict hooks.
            fn: the callback.

        Raises:
            TypeError: ``fn`` is not callable or ``module`` not an ``nn.Module``.
            ValueError: ``name`` is empty or already used by this owner on ``module``.
            OffloadError: another mechanism or another owner manages ``module``.

        Example:
            >>> reg = HookRegistry("example")
            >>> lin = nn.Linear(2, 2)
            >>> def refuse(module, *args):
            ...     raise RuntimeError("disable offload before load_state_dict")
            >>> reg.register_load_state_dict_pre_hook(lin, "refuse_load", refuse)
        """
        if not callable(fn):
            raise TypeError(f"load-state-dict pre-hook {name!r} must be callable, got {fn!r}")
        state = self._admit(module, name)
        hook = _Callback(fn)
        public = getattr(module, "register_load_state_dict_pre_hook", None)
        with atomic():
            if public is not None:
                handle = public(hook)
            else:
                handle = module._register_load_state_dict_pre_hook(hook, with_module=True)
            state.entries.append(_Entry(self, name, _LOAD_STATE_DICT_PRE, handle=handle))
            self._commit(module, state)
        logger.debug(
            "%s: registered load-state-dict pre-hook %r on %s", self._owner, name, _describe(module)
        )

    def register_apply_refusal(
        self, module: nn.Module, name: str, fn: Callable[[], None], *, method: str = "_apply"
    ) -> None:
        """Make ``module._apply`` (behind ``to``, ``half``, ``float``, ``cuda``, ``type``...)
        call ``fn``, which is expected to raise, before anything is converted.

        torch has no hook for ``_apply``: the refusal is an instance attribute shadowing the
        method, removed again by :meth:`remove` (``vars(module)`` is then as before).
        ``Module._apply`` recurses through the children's ``_apply``, so a refusal on a child
        also stops a conversion started on any of its ancestors, but only once the ancestor's
        earlier children were converted: register it on the ancestors too.

        Args:
            module: the module to protect.
            name: unique per (module, owner) across every kind of hook.
            fn: called with no argument; raise from it to refuse.
            method: the method refused (default ``_apply``; dlo also refuses PEFT's adapter
                methods on a module whose blocks it streams).

        Raises:
            TypeError: ``fn`` is not callable or ``module`` not an ``nn.Module``.
            ValueError: ``name`` is empty or already used by this owner on ``module``.
            OffloadError: another mechanism or another owner manages ``module``.

        Example:
            >>> reg = HookRegistry("example")
            >>> lin = nn.Linear(2, 2)
            >>> def refuse():
            ...     raise RuntimeError("disable offload first")
            >>> reg.register_apply_refusal(lin, "refuse_apply", refuse)
            >>> reg.remove_all()
            1
        """
        if not callable(fn):
            raise TypeError(f"apply refusal {name!r} must be callable, got {fn!r}")
        self.register_method(module, name, method, lambda *args, **kwargs: fn())

    def register_method(
        self, module: nn.Module, name: str, method: str, fn: Callable[..., Any]
    ) -> None:
        """Shadow ``module.<method>`` with ``fn`` (called with the method's arguments) until
        removed: an instance attribute, as :meth:`register_apply_refusal` (dlo follows a
        DiT's ``enable_cache`` this way: :mod:`dlo.hooks.step_caches`)."""
        if not callable(fn):
            raise TypeError(f"method shadow {name!r} must be callable, got {fn!r}")
        state = self._admit(module, name)
        handle = _ApplyHandle(module, _Callback(fn), method)
        state.entries.append(_Entry(self, name, _APPLY, handle=handle))
        self._commit(module, state)

    def _admit(self, module: nn.Module, name: str) -> _ModuleState:
        """Check that ``name`` may be registered on ``module``; return its (new) state."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__qualname__}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"hook name must be a non-empty string, got {name!r}")
        mechanism = foreign_offloader(module)
        if mechanism is not None:
            raise OffloadError(
                f"{_describe(module)} is already managed by {mechanism}; {self._owner} refuses "
                f"to add hook {name!r} (at most one strategy owns offload hooks; remove the "
                f"other mechanism first, its hooks are left untouched)",
                rank=_rank(),
            )
        state = _STATES.get(module)
        if state is None:
            return _ModuleState()
        for entry in state.entries:
            if entry.owner is not self:
                other = entry.owner.owner
                same_label = (
                    " (another registry with the same owner name)" if other == self._owner else ""
                )
                raise OffloadError(
                    f"{_describe(module)} already has hooks of owner {other!r}{same_label}; "
                    f"{self._owner} refuses to add hook {name!r}: at most one strategy owns "
                    f"offload hooks on a module (disable the other backend first)",
                    rank=_rank(),
                )
            if entry.name == name:
                raise ValueError(
                    f"hook name {name!r} is already registered by {self._owner} on "
                    f"{_describe(module)}; remove it first or pick another name"
                )
        return state

    def _commit(self, module: nn.Module, state: _ModuleState) -> None:
        if _STATES.get(module) is not state:
            _STATES[module] = state
        self._modules.add(module)

    # -- removal and queries
    def remove(self, module: nn.Module, name: str) -> bool:
        """Remove this owner's hook ``name`` from ``module``; idempotent.

        Other owners' hooks, the user's hooks and foreign hooks are never touched. When the
        module has no dlo hook left, nothing of dlo remains on it.

        Args:
            module: the module the hook was registered on.
            name: the hook's name.

        Returns:
            True if a hook was removed, False if this owner had no hook of that name there.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.

        Example:
            >>> reg = HookRegistry("example")
            >>> lin = nn.Linear(2, 2)
            >>> reg.register(lin, "noop", ModelHook())
            >>> reg.remove(lin, "noop"), reg.remove(lin, "noop")
            (True, False)
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__qualname__}")
        state = _STATES.get(module)
        if state is None:
            return False
        entry = next((e for e in state.entries if e.owner is self and e.name == name), None)
        if entry is None:
            return False
        state.entries.remove(entry)
        if entry.handle is not None:
            entry.handle.remove()
        if entry.hook is not None:
            state.hooks = tuple(h for h in state.hooks if h is not entry.hook)
            _HOOK_HOMES.pop(id(entry.hook), None)
            if not state.hooks:
                _remove_dispatchers(state)
        if not state.entries:
            del _STATES[module]
        if not any(e.owner is self for e in state.entries):
            self._modules.discard(module)
        logger.debug("%s: removed hook %r from %s", self._owner, name, _describe(module))
        return True

    def remove_all(self) -> int:
        """Remove every hook this owner registered, on every module; idempotent.

        Returns:
            The number of hooks removed (0 when called again).

        Example:
            >>> reg = HookRegistry("example")
            >>> lin = nn.Linear(2, 2)
            >>> reg.register(lin, "noop", ModelHook())
            >>> reg.remove_all(), reg.remove_all()
            (1, 0)
        """
        num_removed = 0
        for module in list(self._modules):
            for name in reversed(self.names_on(module)):
                num_removed += self.remove(module, name)
        if num_removed:
            logger.debug("%s: removed %d hooks", self._owner, num_removed)
        return num_removed

    def names_on(self, module: nn.Module) -> list[str]:
        """This owner's hook names on ``module``, in registration order.

        Example:
            >>> HookRegistry("example").names_on(nn.Linear(2, 2))
            []
        """
        state = _STATES.get(module)
        if state is None:
            return []
        return [e.name for e in state.entries if e.owner is self]

    @staticmethod
    def owners_on(module: nn.Module) -> list[tuple[str, str]]:
        """``(owner, name)`` of every dlo hook on ``module``, in registration order.

        Example:
            >>> HookRegistry.owners_on(nn.Linear(2, 2))
            []
        """
        state = _STATES.get(module)
        if state is None:
            return []
        return [(e.owner.owner, e.name) for e in state.entries]
