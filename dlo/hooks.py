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
  the module and nothing in it refers back to the module. The one exception is the refusal of
  ``Module._apply`` (:meth:`HookRegistry.register_apply_refusal`), which torch offers no hook
  for: an instance attribute while registered, removed with it.
* **Not copyable.** What dlo leaves on a module refuses ``deepcopy`` and pickling with an
  :class:`~dlo.errors.OffloadError` saying to disable first.
* **One owner per module.** At most one strategy owns offload hooks: registering on a module
  that another registry (another backend, even of the same kind) or a foreign mechanism
  (accelerate, diffusers hooks, FSDP, DTensor parameters) already manages is refused with
  :class:`~dlo.errors.OffloadError` naming the other party. Foreign hooks are never touched.

[Note: one dispatcher pair per module]
The first named hook on a module installs exactly two torch hooks: a forward pre-hook
(``with_kwargs=True, prepend=True``: dlo runs before the user's pre-hooks, so weights are
materialized before anyone looks at them) and a forward hook (``with_kwargs=True,
always_call=True``: torch also calls it when the forward raised, which is what lets a backend
release a slot on the error path). Both dispatch to the named :class:`ModelHook` objects of the
module in registration order (pre) and reverse registration order (post). Removing the last
named forward hook removes both handles. State-dict and load-state-dict hooks are plain torch
handles kept under the same names.

