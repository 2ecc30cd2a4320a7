"""dlo's hooks and ``torch.compile``: the hooks always run eagerly, outside compiled frames.

[Note: hooks outside compiled frames]
A hook of dlo's rebinds a module's tensors (a block's weights to a slot, a component's to its
device copy) and enqueues copies and collectives: Python work that must run on every call,
before the module's weights are read. Inside a compiled frame it would be traced once and
never run again, so the dispatchers keep it out of every compiled frame, for each way
users compile:

* ``torch.compile(model)`` (or ``model.compile()`` on a module above the hooked ones): Dynamo
  traces into the hooked module's ``_call_impl`` and reaches the dispatcher, which calls its
  eager body through a ``torch.compiler.disable`` function: a graph break. The hook runs
  between two graphs; the module's forward after it is compiled as its own graph, which
  reads the weights the hook just bound (graph inputs, not constants).
* ``module.compile(...)`` on a hooked module, and diffusers' ``compile_repeated_blocks``
  (which calls it on every block, usually with ``fullgraph=True``, where a graph break is an
  error): torch compiles ``_call_impl`` into the instance attribute ``_compiled_call_impl``.
  The registry puts an interposer there (:class:`CompiledCall`) that runs the hooks eagerly
  and calls the compiled function in between; while it does, the dispatchers traced inside
  that compiled ``_call_impl`` are no-ops (a global depth, the same for every module, so
  it adds one guard and never a recompile per module). A ``compile`` shim on the instance
  re-installs the interposer when the module is compiled after dlo took it, and refuses
  CUDA graphs (below).
* ``module.forward = torch.compile(module.forward)``: the hooks run in the eager
  ``_call_impl`` around the compiled forward; nothing to do.

CUDA graphs (``mode="reduce-overhead"``, or ``options={"triton.cudagraphs": True}``) replay
fixed input addresses, and a streamed block's weights move between slots: torch would
re-record a graph per slot address, silently. Such a compile of a hooked module is refused
with an error naming the modes that work (``"default"``, ``"max-autotune-no-cudagraphs"``).
Both the interposer and the shim are instance attributes that :meth:`CompiledCall.remove`
takes away again (a module compiled while dlo held it keeps its compiled call).

[Note: compile across shapes]
Bitwise parity with the same compile of the resident model holds for every graph the two
share. After a shape change the default recompile is dynamic (automatic dynamic shapes): its
normalizations become looped Triton reductions whose launch configuration is tuned on the
device at first run, and on a GPU the kernel that results is not reproducible across
processes, for the resident model too (one H200, 2026-12-05, Wan2.1-14B block shapes at
480p x 81 then x 1 frame: resident against resident in another process differs by up to
0.0156 at the second shape; ``torch._inductor.config.deterministic`` did not change it;
the probe is in docs/benchmarks.md). dlo changes nothing here: in one process the
resident model and the ring run the same compiled kernels and agree bit for bit after the
dynamic recompile, and with ``dynamic=False`` (a static graph per shape, as a fresh process
compiles) two processes agree at every shape. ``tests/gpu/test_compile_gpu.py`` and
``tests/cpu/test_compile.py`` hold both facts.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn

from dlo.errors import OffloadError
from dlo.hooks.dispatch import AROUND, _ModuleState, _NotCopyable, _rank, _unwind

SUPPORTED_MODES = ("default", "max-autotune-no-cudagraphs")


def _uses_cudagraphs(compiled: Any) -> bool:
    """Whether a ``torch.compile``d callable replays CUDA graphs (best effort: torch
    exposes its Inductor configuration as ``get_compiler_config()``)."""
    get = getattr(compiled, "get_compiler_config", None)
    try:
        config = get() if callable(get) else None
    except Exception:
        return False
    return bool(isinstance(config, dict) and config.get("triton.cudagraphs"))


def _refuse_cudagraphs(module: nn.Module, why: str) -> OffloadError:
    return OffloadError(
        f"torch.compile with CUDA graphs ({why}) on {type(module).__name__}, whose weights dlo "
        "moves between device slots: a CUDA graph replays the addresses it was captured with. "
        f"Compile with mode='default' or mode='max-autotune-no-cudagraphs' ({', '.join(SUPPORTED_MODES)})",
        rank=_rank(),
    )


class CompiledCall(_NotCopyable):
    """The interposer in a hooked module's ``_compiled_call_impl`` (see [Note: hooks outside
    compiled frames]), and the ``compile`` shim beside it. Installed by
    :meth:`~dlo.hooks.registry.HookRegistry.register` with the module's first forward hook;
    :meth:`remove` restores both attributes."""

    __slots__ = ("__weakref__", "_module", "_shim", "_state", "inner")

    def __init__(self, module: nn.Module, state: _ModuleState) -> None:
        self._module = weakref.ref(module)
        self._state = weakref.ref(state)
        self.inner: Any = None
        self._shim = _CompileShim(self)
        self.wrap(module)  # first: a refused compile leaves no shim behind
        if "compile" not in vars(module):
            vars(module)["compile"] = self._shim

    def wrap(self, module: nn.Module) -> None:
        """Interpose on the module's compiled call, if it has one that is not ours."""
        current = vars(module).get("_compiled_call_impl")
        if current is None or current is self:
            return
        if _uses_cudagraphs(current):
            raise _refuse_cudagraphs(module, "mode 'reduce-overhead' or 'max-autotune'")
        self.inner = current
        vars(module)["_compiled_call_impl"] = self

    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, state = self._module(), self._state()
        if module is None or state is None or state.pre_handle is None:
            return self.inner(*args, **kwargs)
        # this frame's id only: a local holding the frame itself is a cycle (frame -> its
        # locals -> frame) that keeps every block's output alive until the next gc pass
        caller_id = id(sys._getframe(0))
        changed = state._pre(module, args, kwargs, sys._getframe(0))
        if changed is not None:
            args, kwargs = changed
        state.around = True
        AROUND.depth += 1
        try:
            output = self.inner(*args, **kwargs)
        except BaseException:
            AROUND.depth -= 1
            state.around = False
            _drop_call(state, caller_id, module, args, kwargs)
            raise
        AROUND.depth -= 1
        state.around = False
        result = state._post(module, args, kwargs, output, caller_id)
        return output if result is None else result

    def remove(self) -> None:
        module = self._module()
        if module is None:
            return
        if vars(module).get("_compiled_call_impl") is self:
            vars(module)["_compiled_call_impl"] = self.inner
        if vars(module).get("compile") is self._shim:
            del vars(module)["compile"]


def _drop_call(
    state: _ModuleState, caller_id: int, module: nn.Module, args: tuple, kwargs: dict
) -> None:
    """The error path of one interposed call: its hooks get ``post_forward(output=None)``."""
    for i in range(len(state.frames) - 1, -1, -1):
        if state.frames[i][0] == caller_id:
            frame = state.frames.pop(i)
            _unwind(state.live(frame[2]), module, args, kwargs)
            return


class _CompileShim(_NotCopyable):
    """``module.compile`` while dlo holds the module: ``nn.Module.compile``, then the
    interposer goes around the new compiled call (CUDA graphs refused first)."""

    __slots__ = ("_owner",)

    def __init__(self, owner: CompiledCall) -> None:
        self._owner = weakref.ref(owner)  # the owner holds this shim: no cycle

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        owner = self._owner()
        module = owner._module() if owner is not None else None
        if owner is None or module is None:
            return
        before = vars(module).get("_compiled_call_impl")
        type(module).compile(module, *args, **kwargs)  # lazy: nothing is compiled yet
        try:
            owner.wrap(module)
        except OffloadError:
            vars(module)["_compiled_call_impl"] = before  # refused: as if never called
            raise
