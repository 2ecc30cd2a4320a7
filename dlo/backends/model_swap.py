"""Model-level swap (``mode="module"``): whole components take turns on the device.

[Note: swap protocol]
Only the executing component group is device resident. DiTs and encoders each get an
exact-size host copy of all their tensors (one :class:`~dlo.host.region.HostRegion` entry per
component, laid out like a block with group size 1, pinned when the platform can), and the
pageable originals are released. Before a DiT's forward, its pre-forward hook evicts every
encoder and every other DiT, then loads the DiT; before an encoder's forward, every DiT is
evicted and the encoder loaded. VAEs stay on the device and out of the exclusion set.

Loading allocates one device buffer of the component's padded size on the compute stream,
records the component's ``free`` event there (earlier kernels may still read memory the
allocator is about to hand out again), loads the host bytes through the ring's transport
(:class:`~dlo.runtime.transport.BlockTransport` with a group of one: the copy stream waits on
``free``, copies, records ``ready``), makes the compute stream wait on ``ready``, and rebinds
every tensor to a view of the buffer (same Parameter objects). Evicting rebinds placeholders and drops the buffer; no
device-to-host copy is made because the host copy stays authoritative (inference never
writes weights). The buffer was allocated on the compute stream and every use of it is
ordered on that stream, so the caching allocator may reuse it as soon as it is dropped.
Components without tensors never transfer.

Split models (one transformer with mutually exclusive phases) opt in by subclassing
:class:`dlo.SupportsModelOffload`; the backend then delegates enable/disable to them, under
the same journal.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dlo import faults
from dlo.backends.base import OffloadBackend, claim_components
from dlo.backends.model_hooks import (
    check_not_released,
    install_apply_refusal,
    install_load_refusal_on_ancestors,
    install_state_dict_hooks,
)
from dlo.config.fields import COMPONENTS
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.errors import OffloadError
from dlo.hooks.dispatch import ModelHook
from dlo.hooks.registry import HookRegistry
from dlo.host.region import HostRegion
from dlo.host.shards import (
    copy_back,
    pack_shard,
    placeholder,
    shard_view,
    unpack_tensor,
    written_tensors,
)
from dlo.journal import Journal, atomic
from dlo.plan.checks import check_blocks
from dlo.plan.declarations import SupportsModelOffload, get_by_path
from dlo.plan.layers import plan_units
from dlo.plan.layout import (
    BlockLayout,
    describe_entries,
    module_tensor_entries,
)
from dlo.plan.subclasses import move_tensor, tensor_nbytes
from dlo.plan.topology import ResolvedOffloadPlan, every_component, resolve_offload_plan
from dlo.platform.device import Platform
from dlo.platform.timing import StreamTimer
from dlo.runtime.guard import Guard
from dlo.runtime.transport import BlockTransport, TransferCounters

logger = logging.getLogger(__name__)

HOOK_NAME = "dlo.swap"


@dataclass(eq=False)
class _Unit:
    """One swappable component."""

    path: str
    kind: str  # "dit" | "encoder"
    module: nn.Module
    layout: BlockLayout
    tensors: list[torch.Tensor]
    region_index: int = -1
    original_devices: list[torch.device] = field(default_factory=list)
    placeholders: list[torch.Tensor] = field(default_factory=list)
    buffer: torch.Tensor | None = None
    num_loads: int = 0
    timer: StreamTimer | None = None
    """Compute-stream time spent waiting for this component's loads (all exposed)."""
    free: Any = None
    """[free] producer: compute stream, before a load; consumer: the copy stream."""
    ready: Any = None
    """[ready] producer: the copy stream, after a load; consumer: the compute stream."""
    versions: list[int] = field(default_factory=list)
    """Each tensor's version counter when the component was loaded (see [Note: writes into
    streamed tensors] in dlo.runtime.ring)."""


class _SwapHook(ModelHook):
    def __init__(self, backend: ModelSwapBackend, unit: _Unit) -> None:
        self.backend = backend
        self.unit = unit

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.backend.enter(self.unit, args, kwargs)
        return None

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self.backend.exit(self.unit)
        return output


