"""Tensor-subclass weights (torchao's quantized tensors and other traceable wrapper
subclasses): what dlo streams of them, and how they move.

[Note: tensor subclasses]
A traceable wrapper subclass (``__tensor_flatten__`` / ``__tensor_unflatten__``, as
torchao's ``Int8Tensor`` or ``Float8Tensor``) is a shell around plain inner tensors (its
``qdata``, ``scale``, ...), which it names as its own attributes. dlo streams the inner
tensors as stored (int8 or fp8 with their scales; nothing dequantized): the layout lists
them, each under ``<tensor name>.<attribute>`` (an attribute of a parameter never clashes
with a submodule's name), and they are rebound in place like any plain tensor, so the
wrapper object the module holds stays the same object and computes from whatever its inner
tensors hold now. The wrapper's own device (it has no storage) follows its inner tensors:
:func:`retarget` swaps in a bare shell of the same class on the new device (``.data``
assignment keeps the object and its attributes), when enable releases a block to the device
and when disable restores it. ``state_dict()`` of a streamed block rebuilds each wrapper
from its host views with ``__tensor_unflatten__``.

Refused, naming the tensor and its type: a DTensor (FSDP2/TP own it) and a subclass that is
not a traceable wrapper (no ``__tensor_flatten__``: dlo cannot see its bytes). Model-level
swap refuses wrappers in the components it swaps (its units move plain tensors only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dlo.hooks.foreign import is_dtensor


def is_wrapper(t: torch.Tensor) -> bool:
    """A traceable wrapper subclass dlo streams through its inner tensors (not a DTensor)."""
    return is_traceable_wrapper_subclass(t) and not is_dtensor(t)


@dataclass(frozen=True, eq=False)
class Wrapped:
    """One wrapper tensor and what it wraps: each inner attribute's plain tensor, or a
    nested wrapper."""

    tensor: torch.Tensor
    name: str
    """Its dotted name in the block (``"attn.to_q.weight"``)."""
    inner: tuple[tuple[str, torch.Tensor | Wrapped], ...]
    context: Any
    """The second value of ``__tensor_flatten__`` (static metadata: block size, dtype)."""

    def leaves(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, plain tensor)`` of every inner tensor, nested wrappers flattened."""
        out: list[tuple[str, torch.Tensor]] = []
        for attr, t in self.inner:
            if isinstance(t, Wrapped):
                out.extend(t.leaves())
            else:
                out.append((f"{self.name}.{attr}", t))
        return out

    def rebuild(self, view: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A new wrapper of the same class whose inner tensors are ``view(inner)``."""
        inner = {a: t.rebuild(view) if isinstance(t, Wrapped) else view(t) for a, t in self.inner}
        w = self.tensor
        unflatten = type(w).__tensor_unflatten__  # type: ignore[attr-defined]
        return unflatten(inner, self.context, w.shape, w.stride())  # type: ignore[no-any-return]

    def retarget(self, device: torch.device) -> None:
        """Make the wrapper (and nested ones) report ``device``, where its inner tensors are
        now (see the note)."""
        for _, t in self.inner:
            if isinstance(t, Wrapped):
                t.retarget(device)
        retarget(self.tensor, device, name=self.name)


def flatten(name: str, t: torch.Tensor) -> Wrapped:
    """The inner tensors of wrapper ``t`` (named ``name``), read from its attributes.

    Raises:
        TypeError: an inner tensor that ``__tensor_flatten__`` names is not the attribute of
            that name, or is a subclass dlo cannot stream (naming the tensor and type).
    """
    attrs, context = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner: list[tuple[str, torch.Tensor | Wrapped]] = []
    for attr in attrs:
        x = getattr(t, attr, None)
        if x is None:
            continue  # an optional inner tensor this instance does not have
        full = f"{name}.{attr}"
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} ({type(t).__name__}): __tensor_flatten__ names {attr!r}, which is a "
                f"{type(x).__name__}, not a tensor attribute"
            )
        if is_wrapper(x):
            inner.append((attr, flatten(full, x)))
        elif type(x) is torch.Tensor or type(x) is torch.nn.Parameter:
            inner.append((attr, x))
        else:
            raise TypeError(f"{full} is a {type(x).__name__}, a subclass dlo cannot stream")
    return Wrapped(t, name, tuple(inner), context)


def leaf_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s bytes: ``t`` itself, or a wrapper's inner ones."""
    return [x for _, x in flatten("", t).leaves()] if is_wrapper(t) else [t]


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes ``t`` stores (a wrapper's inner tensors, not its logical dtype)."""
    return sum(x.numel() * x.element_size() for x in leaf_tensors(t))


def retarget(t: torch.Tensor, device: torch.device, *, name: str = "") -> None:
    """Give wrapper ``t`` (no storage of its own) the device ``device`` in place.

    Raises:
        TypeError: torch refuses the device change for this class (naming it).
    """
    if t.device == device:
        return
    shell = torch.Tensor._make_wrapper_subclass(
        type(t), t.shape, strides=t.stride(), dtype=t.dtype, device=device, requires_grad=False
    )
    try:
        t.data = shell
    except RuntimeError as e:
        raise TypeError(
            f"{name or 'a tensor'} ({type(t).__name__}) cannot move from {t.device} to "
            f"{device} in place: {e}"
        ) from e


def move_tensor(t: torch.Tensor, device: torch.device) -> None:
    """Move one tensor in place (the same Python object): a plain tensor's data, or a
    wrapper's inner tensors and the wrapper, all or none of them. Also the undo of a
    device placement."""
    if not is_wrapper(t):
        t.data = t.data.to(device)
        return
    w = flatten("", t)
    leaves = [x for _, x in w.leaves()]
    moved = [x.data.to(device) for x in leaves]  # may fail (memory): nothing changed yet
    retarget_all([w], [device])
    for x, data in zip(leaves, moved):
        x.data = data


def retarget_all(wrapped: Sequence[Wrapped], devices: Sequence[torch.device]) -> None:
    """Retarget each of ``wrapped`` to its device, all or none: a failure puts back the
    ones already moved before it raises."""
    done: list[tuple[Wrapped, torch.device]] = []
    try:
        for w, dev in zip(wrapped, devices):
            done.append((w, w.tensor.device))  # first: a failed one may have moved nested ones
            w.retarget(dev)
    except BaseException:
        for w, before in reversed(done):
            w.retarget(before)
        raise
