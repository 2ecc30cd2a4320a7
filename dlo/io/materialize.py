"""Fill a model skeleton (built on the ``meta`` device) from a safetensors checkpoint.

[Note: loading from a checkpoint]
:func:`plan_load` checks, before anything is touched, that every tensor the skeleton needs
(parameters and persistent buffers, by state-dict name) has exactly one source in the
checkpoint with the same shape and dtype, that the checkpoint holds nothing else, and that
every non-persistent buffer left on ``meta`` can be computed (its module defines
``init_buffers()``, the convention of :mod:`dlo.models`). Every problem is reported in one
:class:`~dlo.io.checkpoint.CheckpointError` naming the tensors and the files; the skeleton is
unchanged.

:func:`materialize` then gives every tensor its bytes, journaled so that a failure (here or
in the backend's enable that follows) puts the skeleton back exactly:

- *mapped* (the default): the tensor aliases the checkpoint's private mapping (see [Note:
  mapped checkpoint tensors]). Nothing is read yet. The layerwise backend then packs each
  block's shard for this rank with :func:`pack_block`, which reads with ``pread`` only the
  byte ranges of this rank's slices straight into the host region: the process holds its
  host shards and nothing of the file (the page cache, shared by the ranks of a node, is
  not in any process's RSS). Reading through the mapping instead would map whole page-cache
  folios (up to 2 MiB on current kernels for a 4 KiB touch) and count them in RSS.
- *copied*: the tensor gets its own memory, exactly as ``load_state_dict`` would, on the
  compute device when the backend would put it there anyway. Only block tensors are mapped:
  non-block weights are used in place by the model, and a tensor aliasing the file is
  aligned only to its dtype, which changes CPU kernels' vectorization and so their rounding
  (a resident run would not be bitwise equal). ``load_pipeline(copy=True)`` copies every
  tensor to the CPU: the ordinary path, for comparison. Block tensors that cannot be mapped
  (a skeleton tensor that is not contiguous: the file is row-major) fall back to a copy on
  the CPU one by one, with a logged reason. Block data not aligned to its dtype in the file
  (older writers) cannot be aliased by a tensor, but it is only ever read with ``pread``:
  the model gets uninitialized memory that nothing reads (:func:`_file_served`).
- A tensor is served from the file only while it still holds the file's bytes
  (:meth:`_Mapping.still_aliases`): after a disable gave it private memory, ``.to()`` new
  memory, or an in-place write changed it (its version counter, or, for a write through
  ``.data`` that counter does not see, a page of the private mapping copied on write), a
  later enable packs it from memory.

Dtypes are the skeleton's: a checkpoint tensor of another dtype is an error, unless the
caller asks for casts (``plan_load(cast=True)``, pipeline folders loaded with a
``torch_dtype``): a floating tensor stored in another floating dtype is then read and cast
(copied, never mapped; a streamed block's copy waits on the CPU for its packing).
Tied tensors need one source, under any of their names.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dlo.io.checkpoint import Checkpoint, CheckpointError
from dlo.io.reads import PendingReads, read_copies
from dlo.io.sources import forget_derived, register_derived, register_mapping, unregister_mapping
from dlo.journal import Journal, atomic

logger = logging.getLogger(__name__)


_MAX_LISTED = 12


@dataclass(eq=False)
class _Target:
    """One tensor of the skeleton that the checkpoint must provide."""

    name: str
    """The first (canonical) state-dict name."""
    kind: str
    """``"param"`` or ``"buffer"``."""
    tensor: torch.Tensor
    places: list[tuple[nn.Module, str]] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    source: str = ""
    """The checkpoint name that serves it (the canonical name or an alias)."""


@dataclass(eq=False)
class LoadPlan:
    """What :func:`plan_load` found: the tensors to serve and the buffers to compute."""

    model: nn.Module
    checkpoint: Checkpoint
    targets: list[_Target]
    computed_buffers: list[tuple[nn.Module, str]]
    """Non-persistent buffers on ``meta``: allocated on the CPU, then ``init_buffers()``."""


@dataclass
class LoadReport:
    """What :func:`materialize` did."""

    num_mapped: int = 0
    num_copied: int = 0
    mapped_nbytes: int = 0
    copied_nbytes: int = 0
    copy_reasons: dict[str, str] = field(default_factory=dict)
    """Tensor name -> why it was copied instead of mapped."""
    pending: PendingReads | None = None
    """With ``materialize(defer_reads=True)``: the reads of the copied tensors that are not
    block tensors, still running into the tensors already in the model; wait before anything
    reads them."""
    derived: list[torch.Tensor] = field(default_factory=list)
    """The copies registered as read from the checkpoint (:func:`~dlo.io.sources.derived_source`):
    the caller forgets them once it has enabled offload (see :func:`forget_derived_copies`)."""


def forget_derived_copies(report: LoadReport) -> None:
    """Stop naming ``report``'s copies by the checkpoint: a write through ``.data`` (a LoRA
    fused in place) changes private memory without a trace, so only the enable that
    follows the load, with no user code between them, may rely on them."""
    for t in report.derived:
        forget_derived(t)
    report.derived.clear()


def _join(names: list[str]) -> str:
    more = f" (+{len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def _skeleton_targets(
    model: nn.Module,
) -> tuple[list[_Target], list[tuple[str, nn.Module, str, torch.Tensor]]]:
    by_id: dict[int, _Target] = {}
    targets: list[_Target] = []
    non_persistent: list[tuple[str, nn.Module, str, torch.Tensor]] = []
    for mpath, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mpath}." if mpath else ""
        entries = [(n, "param", t) for n, t in module._parameters.items()]
        entries += [(n, "buffer", t) for n, t in module._buffers.items()]
        for local, kind, t in entries:
            if t is None:
                continue
            name = prefix + local
            if kind == "buffer" and local in module._non_persistent_buffers_set:
                if t.is_meta and all(
                    m is not module or n != local for _, m, n, _ in non_persistent
                ):
                    non_persistent.append((name, module, local, t))
                continue
            target = by_id.get(id(t))
            if target is None:
                target = _Target(name, kind, t)
                by_id[id(t)] = target
                targets.append(target)
            elif name != target.name and name not in target.aliases:
                target.aliases.append(name)
            if (module, local) not in [(m, n) for m, n in target.places]:
                target.places.append((module, local))
    return targets, non_persistent


def plan_load(model: nn.Module, checkpoint: Checkpoint, *, cast: bool = False) -> LoadPlan:
    """Check ``checkpoint`` against ``model`` (see [Note: loading from a checkpoint]).

    Args:
        model: the skeleton (tensors on ``meta``, or already real: both are served).
        checkpoint: the parsed checkpoint.
        cast: a floating tensor stored in another floating dtype than the skeleton's is
            cast on load (read and copied, never mapped) instead of refused.
    Returns:
        The plan for :func:`materialize`.
    Raises:
        CheckpointError: missing, extra, duplicated (under two names of one tied tensor),
            mis-shaped or mis-typed tensors, or non-persistent buffers that cannot be
            computed; all of them, in one message. Nothing is changed.
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> with torch.device("meta"):
        ...     skeleton = MyModel()
        >>> plan = plan_load(skeleton, Checkpoint("ckpt/"))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"loading from a checkpoint needs an nn.Module pipeline, got {type(model).__name__}"
        )
    targets, non_persistent = _skeleton_targets(model)
    entries = checkpoint.entries
    missing, twice, mismatched = [], [], []
    used: set[str] = set()
    for t in targets:
        names = [n for n in (t.name, *t.aliases) if n in entries]
        used.update(names)
        if not names:
            missing.append(t.name)
            continue
        if len(names) > 1:
            twice.append(" and ".join(names))
            continue
        t.source = names[0]
        e = entries[t.source]
        want = (tuple(t.tensor.shape), t.tensor.dtype)
        castable = cast and e.dtype.is_floating_point and t.tensor.dtype.is_floating_point
        if (e.shape, t.tensor.dtype if castable else e.dtype) != want:
            mismatched.append(
                f"{t.source} (checkpoint {list(e.shape)} {e.dtype} in {e.file.name}, "
                f"model {list(want[0])} {want[1]})"
            )
    extra = sorted(f"{n} ({entries[n].file.name})" for n in set(entries) - used)
    uncomputable = [
        name
        for name, module, _, _ in non_persistent
        if not callable(getattr(module, "init_buffers", None))
    ]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {_join(missing)}")
    if extra:
        problems.append(f"not in the model: {_join(extra)}")
    if twice:
        problems.append(f"stored under two names of one tied tensor: {_join(twice)}")
    if mismatched:
        problems.append(f"shape or dtype differs: {_join(mismatched)}")
    if uncomputable:
        problems.append(
            f"non-persistent buffers left on meta whose module has no init_buffers(): "
            f"{_join(uncomputable)} (compute them in the factory, or define init_buffers())"
        )
    if problems:
        files = ", ".join(str(f) for f in checkpoint.files[:4])
        raise CheckpointError(
            f"checkpoint {files} cannot serve {type(model).__name__}: " + "; ".join(problems)
        )
    computed = [(module, local) for _, module, local, _ in non_persistent]
    return LoadPlan(model, checkpoint, targets, computed)