class ModelSwapBackend(OffloadBackend):
    """Keeps only the executing component group on the device (see [Note: swap protocol])."""

    name = "module"

    def __init__(self, config: OffloadConfig, parallel: ParallelConfig, platform: Platform) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.platform = platform
        self.plan: ResolvedOffloadPlan | None = None
        self._reset()

    def _reset(self) -> None:
        self._units: list[_Unit] = []
        self._region: HostRegion | None = None
        self._delegate: SupportsModelOffload | None = None
        self._transport: BlockTransport | None = None
        self._counters = TransferCounters()
        self._vae_nbytes = 0
        self._guard = Guard(
            self.platform,
            rank=0,
            what="component",
            order=_unit_order,
            disable_drops_own_stale=True,
            check_devices=False,
        )
        """One component group on the device at a time (see :mod:`dlo.runtime.guard`)."""

    def disable(self, *, restore: bool = False) -> None:
        """Remove everything enable installed; a no-op when not enabled. Components are
        always restored from their whole host copies (``restore`` changes nothing).

        Raises:
            dlo.OffloadError: another thread is running a component's forward (nothing
                changed).
        """
        if self.is_enabled():
            self._guard.begin_disable()
        super().disable()

    def _after_failed_enable(self) -> None:
        self._reset()

    _forget = _after_failed_enable

    # ------------------------------------------------------------------ install
    def _install(self, pipeline: Any, journal: Journal) -> None:
        t0 = time.perf_counter()
        plan = resolve_offload_plan(pipeline, self.config, self.parallel)
        self.plan = plan
        owner = f"dlo {self.name} backend #{id(self):x}"
        faults.check("config_validated")
        if isinstance(pipeline, nn.Module) and SupportsModelOffload in type(pipeline).__mro__:
            claim_components([("", pipeline)], owner, journal)
            self._delegate_to(pipeline, journal)
            return
        # on-demand components are the pipeline's to place: never swapped by dlo
        selected = self.config.components or COMPONENTS
        kinds = [(p, "dit") for p in plan.dits] + [(p, "encoder") for p in plan.encoders]
        kinds = [(p, k) for p, k in kinds if p not in plan.on_demand]
        units_paths = [(p, k) for p, k in kinds if k in selected]
        # the kinds ``components`` leaves out stay device resident, like the VAEs
        kept = [p for p, k in kinds if k not in selected]
        if not units_paths:
            raise OffloadError(
                f"mode='module' found no {' or '.join(selected)} component to swap "
                f"(DiTs {list(plan.dits)}, encoders {list(plan.encoders)})"
            )
        comps = [(p, get_by_path(pipeline, p)) for p, _ in units_paths]
        residents = [(p, get_by_path(pipeline, p)) for p in (*plan.vaes, *kept)]
        claim_components(comps + residents, owner, journal)
        check_blocks(comps, every_component(pipeline, plan), wrappers=False)
        entries = {p: module_tensor_entries(m) for p, m in comps}
        check_not_released([(f"{p}.{n}", t) for p, e in entries.items() for n, _, t in e], rank=0)
        faults.check("manifest_build")
        layouts = plan_units(
            {p: describe_entries(e) for p, e in entries.items()},
            chunk_nbytes=self.config.chunk_nbytes,
        )
        for (path, kind), (_, module) in zip(units_paths, comps):
            tensors = [t for _, _, t in entries[path]]
            self._units.append(_Unit(path, kind, module, layouts[path], tensors))
        with atomic():  # [Note: interrupts during enable] in dlo.journal
            self._region = HostRegion([u.layout.shard_nbytes for u in self._units])
            journal.record("host region", self._region.close)
        for i, u in enumerate(self._units):
            u.region_index = i
            faults.check("host_fill")
            pack_shard(self._region.view(i), u.layout, 0, u.tensors)
            u.original_devices = [t.device for t in u.tensors]
            u.placeholders = [placeholder(t, self.platform.device) for t in u.tensors]
            with atomic():
                self._rebind(u, u.placeholders)
                journal.record(f"release {u.path}", functools.partial(self._restore, u))
        if self.config.pin_memory:
            report = self._region.pin(self.platform, budget_nbytes=self.config.pin_budget_nbytes)
            if report.unpinned_blocks and self.config.pin_failure_policy == "fail":
                names = [self._units[i].path for i in report.unpinned_blocks]
                raise OffloadError(
                    f"pinning failed or exceeded pin_budget_gb for components {names} "
                    "(pin_failure_policy='fail')"
                )
        pf = self.platform
        self._transport = BlockTransport(
            pf,
            group=None,
            group_rank=0,
            group_size=1,
            copy_stream=pf.new_stream(),
            comm_stream=None,
            max_chunks=0,
            counters=self._counters,
        )
        for u in self._units:
            u.timer, u.free, u.ready = StreamTimer(pf), pf.new_event(), pf.new_event()
        faults.check("device_placement")
        unit_ids = {id(u.module) for u in self._units}
        for path in (*plan.vaes, *kept, *plan.resident_modules):
            module = get_by_path(pipeline, path)
            if id(module) not in unit_ids:  # a resident module inside a unit swaps with it
                self._place(module, journal)
        journal.record("evict all", self._evict_all)
        registry = HookRegistry(owner=owner)
        journal.record("hooks", registry.remove_all)
        faults.check("hook_install")
        for u in self._units:
            registry.register(u.module, HOOK_NAME, _SwapHook(self, u))
            install_state_dict_hooks(
                registry,
                u.module,
                u.path,
                u.layout,
                self._region.view(u.region_index),
                u.tensors,
                rank=0,
            )
        install_load_refusal_on_ancestors(registry, pipeline, [u.path for u in self._units], rank=0)
        install_apply_refusal(registry, pipeline, [u.path for u in self._units], rank=0)
        faults.check("first_transfer")
        for u in self._units:
            if u.kind == "encoder":
                self._load(u)
        pf.synchronize()
        faults.check("commit")
        logger.info(
            "dlo module swap enabled: %d DiTs, %d encoders, %d VAEs in %.2fs",
            len(plan.dits),
            len(plan.encoders),
            len(plan.vaes),
            time.perf_counter() - t0,
        )

    def _delegate_to(self, pipeline: Any, journal: Journal) -> None:
        pipeline.enable_model_offload(
            device=self.platform.device, pin_memory=self.config.pin_memory and self.platform.can_pin
        )
        self._delegate = pipeline
        journal.record("delegate", pipeline.disable_model_offload)

    def _place(self, module: nn.Module, journal: Journal) -> None:
        device = self.platform.device
        for t in [p for p in module.parameters()] + [b for b in module.buffers()]:
            if t.device != device:
                origin = t.device
                move_tensor(t, device)
                self._vae_nbytes += tensor_nbytes(t)
                journal.record("place", functools.partial(move_tensor, t, origin))

    def _restore(self, u: _Unit) -> None:
        assert self._region is not None
        shard = self._region.view(u.region_index)
        for spec, t, dev in zip(u.layout.tensors, u.tensors, u.original_devices):
            t.data = unpack_tensor(shard, spec, dev)

    # ------------------------------------------------------------------ hot path
    def enter(self, unit: _Unit, args: tuple = (), kwargs: dict | None = None) -> None:
        """Claim ``unit`` for one forward, then activate it. A component running now (in
        another thread, or the caller of this one) that the activation would evict is a
        clear error, not a forward computing with placeholders."""
        busy = self._guard.claim(
            unit, unit.path, conflicts=lambda c: c.key is not unit and _excludes(unit, c.key)
        )
        if busy:
            names = self._guard.names(busy)
            raise OffloadError(
                f"forward of {unit.path!r} started while {names} is running (another thread or "
                "a nested call); mode='module' keeps one of them on the device at a time",
                block=unit.path,
            )
        try:
            self._guard.refuse_unsupported(unit.path, unit.tensors, args, kwargs or {})
            # [Note: no inference tensors] in dlo.backends.base: the forward may run under
            # the caller's inference_mode, and weights allocated there would be inference
            # tensors (another kernel path than the resident model's, and no autograd later)
            with torch.inference_mode(False):
                self.activate(unit)
        except BaseException:
            self.exit(unit)
            raise

    def exit(self, unit: _Unit) -> None:
        self._guard.release(unit)

    def activate(self, unit: _Unit) -> None:
        """Evict the other group, then make ``unit`` resident (see [Note: swap protocol])."""
        for other in self._units:
            if other is unit or other.buffer is None or not _excludes(unit, other):
                continue
            self._evict(other)
        if unit.buffer is None:
            self._load(unit)

    def _load(self, u: _Unit) -> None:
        assert self._region is not None and self._transport is not None
        if u.layout.num_chunks == 0:
            u.buffer = torch.empty(0, dtype=torch.uint8, device=self.platform.device)
            return
        pf = self.platform
        compute = pf.current_stream()
        buf = torch.empty(u.layout.padded_nbytes, dtype=torch.uint8, device=pf.device)
        assert u.timer is not None
        u.timer.begin(compute)
        u.free.record(compute)  # earlier readers of the memory the allocator hands out again
        self._transport.load(
            u.layout,
            self._region.view(u.region_index),
            buf,
            free_event=u.free,
            ready_event=u.ready,
            index=u.region_index,
        )
        compute.wait_event(u.ready)
        u.timer.end(compute)
        u.buffer = buf
        u.num_loads += 1
        self._rebind(u, [shard_view(buf, spec) for spec in u.layout.tensors])
        u.versions = [t._version for t in u.tensors]

    def _evict(self, u: _Unit) -> None:
        if u.buffer is not None:
            self._keep_writes(u)
        self._rebind(u, u.placeholders)
        u.buffer = None

    def _keep_writes(self, u: _Unit) -> None:
        """Copy the tensors the component wrote in place while resident back into its host
        copy, so its next load and the restore at disable see them (see [Note: writes into
        streamed tensors] in dlo.runtime.ring); synchronous, and only when a write happened."""
        assert self._region is not None
        copy_back(
            self._region.view(u.region_index),
            written_tensors(u.layout.tensors, u.tensors, u.versions),
        )

    def _evict_all(self) -> None:
        self.platform.synchronize()
        for u in self._units:
            self._evict(u)

    @staticmethod
    def _rebind(u: _Unit, tensors: list[torch.Tensor]) -> None:
        for t, new in zip(u.tensors, tensors):
            t.data = new

    # ------------------------------------------------------------------ telemetry
    def stats(self) -> dict[str, Any]:
        self.platform.synchronize()
        region = self._region
        per: dict[str, dict[str, Any]] = {}
        for u in self._units:
            assert u.timer is not None
            u.timer.harvest(block_host=True)
            per[u.path] = {
                "kind": u.kind,
                "nbytes": u.layout.nbytes,
                "num_loads": u.num_loads,
                "resident": u.buffer is not None,
                "load_ms": u.timer.total_ms,
                "timed_loads": u.timer.count,
            }
        return {
            "enabled": self.is_enabled(),
            "transfer": "swap",
            "group_size": 1,
            "group_rank": 0,
            "delegated": self._delegate is not None,
            "host_nbytes": sum(u.layout.shard_nbytes for u in self._units),
            "host_region_nbytes": region.nbytes if region else 0,
            "host_pinned_nbytes": region.pinned_nbytes if region else 0,
            "device_slot_nbytes": 0,
            "device_component_nbytes": sum(
                u.layout.padded_nbytes for u in self._units if u.buffer is not None
            ),
            "device_vae_nbytes": self._vae_nbytes,
            "h2d_nbytes": self._counters.h2d_nbytes,
            "allgather_nbytes": 0,
            "exposed_wait_ms": sum(u.timer.total_ms for u in self._units if u.timer),
            "num_streamed_blocks": 0,
            "num_resident_blocks": 0,
            "components": per,
        }


def _excludes(unit: _Unit, other: _Unit) -> bool:
    """Whether making ``unit`` resident evicts ``other`` (encoders do not exclude each
    other; a DiT excludes every encoder and every other DiT)."""
    return not (unit.kind == "encoder" and other.kind == "encoder")


def _unit_order(unit: _Unit) -> int:
    return unit.region_index
