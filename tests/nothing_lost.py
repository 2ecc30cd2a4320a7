""" "Nothing lost" checks every test can call (FAULTS.md's definition of rolled back).

``Baseline.take(model)`` records, for every parameter and buffer: the Python object, dtype,
shape, strides, device and bytes; for every module: its attribute names and the number of
each kind of torch hook; plus dlo's ledger and the device memory in use. ``check(model)``
asserts all of it is as it was: the same Parameter objects with the same bytes, dtypes,
shapes and strides, no dlo attribute or hook left on any module, the ledger at zero and
device memory back to its baseline. ``no_cyclic_garbage()`` asserts that what a block of code
dropped of dlo's went by reference counting alone (no reference cycle holds it for the garbage
collector).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dlo.hooks.registry import HookRegistry
from dlo.host.region import LEDGER

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


@dataclass
class Baseline:
    tensors: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    modules: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    device_nbytes: int = 0

    @classmethod
    def take(cls, model: nn.Module) -> Baseline:
        b = cls()
        named = list(model.named_parameters(remove_duplicate=False))
        named += list(model.named_buffers(remove_duplicate=False))
        for name, t in named:
            b.tensors[name] = (
                id(t),
                t.dtype,
                tuple(t.shape),
                t.stride(),
                t.device,
                t.detach().clone(),
            )
        for name, m in model.named_modules():
            b.modules[name] = (sorted(vars(m)), tuple(len(getattr(m, d, {})) for d in _HOOK_DICTS))
        b.device_nbytes = _device_nbytes()
        return b

    def check(self, model: nn.Module, *, ledger: bool = True) -> None:
        after = Baseline.take(model)
        assert self.tensors.keys() == after.tensors.keys()
        for k, (i, dt, sh, st, dev, val) in self.tensors.items():
            i2, dt2, sh2, st2, dev2, val2 = after.tensors[k]
            assert (i, dt, sh, st, dev) == (i2, dt2, sh2, st2, dev2), k
            assert torch.equal(val, val2), f"bytes of {k} changed"
        assert self.modules == after.modules, "a module gained an attribute or a hook"
        for m in model.modules():
            assert not HookRegistry.owners_on(m), f"dlo hook left on {type(m).__name__}"
        if ledger:
            assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0), "ledger not at zero"
        assert after.device_nbytes <= self.device_nbytes, "device memory above its baseline"


def _device_nbytes() -> int:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())
    return 0


@contextlib.contextmanager
def no_cyclic_garbage() -> Iterator[None]:
    """Run the body with the garbage collector off, then assert that nothing of dlo's is left
    for the collector: every dlo object the body dropped went by reference counting alone.

    A dlo object in a reference cycle keeps whatever it references (views of device slots,
    pinned regions) alive until the collector happens to run, after ``disable`` returned.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [o for o in gc.garbage if type(o).__module__.split(".")[0] == "dlo"]
        assert not left, (
            f"dlo objects in reference cycles: {sorted({type(o).__name__ for o in left})}"
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