# ----------------------------------------------------------------------------- materialize
def _copy_reason(target: _Target, mapped: bool, stored: torch.dtype) -> str | None:
    if not mapped:
        return "copy requested"
    if stored != target.tensor.dtype:
        return f"stored as {stored}, cast to {target.tensor.dtype}"
    if not target.tensor.is_contiguous():
        return f"not contiguous in the model (stride {tuple(target.tensor.stride())})"
    return None


def _file_served(ckpt: Checkpoint, name: str) -> torch.Tensor:
    """The model's tensor for a block tensor the backend reads from the file: the mapping
    itself, or, where the file's data is not aligned to its dtype (a tensor cannot alias
    it), uninitialized memory of the same dtype and shape that nothing reads. The backend
    packs (or stages) the block with ``pread`` from the file either way and then releases
    the model's tensor; a failed enable puts the skeleton back (the journal)."""
    if ckpt.is_aligned(name):
        return ckpt.tensor(name)
    e = ckpt.entries[name]
    return torch.empty(e.shape, dtype=e.dtype)  # pages untouched: no RSS until written


def _install(target: _Target, data: torch.Tensor, journal: Journal) -> torch.Tensor:
    """Give ``target`` the bytes of ``data``; returns the tensor now in the model."""
    old = target.tensor
    if not old.is_meta:
        previous = old.data
        old.data = data
        journal.record(f"load {target.name}", functools.partial(setattr, old, "data", previous))
        return old
    # a meta tensor cannot take real data in place (incompatible tensor types): a new
    # object goes into every place that held the old one
    new: torch.Tensor
    if isinstance(old, nn.Parameter):
        # the skeleton's class (a Parameter subclass stays one: a streamed block refuses it
        # by name) and the attributes set on it (optimizer or sharding flags)
        new = torch.Tensor._make_subclass(type(old), data, old.requires_grad)
        new.__dict__.update(old.__dict__)
    else:
        new = data.detach()  # no _base: a view of the file mapping would keep it mapped
    for module, local in target.places:
        store: dict[str, Any] = module._parameters if target.kind == "param" else module._buffers
        store[local] = new
        journal.record(f"load {target.name}", functools.partial(store.__setitem__, local, old))
    return new