[Note: pairing pre and post calls]
A post-hook must run exactly for the calls whose pre-hook ran, with the hooks that were
entered in that call, even when the module is called re-entrantly (recursion, a block reused
inside itself) or torch calls the post-hook on an error path where dlo's pre-hook never ran
(an earlier pre-hook raised). Each pre-dispatch pushes a call frame ``(caller_id, parent_id,
hooks)`` onto the module's stack, where ``caller_id`` is the id of the Python frame that
invoked the pre-hook (torch's call implementation) and ``parent_id`` that of its caller. On the
normal path torch calls the post-hook from the same Python frame as the pre-hook; on the error
path from its parent. The post-dispatch searches the stack from the top for its frame, so it
pairs correctly with recursion and even with two threads, and tells the error path (output
``None``, return value ignored) from the normal path without guessing. When no frame matches:
on an error path the pre-hook did not run, so there is nothing to undo; otherwise (a call
structure the ids cannot see, e.g. a compiler frame in between) the most recent frame is used,
which is right for properly nested calls. Live Python frames have distinct ids, so a match is
never ambiguous.

Only the hooks whose ``pre_forward`` completed get ``post_forward``. When a ``pre_forward``
raises, the ones before it get ``post_forward(..., output=None)`` immediately (reverse order)
and the exception propagates unchanged. When a ``post_forward`` raises on the normal path, the
remaining (earlier-registered) hooks still get ``post_forward(..., output=None)`` before the
exception propagates. Exceptions raised by ``post_forward`` while unwinding are logged and
swallowed, so the original exception always reaches the caller as the same object.

[Note: removal while a call is in flight]
Removal takes effect at once: a hook removed while its module is running (by a hook, or by a
backend's ``disable`` from inside a forward) receives no further call, not even the
``post_forward`` of the call in flight, so a backend may free what its hooks use as soon as
``remove`` returns. Each call frame keeps the tuple of hooks it started with; the dispatchers
drop the removed ones when the module's tuple is no longer that same object, which costs one
identity check per hook on the hot path. Hooks registered during a call join from the next call.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo.errors import OffloadError

logger = logging.getLogger(__name__)

__all__ = [
    "HookRegistry",
    "ModelHook",
    "call_ended",
    "find_foreign_offloaders",
    "foreign_offloader",
    "module_call_frame",
]

_FORWARD = "forward"
_STATE_DICT = "state_dict"
_LOAD_STATE_DICT_PRE = "load_state_dict_pre"
_APPLY = "apply"


def _copy_refused() -> OffloadError:
    return OffloadError(
        "copy.deepcopy / pickle / torch.save of a module dlo is offloading (or of one "
        "containing it): its streamed tensors are placeholders and its hooks belong to the "
        "running backend; disable dlo first (backend.disable()), then copy or save",
        rank=_rank(),
    )


class _NotCopyable:
    """What dlo leaves on a module while enabled refuses deepcopy and pickling (torch.save
    pickles too) with a clear error, instead of an obscure one from a lock or a closure."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise _copy_refused()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _copy_refused()


class ModelHook:
    """Callbacks run around a module's forward; subclass and override.

    One instance may be registered on one module at a time (it may be registered again after
    it was removed). The module, positional and keyword arguments are passed as torch passes
    them to forward hooks.

    Example:
        >>> class AddOne(ModelHook):
        ...     def post_forward(self, module, args, kwargs, output):
        ...         return output + 1
        >>> reg = HookRegistry("example")
        >>> lin = nn.Linear(2, 2)
        >>> reg.register(lin, "add_one", AddOne())
        >>> reg.remove_all()
        1
    """

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Run before ``module.forward`` (and before the user's forward pre-hooks).

        Args:
            module: the module about to run.
            args: positional arguments (possibly rewritten by an earlier hook).
            kwargs: keyword arguments (possibly rewritten by an earlier hook).

        Returns:
            ``None`` to leave the arguments unchanged, or a new ``(args, kwargs)`` pair.
        """
        return None

    def post_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Run after ``module.forward``, also when it (or a later pre-hook) raised.

        Called only if this hook's ``pre_forward`` completed in the same call. On an error
        path ``output`` is ``None``, the return value is ignored and the original exception
        propagates unchanged afterwards.

        Args:
            module: the module that ran.
            args: positional arguments the forward received.
            kwargs: keyword arguments the forward received.
            output: the forward's output as left by later-registered hooks, or ``None`` on
                an error path.

        Returns:
            The output to pass on; ``None`` keeps ``output`` unchanged (as torch does).
        """
        return output


# ----------------------------------------------------------------------------- module state
_Frame = tuple[int, int, tuple[ModelHook, ...]]


class _Entry:
    """One named registration: a ModelHook, or a torch handle of a state-dict hook."""

    __slots__ = ("handle", "hook", "kind", "name", "owner")

    def __init__(
        self,
        owner: HookRegistry,
        name: str,
        kind: str,
        hook: ModelHook | None = None,
        handle: RemovableHandle | _ApplyHandle | None = None,
    ) -> None:
        self.owner = owner
        self.name = name
        self.kind = kind
        self.hook = hook
        self.handle = handle


class _ModuleState(_NotCopyable):
    """Everything dlo keeps for one module; never refers to the module itself."""

    __slots__ = ("__weakref__", "entries", "frames", "hooks", "post_handle", "pre_handle")

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.hooks: tuple[ModelHook, ...] = ()
        self.frames: list[_Frame] = []
        self.pre_handle: RemovableHandle | None = None
        self.post_handle: RemovableHandle | None = None

    # Hot path: runs on every forward of a hooked module. No logging, one tuple per call.
    def dispatch_pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        hooks = self.hooks
        caller = sys._getframe(1)
        frame: _Frame = (id(caller), id(caller.f_back), hooks)
        self.frames.append(frame)
        changed = False
        num_entered = 0
        try:
            for hook in hooks:
                # [Note: removal while a call is in flight]
                if self.hooks is not hooks and not _contains(self.hooks, hook):
                    num_entered += 1
                    continue
                result = hook.pre_forward(module, args, kwargs)
                if result is not None:
                    if type(result) is not tuple or len(result) != 2:
                        raise TypeError(
                            f"{type(hook).__qualname__}.pre_forward must return None or "
                            f"(args, kwargs), got {type(result).__name__}"
                        )
                    args, kwargs = result
                    changed = True
                num_entered += 1
        except BaseException:
            _drop_frame(self.frames, frame)
            _unwind(self.live(hooks[:num_entered]), module, args, kwargs)
            raise
        return (args, kwargs) if changed else None

    def dispatch_post(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        # [Note: pairing pre and post calls]
        frames = self.frames
        caller_id = id(sys._getframe(1))
        i = len(frames) - 1
        while i >= 0:
            frame = frames[i]
            if frame[0] == caller_id:
                del frames[i]
                return _run_post(self.live(frame[2]), module, args, kwargs, output)
            if frame[1] == caller_id:
                del frames[i]
                _unwind(self.live(frame[2]), module, args, kwargs)
                return None
            i -= 1
        if frames and sys.exc_info()[1] is None:
            return _run_post(self.live(frames.pop()[2]), module, args, kwargs, output)
        return None

    def live(self, hooks: tuple[ModelHook, ...]) -> tuple[ModelHook, ...]:
        """``hooks`` without those removed since the snapshot was taken."""
        current = self.hooks
        if hooks is current:
            return hooks
        return tuple(h for h in hooks if _contains(current, h))


def _contains(hooks: tuple[ModelHook, ...], hook: ModelHook) -> bool:
    return any(h is hook for h in hooks)


def _drop_frame(frames: list[_Frame], frame: _Frame) -> None:
    for i in range(len(frames) - 1, -1, -1):
        if frames[i] is frame:
            del frames[i]
            return


def _run_post(
    hooks: tuple[ModelHook, ...],
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
) -> Any:
    i = len(hooks)
    try:
        while i:
            i -= 1
            result = hooks[i].post_forward(module, args, kwargs, output)
            if result is not None:
                output = result
    except BaseException:
        _unwind(hooks[:i], module, args, kwargs)
        raise
    return output


def _unwind(
    hooks: tuple[ModelHook, ...], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Error path: ``post_forward(output=None)`` for every hook in ``hooks``, last first."""
    for hook in reversed(hooks):
        try:
            hook.post_forward(module, args, kwargs, None)
        except Exception:
            logger.warning(
                "dlo hook %s.post_forward raised while unwinding an error in %s; "
                "ignored so that the original exception propagates",
                type(hook).__qualname__,
                type(module).__qualname__,
                exc_info=True,
            )


# Per-module state, keyed weakly by the module (see module docstring).
_STATES: weakref.WeakKeyDictionary[nn.Module, _ModuleState] = weakref.WeakKeyDictionary()
# id(ModelHook) -> state of the module it is registered on; enforces one module per hook.
# The state holds the hook, so a live entry always refers to the same hook object.
_HOOK_HOMES: weakref.WeakValueDictionary[int, _ModuleState] = weakref.WeakValueDictionary()


def _rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


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
            raise TypeError(f"hook must be a dlo.hooks.ModelHook, got {type(hook).__qualname__}")
        state = self._admit(module, name)
        home = _HOOK_HOMES.get(id(hook))
        if home is not None:
            raise ValueError(
                f"{type(hook).__qualname__} instance is already registered on a module "
                f"(as {_names_of_hook(home, hook)}); one ModelHook instance serves one module"
            )
        if state.pre_handle is None:
            state.pre_handle = module.register_forward_pre_hook(
                state.dispatch_pre, prepend=True, with_kwargs=True
            )
            try:
                state.post_handle = module.register_forward_hook(
                    state.dispatch_post, with_kwargs=True, always_call=True
                )
            except BaseException:
                state.pre_handle.remove()
                state.pre_handle = None
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
        if public is not None:
            handle = public(hook)
        else:
            handle = module._register_load_state_dict_pre_hook(hook, with_module=True)
        state.entries.append(_Entry(self, name, _LOAD_STATE_DICT_PRE, handle=handle))
        self._commit(module, state)
        logger.debug(
            "%s: registered load-state-dict pre-hook %r on %s", self._owner, name, _describe(module)
        )

    def register_apply_refusal(self, module: nn.Module, name: str, fn: Callable[[], None]) -> None:
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
        state = self._admit(module, name)
        guard = _Callback(lambda *args, **kwargs: fn())
        handle = _ApplyHandle(module, guard)
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


class _Callback(_NotCopyable):
    """A callable dlo registers on a module (see :class:`_NotCopyable`)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class _ApplyHandle:
    """Installs a refusal of ``module._apply`` as an instance attribute; ``remove`` puts back
    what was there (normally nothing, so the class method shows through again)."""

    def __init__(self, module: nn.Module, guard: _Callback) -> None:
        self._module = weakref.ref(module)
        self._guard = guard
        self._previous = vars(module).get("_apply")
        vars(module)["_apply"] = guard

    def remove(self) -> None:
        module = self._module()
        if module is None or vars(module).get("_apply") is not self._guard:
            return
        if self._previous is None:
            del vars(module)["_apply"]
        else:
            vars(module)["_apply"] = self._previous


def _remove_dispatchers(state: _ModuleState) -> None:
    if state.pre_handle is not None:
        state.pre_handle.remove()
        state.pre_handle = None
    if state.post_handle is not None:
        state.post_handle.remove()
        state.post_handle = None


def _names_of_hook(state: _ModuleState, hook: ModelHook) -> str:
    names = [f"{e.owner.owner}:{e.name}" for e in state.entries if e.hook is hook]
    return ", ".join(names) or "?"


# ----------------------------------------------------------------------------- call frames
# [Note: calls that ended without post-hooks]
# torch calls ``always_call`` forward hooks when a forward raised an ``Exception``, not for
# other ``BaseException`` (KeyboardInterrupt, SystemExit, GeneratorExit): after Ctrl-C inside
# a block, a backend's "this block is running" marker would stay set forever. A backend keeps,
# with each such marker, the Python frame of the module call (torch's ``_call_impl``) that set
# it (:func:`module_call_frame`). A later call from the same thread whose marker's frame is no
# longer on its own stack (:func:`call_ended`) knows that call ended without its
# post-hook, and releases it as on an error path. A legitimately nested call still has the
# outer frame on its stack. The frame is held (not its id, which Python may reuse: the next
# call of the same block can get the same address) until the call's post-hook runs; after an
# interrupt, until the next forward or disable, so the interrupted call's locals (its
# activations) live that long. A claim whose thread is gone, or whose frame is not on that
# thread's stack, is stale too (:func:`call_ended`).
_CALL_IMPL_CODES = tuple(
    f.__code__
    for f in (
        getattr(nn.Module, "_call_impl", None),
        getattr(nn.Module, "_wrapped_call_impl", None),
    )
    if f is not None and hasattr(f, "__code__")
)


def module_call_frame() -> FrameType | None:
    """The innermost frame of torch's module call on this thread's stack (from a forward
    pre-hook: the call being entered), or None (a call path torch does not use)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if f.f_code in _CALL_IMPL_CODES:
            return f
        f = f.f_back
    return None


def call_ended(frame: FrameType | None, thread: int | None) -> bool:
    """Whether the module call ``frame``, made on ``thread``, ended without its post-hook:
    ``frame`` is no longer on that thread's stack, or the thread is gone (a worker that died
    of ``SystemExit`` inside a forward). False when unknown (no frame recorded)."""
    if frame is None or thread is None:
        return False
    if thread == threading.get_ident():
        return not _in_chain(frame, sys._getframe(1))
    top = sys._current_frames().get(thread)
    return top is None or not _in_chain(frame, top)


def _in_chain(frame: FrameType, top: FrameType | None) -> bool:
    f = top
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


# ----------------------------------------------------------------------------- foreign offloaders
def foreign_offloader(module: nn.Module) -> str | None:
    """Name the other mechanism that manages ``module`` itself, or ``None``.

    Only ``module`` is inspected, not its children (see :func:`find_foreign_offloaders`).
    Recognized: accelerate hooks (``_hf_hook``), diffusers hooks (a ``_diffusers_hook``
    registry holding hooks), FSDP1 (``FullyShardedDataParallel``), FSDP2 (``fully_shard``,
    an ``FSDPModule``) and DTensor parameters held directly by ``module``. Nothing is imported
    here: a mechanism whose module was never imported cannot be managing anything.

    Args:
        module: the module to inspect.

    Returns:
        ``"accelerate"``, ``"diffusers"``, ``"FSDP"``, ``"FSDP2 fully_shard"``,
        ``"DTensor parameters"`` or ``None``.

    Example:
        >>> foreign_offloader(nn.Linear(2, 2)) is None
        True
    """
    if getattr(module, "_hf_hook", None) is not None:
        return "accelerate"
    diffusers_registry = getattr(module, "_diffusers_hook", None)
    if diffusers_registry is not None and getattr(diffusers_registry, "hooks", None):
        return "diffusers"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        fsdp2_cls = getattr(fsdp, "FSDPModule", None)
        if fsdp2_cls is not None and isinstance(module, fsdp2_cls):
            return "FSDP2 fully_shard"
        fsdp1_cls = getattr(fsdp, "FullyShardedDataParallel", None)
        if fsdp1_cls is not None and isinstance(module, fsdp1_cls):
            return "FSDP"
    if any(is_dtensor(p) for p in module.parameters(recurse=False)):
        return "DTensor parameters"
    return None


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a DTensor (an FSDP2-managed parameter, say); imports nothing: a DTensor can
    only exist once ``torch.distributed.tensor`` is loaded."""
    dtensor_mod = sys.modules.get("torch.distributed.tensor")
    dtensor_cls = getattr(dtensor_mod, "DTensor", None) if dtensor_mod is not None else None
    return dtensor_cls is not None and isinstance(t, dtensor_cls)


def find_foreign_offloaders(root: nn.Module) -> list[tuple[str, str]]:
    """Every module under ``root`` (included) that another mechanism manages.

    Args:
        root: the model (or component) to scan.

    Returns:
        ``(path, mechanism)`` pairs in ``named_modules()`` order; ``path`` is the dotted
        submodule path, ``""`` for ``root`` itself.

    Example:
        >>> find_foreign_offloaders(nn.Sequential(nn.Linear(2, 2)))
        []
    """
    found = []
    for path, module in root.named_modules():
        mechanism = foreign_offloader(module)
        if mechanism is not None:
            found.append((path, mechanism))
    return found
