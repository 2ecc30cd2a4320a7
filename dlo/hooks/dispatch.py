"""The hook interface (:class:`ModelHook`) and how module calls are dispatched to the named
hooks of a module: the per-module state, the pairing of pre and post calls, unwinding on
errors.

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
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo.errors import OffloadError

logger = logging.getLogger(__name__)


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


def _rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


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


# ----------------------------------------------------------------------------- module state
_Frame = tuple[int, int, tuple[ModelHook, ...]]


class _Owner(Protocol):
    """The registry an entry belongs to (:class:`~dlo.hooks.registry.HookRegistry`)."""

    @property
    def owner(self) -> str: ...


class _Removable(Protocol):
    def remove(self) -> None: ...


class _Entry:
    """One named registration: a ModelHook, or a torch handle of a state-dict hook."""

    __slots__ = ("handle", "hook", "kind", "name", "owner")

    def __init__(
        self,
        owner: _Owner,
        name: str,
        kind: str,
        hook: ModelHook | None = None,
        handle: _Removable | None = None,
    ) -> None:
        self.owner = owner
        self.name = name
        self.kind = kind
        self.hook = hook
        self.handle = handle


class _ModuleState(_NotCopyable):
    """Everything dlo keeps for one module; never refers to the module itself."""

    __slots__ = (
        "__weakref__",
        "around",
        "compiled",
        "entries",
        "frames",
        "hooks",
        "post_handle",
        "pre_handle",
    )

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.hooks: tuple[ModelHook, ...] = ()
        self.frames: list[_Frame] = []
        self.pre_handle: RemovableHandle | None = None
        self.post_handle: RemovableHandle | None = None
        self.around = False
        """The compiled-call interposer is running this module's hooks around its call."""
        self.compiled: _Removable | None = None
        """The module's compiled-call interposer (see :mod:`dlo.hooks.compiled`)."""

    # Hot path: runs on every forward of a hooked module. No logging, one tuple per call.
    def dispatch_pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        # [Note: hooks outside compiled frames]
        if torch.compiler.is_compiling():
            return None if AROUND.depth else _eager_pre(self, module, args, kwargs)
        if self.around:
            return None  # the compiled-call interposer runs the hooks around this call
        return self._pre(module, args, kwargs, sys._getframe(1))

    def _pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        hooks = self.hooks
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
        if torch.compiler.is_compiling():  # [Note: hooks outside compiled frames]
            return None if AROUND.depth else _eager_post(self, module, args, kwargs, output)
        if self.around:
            return None
        return self._post(module, args, kwargs, output, id(sys._getframe(1)))

    def _post(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        caller_id: int,
    ) -> Any:
        # [Note: pairing pre and post calls]
        frames = self.frames
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


class _Around:
    """How many compiled-call interposers are running hooks around a compiled call now."""

    depth = 0


AROUND = _Around()


@torch.compiler.disable
def _eager_pre(
    state: _ModuleState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The pre-dispatch as a graph break: Dynamo runs it eagerly, between two graphs."""
    return state._pre(module, args, kwargs, sys._getframe(1))


@torch.compiler.disable
def _eager_post(
    state: _ModuleState,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
) -> Any:
    return state._post(module, args, kwargs, output, id(sys._getframe(1)))


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


class _Callback(_NotCopyable):
    """A callable dlo registers on a module (see :class:`_NotCopyable`)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class _ApplyHandle:
    """Installs a refusal of ``module._apply`` (or another method, ``attr``) as an instance
    attribute; ``remove`` puts back what was there (normally nothing, so the class method
    shows through again)."""

    def __init__(self, module: nn.Module, guard: _Callback, attr: str = "_apply") -> None:
        self._module = weakref.ref(module)
        self._guard = guard
        self._attr = attr
        self._previous = vars(module).get(attr)
        vars(module)[attr] = guard

    def remove(self) -> None:
        module = self._module()
        if module is None or vars(module).get(self._attr) is not self._guard:
            return
        if self._previous is None:
            del vars(module)[self._attr]
        else:
            vars(module)[self._attr] = self._previous


def _remove_dispatchers(state: _ModuleState) -> None:
    if state.compiled is not None:
        state.compiled.remove()
        state.compiled = None
    if state.pre_handle is not None:
        state.pre_handle.remove()
        state.pre_handle = None
    if state.post_handle is not None:
        state.post_handle.remove()
        state.post_handle = None


def _names_of_hook(state: _ModuleState, hook: ModelHook) -> str:
    names = [f"{e.owner.owner}:{e.name}" for e in state.entries if e.hook is hook]
    return ", ".join(names) or "?"