def materialize(
    plan: LoadPlan,
    journal: Journal,
    *,
    mapped: Callable[[str], bool] = lambda name: False,
    device: torch.device | str = "cpu",
    defer_reads: bool = False,
    read_unaligned: bool = False,
) -> LoadReport:
    """Give every tensor of the skeleton its bytes (see [Note: loading from a checkpoint]).

    Args:
        plan: from :func:`plan_load`.
        journal: records every change; ``journal.rollback()`` restores the skeleton.
        mapped: which tensors (by state-dict name) alias the checkpoint mapping: the ones a
            backend packs into host shards. The others are copied to ``device``.
        device: where copied tensors are allocated.
        defer_reads: return while the copied tensors other than block tensors (those go to
            ``device``) are still being read into the tensors installed for them
            (``report.pending``): the caller overlaps them with work that does not read
            them (the layerwise enable, filling the host shards from the file) and waits
            before anything does; the journal cancels them on a rollback. Block tensors are
            always read before this returns (the backend packs them).
        read_unaligned: read the mapped tensors whose file data cannot be aliased (not
            aligned to their dtype) instead of leaving uninitialized memory the backend
            never reads (for a caller whose code reads the weights before the enable).
    """
    report = LoadReport()
    ckpt = plan.checkpoint
    copies: list[tuple[_Target, bool, str]] = []
    for target in plan.targets:
        entry = ckpt.entries[target.source]
        nbytes = entry.nbytes
        block = mapped(target.name)
        reason = _copy_reason(target, block, entry.dtype)
        if reason is None and read_unaligned and not ckpt.is_aligned(target.source):
            reason = "not aligned to its dtype in the file, and read before the enable"
        if reason is None:
            new = _install(target, _file_served(ckpt, target.source), journal)
            register_mapping(new, ckpt, target.source)
            journal.record(f"map {target.name}", functools.partial(unregister_mapping, new))
            report.num_mapped += 1
            report.mapped_nbytes += nbytes
            continue
        copies.append((target, block, reason))
        report.num_copied += 1
        report.copied_nbytes += nbytes
        if reason != "copy requested":
            report.copy_reasons[target.name] = reason
    # a streamed block's tensor waits on the host for its packing, never on the device
    jobs = [
        (t, defer_reads and not b, (t.source, t.tensor, "cpu" if b else device))
        for t, b, _ in copies
    ]
    later = [(t, j) for t, deferred, j in jobs if deferred]
    if later:  # started first: they run behind the block tensors' reads and the caller's work
        pending = PendingReads(ckpt, [j for _, j in later])
        with atomic():  # [Note: interrupts during enable] in dlo.journal
            journal.record("deferred reads", pending.cancel)
            report.pending = pending
        pending.start()
        for (target, _), data in zip(later, pending.tensors):
            _install(target, data, journal)
    now = [(t, j) for t, deferred, j in jobs if not deferred]
    for (target, _), data in zip(now, read_copies(ckpt, [j for _, j in now])):
        new = _install(target, data, journal)
        register_derived(new, ckpt, target.source)  # an encoded checkpoint may describe it
        report.derived.append(new)
        journal.record(f"derive {target.name}", functools.partial(forget_derived, new))
    modules: list[nn.Module] = []
    for module, local in plan.computed_buffers:
        old = module._buffers[local]
        assert old is not None
        module._buffers[local] = torch.empty_strided(
            tuple(old.shape), tuple(old.stride()), dtype=old.dtype
        )
        journal.record(
            f"compute {local}", functools.partial(module._buffers.__setitem__, local, old)
        )
        if module not in modules:
            modules.append(module)
    with torch.no_grad():
        for module in modules:
            init: Callable[[], object] = module.init_buffers  # type: ignore[assignment]
            init()
    if report.copy_reasons:
        first = next(iter(report.copy_reasons.items()))
        logger.warning(
            "dlo: %d checkpoint tensors are copied instead of mapped (first: %s: %s)",
            len(report.copy_reasons),
            *first,
        )
    return report
