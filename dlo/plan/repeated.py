"""Block containers a model does not declare to dlo, found from what it says about itself.

A diffusers model names the classes it repeats (``_repeated_blocks``, which its own
``compile_repeated_blocks`` uses) and the classes that must not be split across devices
(``_no_split_modules``, shared with ``transformers`` and accelerate's ``device_map``). The
block containers are the ``nn.ModuleList`` / ``nn.Sequential`` whose children are all
instances of those classes: the streamed stacks. A model that says neither gets a
structural guess (ModuleLists of two or more blocks of one class defined outside
``torch.nn``), which warns once per class so the user can make it a declaration.

[Note: repeated-block discovery]
Only the outermost containers count: a container inside a block of another (the refiner
blocks of a token refiner that is itself repeated) streams with that block. Containers are
returned in registration order, which is not always the order they run in; the ring learns
the execution order on the first forward (see [Note: prefetch chain] in
:mod:`dlo.runtime.chain`). A listed class that is not in a container (a patch embedder in
``_no_split_modules``) is not a block and is ignored. Pure: reads module structure only,
never tensor data, so it works on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from torch import nn

REPEATED_ATTRS = ("_repeated_blocks", "_no_split_modules")
"""Class attributes naming repeated block classes, in order of preference."""


@dataclass(frozen=True)
class FoundContainers:
    """Block containers of one model and where the knowledge came from."""

    attrs: tuple[str, ...]
    """Container paths relative to the model, in registration order."""
    source: str
    """``"_repeated_blocks"``, ``"_no_split_modules"`` or ``"structure"``."""


def is_container(module: object) -> bool:
    """A ``ModuleList`` / ``ModuleDict``: never called, so its hooks never fire."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def is_block(module: object) -> bool:
    """An executable module: not a container, and with a forward of its own."""
    return (
        isinstance(module, nn.Module)
        and not is_container(module)
        and type(module).forward is not nn.Module.forward
    )


def _class_names(module: nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _outermost(
    model: nn.Module, accept: tuple[type[nn.Module], ...], keep: Callable[[nn.Module], bool]
) -> list[tuple[str, nn.Module]]:
    """Containers of type ``accept`` for which ``keep(container)`` holds, skipping any inside
    an accepted container's block; in registration order."""
    found: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=True):
        if id(module) in inside or not path:
            continue
        if isinstance(module, accept) and _distinct(module, inside) and keep(module):  # type: ignore[arg-type]
            found.append((path, module))
            for child in module.children():
                inside.update(id(m) for m in child.modules())
    return found


def _distinct(container: nn.Module, taken: set[int]) -> bool:
    """Every child is its own module, listed once and in no container found before (a
    tied block, ALBERT-style, cannot stream: one module would be two blocks)."""
    ids = [id(c) for c in container._modules.values()]
    return len(set(ids)) == len(ids) and not taken.intersection(ids)


def _all_of(container: nn.Module, names: set[str]) -> bool:
    children = list(container.children())
    return bool(children) and all(is_block(c) and _class_names(c) & names for c in children)


def _structural(container: nn.Module) -> bool:
    children = list(container.children())
    if len(children) < 2:
        return False
    cls = type(children[0])
    return (
        all(type(c) is cls for c in children)
        and is_block(children[0])
        and not _builtin(children[0])
        and any(True for _ in children[0].parameters())
    )


def find_containers(model: nn.Module, *, structural: bool = True) -> FoundContainers | None:
    """Block containers of ``model`` from its repeated-class declarations, else by
    structure (when ``structural``); None when nothing finds one (see [Note: repeated-block
    discovery])."""
    containers = (nn.ModuleList, nn.Sequential)
    for attr in REPEATED_ATTRS:
        names = getattr(model, attr, None)
        if not isinstance(names, (list, tuple, set, frozenset)) or not names:
            continue
        found = _outermost(model, containers, partial(_all_of, names={str(n) for n in names}))
        if found:
            return FoundContainers(tuple(p for p, _ in found), attr)
    if not structural:
        return None
    found = _outermost(model, (nn.ModuleList,), _structural)
    if found:
        return FoundContainers(tuple(p for p, _ in found), "structure")
    return None


def candidate_containers(model: nn.Module) -> list[str]:
    """Every outermost container of ``model`` whose children are all executable blocks, as
    ``"path (N x Class)"``: what an error message offers to declare."""

    def any_blocks(c: nn.Module) -> bool:
        children = list(c.children())
        return bool(children) and all(is_block(x) for x in children)

    found = _outermost(model, (nn.ModuleList, nn.Sequential), any_blocks)
    # containers of the model's own block classes first (an nn.Sequential of Linear and
    # SiLU is an embedder, not a stack)
    found.sort(key=lambda pc: any(_builtin(x) for x in pc[1].children()))
    return [f"{path!r} ({_count(c)})" for path, c in found]


def _builtin(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.")


def _count(container: nn.Module) -> str:
    children = list(container.children())
    kinds = dict.fromkeys(type(x).__name__ for x in children)
    return f"{len(children)} x {'/'.join(kinds)}"


def describe(attrs: Iterable[str], model: nn.Module) -> str:
    """``'blocks' (4 x WanTransformerBlock), ...`` for a log line."""
    return ", ".join(f"{attr!r} ({_count(model.get_submodule(attr))})" for attr in attrs)
