"""Configuration: what to offload and how (:class:`OffloadConfig`), and the parallel layout
of the job (:class:`ParallelConfig`).

Both are frozen, keyword-only dataclasses validated once, in ``__post_init__``; every bad
value raises ``TypeError``/``ValueError`` naming the field and the value. The derived
strategy and the size of the weight-collective group are pure functions of the two configs;
nothing here reads a live process group.

[Note: config precedence]
``OffloadConfig.from_flags`` accepts the historical boolean flags. Their priority is fixed:
distributed layerwise > layerwise > model-level, so enabling several picks the first.
``OffloadConfig.from_dict`` accepts the compact form (``mode``, ``components``,
``layer_options``, ``pin_memory`` and the tuning fields); a dict holding only legacy keys is
read with ``from_flags``; a dict mixing both is accepted only when the legacy flags select the
same strategy and leave every legacy DLO tuning at its default, otherwise it is an error.

[Note: resident layers with AllGather]
Resident leading blocks are supported with both transfers. With AllGather they are gathered
once at enable into their own device storage and never streamed again; their host shards stay
(1/G of their bytes per rank) so the model can be rebuilt on disable without a collective
from a single rank's view of its own data.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from dlo.config.fields import (
    CODECS,
    COMPONENT_ALIASES,
    COMPONENTS,
    GATHER_ENGINES,
    GATHER_SYNCS,
    HOST_BACKINGS,
    MAX_CHUNK_MB,
    MAX_SLOTS,
    MIB,
    MODES,
    PIN_FAILURE_POLICIES,
    TRANSFERS,
    WEIGHT_AXES,
    _check_bool,
    _check_choice,
    _check_int,
    _check_int_or_auto,
    _check_positive_number,
    _gib_nbytes,
)
from dlo.config.legacy import LEGACY_FLAG_DEFAULTS, check_legacy_agrees, legacy_kwargs
from dlo.config.parallel import ParallelConfig


# ----------------------------------------------------------------------------- layer options
@dataclass(frozen=True, kw_only=True)
class LayerOptions:
    """Per-component overrides of the layerwise settings."""

    weight_transfer: str | None = None
    """Transfer for this component's blocks (``"rank-local"``, ``"allgather"``,
    ``"node-shared"``, ``"auto"``); None inherits :attr:`OffloadConfig.transfer`."""
    resident_layers: int | str | None = None
    """Leading blocks kept on the device (DiT only), or ``"auto"``; None inherits
    :attr:`OffloadConfig.resident_layers`."""

    codec: str | None = None
    """Lossless codec of this component's host blocks (``"none"``, ``"ans"``, ``"auto"``);
    None inherits :attr:`OffloadConfig.codec`."""

    def __post_init__(self) -> None:
        if self.codec is not None:
            _check_choice("layer_options.codec", self.codec, CODECS)
        if self.weight_transfer is not None:
            _check_choice("layer_options.weight_transfer", self.weight_transfer, TRANSFERS)
        if self.resident_layers is not None:
            _check_int_or_auto("layer_options.resident_layers", self.resident_layers, minimum=0)

    @classmethod
    def from_dict(cls, component: str, data: Any) -> LayerOptions:
        if isinstance(data, LayerOptions):
            return data
        if not isinstance(data, Mapping):
            raise TypeError(
                f"layer_options[{component!r}] must be a mapping, got {data!r} "
                f"({type(data).__name__})"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"layer_options[{component!r}] has unknown keys {unknown}; known: {sorted(known)}"
            )
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise type(e)(f"layer_options[{component!r}]: {e}") from None


# ----------------------------------------------------------------------------- offload
@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """What dlo offloads and how.

    Example:
        >>> cfg = OffloadConfig(mode="layer", transfer="allgather", num_slots=2)
        >>> cfg.strategy
        'layer'
    """

    mode: str = "layer"
    """``"layer"`` streams blocks through device slots (the ring, any group size);
    ``"module"`` swaps whole components (DiTs vs encoders); ``"none"`` disables offload."""
    components: tuple[str, ...] | None = None
    """Component kinds dlo offloads: ``"dit"``, ``"text_encoder"`` (alias ``"encoder"``, the
    name it is stored under), ``"vae"`` (selects nothing: VAEs stay device resident). With
    ``mode="layer"`` the kinds whose blocks stream; None is the compatibility topology (every
    DiT, plus encoders whose block stacks are declared; declaration problems warn and skip;
    where the policy decides residency, it also streams an encoder found from its
    ``_no_split_modules`` when the DiT needs its memory: [Note: encoders kept or streamed]),
    an explicit tuple turns declaration problems into errors; naming ``"encoder"`` also
    streams encoders found from their ``_no_split_modules``. With ``mode="module"`` the
    kinds that swap (None: DiTs and encoders); the others stay device resident."""
    transfer: str = "rank-local"
    """Default weight transfer: ``"rank-local"`` (each rank holds whole blocks),
    ``"allgather"`` (each rank holds 1/G and the group rebuilds blocks), ``"node-shared"``
    (the ranks of the weight group on one node share one host copy, each rank charged 1/L of
    it, and each copies whole blocks over its own link, no collective; see [Note: node-shared
    host copy]), ``"auto"`` (chosen at enable from measured bandwidths and compute, the same
    on every rank; see [Note: policy model])."""
    resident_layers: int | str | None = None
    """Leading DiT blocks kept on the device instead of streamed; ``"auto"`` keeps as many
    as fit in :attr:`device_budget_gb`, else in the free device memory less a headroom for
    activations, so a model that fits streams nothing. None (unset): ``"auto"`` on a GPU or
    with a :attr:`device_budget_gb`, else 0 on a CPU device (see [Note: automatic by
    default] in :mod:`dlo.config.unset`)."""
    layer_options: Mapping[str, LayerOptions] = field(default_factory=dict, hash=False)
    """Per-component overrides, keyed by component kind."""
    pin_memory: bool = True
    """Page-lock host storage where the platform can (never on CPU-only torch)."""
    num_slots: int | str | None = None
    """Device slots shared by every ring (1 to 1024); the prefetch depth is
    ``num_slots - 1``. None (unset): ``"auto"`` on a GPU, 2 on a CPU device. ``"auto"``: 2
    when every streamed stack is rank-local, 3 with
    AllGather (its copy and gather latency outlasts one transfer), fewer when the device
    budget has no room."""
    chunk_mb: int = 64
    """Transfer chunk in MiB: a block moves as chunks; with AllGather each chunk's gather
    starts as soon as this rank's slice of it has landed."""
    pin_budget_gb: float | None = None
    """Cap on pinned host bytes per rank (GiB; a node-shared block costs each of its L ranks
    1/L of its bytes, and node-shared blocks are served before the rank's private ones);
    None is unlimited."""
    host_budget_gb: float | None = None
    """Cap on this rank's host copy of the blocks (GiB, 0 allowed; None: none). The blocks
    beyond it stay in the file they were loaded from and are read for every use, ahead of the
    ring, with O_DIRECT where allowed (see [Note: host budget tiers]); AllGather: 1/N each."""
    device_budget_gb: float | None = None
    """Device memory per rank for everything the run holds (GiB), as on a device of that
    size: what the process already holds, non-block weights, slots, resident blocks, decode
    staging, and a fifth kept for activations and workspace; on a GPU the allocator is capped
    at it until disable (see [Note: device budget] in :mod:`dlo.backends.auto`). Given, it
    sizes the resident blocks where ``resident_layers`` is unset or ``"auto"`` (an explicit
    count is kept, and must fit) and bounds ``num_slots="auto"``; too small for one slot is
    an error."""
    block_compute_ms: float | None = None
    """Expected device time of one streamed DiT block's forward under the workload (ms;
    ``dlo bench`` prints it as "resident compute per block"). Automatic settings only: with
    it, ``transfer="auto"`` takes node-shared over a faster AllGather for a DiT stack whose
    largest whole-block copy it hides (long sequences: no peer traffic, which costs compute
    clock on power-limited GPUs); ``num_slots="auto"`` never gets fewer slots for the chosen
    transfer than without it. None: unknown (see [Note: policy model])."""
    pin_failure_policy: str = "fail"
    """On a failed or over-budget pin: ``"fail"`` the enable, or keep the affected blocks
    pageable (``"whole_block_fallback"``), decided group-wide."""
    weight_axis: str = "auto"
    """Group of the weight collective: ``"auto"`` (HSDP shard axis, else DP, else SP, else
    local), or one of ``"shard"``, ``"data"``, ``"sequence"``, ``"local"``."""
    collective_timeout_s: float = 300.0
    """Bound on every dlo collective; a diverging or missing rank fails within it."""
    verify_block_sequence: bool = True
    """With AllGather, check that every rank of the group gathers the same block (lock step)."""
    nccl_max_ctas: int | None = None
    """Cap on the thread blocks (SMs) NCCL may use for dlo's weight gathers (its own
    communicator only); fewer leave more SMs to compute while a gather runs. None: NCCL's
    choice. Ignored by gloo."""
    gather_engine: str = "auto"
    """How AllGather rebuilds streamed blocks: ``"auto"`` (``"copy"`` when every rank is a
    CUDA rank on one node with symmetric-memory slots, else ``"nccl"``; decided at the
    startup agreement), ``"nccl"`` (NCCL's kernels, any topology), or ``"copy"`` (copy
    engines pulling peers' slices from symmetric-memory slots: no SMs taken from compute;
    CUDA GPUs of one node with peer access)."""
    gather_sync: str = "auto"
    """The copy-engine gather's barriers: ``"auto"`` (kernel-free stream memory operations
    when every rank's driver has them, else torch's barrier kernel; agreed by the group),
    ``"stream"`` (those operations or an error at enable) or ``"kernel"`` (the barrier
    kernel, one CTA per barrier). Ignored by NCCL's gather."""
    host_backing: str = "region"
    """Host bytes of streamed blocks: ``"region"`` (each rank copies its shards into its own
    exact-size host region) or ``"mapped"`` (rank-local stacks of a model loaded with
    :func:`dlo.load_pipeline` keep no private copy: blocks are read from the checkpoint file,
    whose page cache the ranks of a node share, through a few pinned staging buffers; see
    [Note: mapped host backing]). ``"mapped"`` is refused at enable for an AllGather stack
    or a model whose blocks do not come from a checkpoint."""
    codec: str | None = None
    """Host copies of streamed blocks stored losslessly compressed (nvCOMP's ANS on CUDA:
    fewer bytes cross the link, decoded on the device bit for bit; [Note: block codecs]):
    ``"none"``, ``"ans"``, or ``"auto"`` (``"ans"`` for a stack whose modeled copy per block
    outlasts ``block_compute_ms``; without it ``"none"`` at enable, then a re-planned DiT
    ring measured to wait on its copies turns it on between forwards: [Note: codec turned on
    by measurement]; ``"none"`` without a codec on the platform). None (unset): ``"auto"`` on
    a GPU, ``"none"`` on a CPU device. Rank-local, AllGather and node-shared stacks with the
    region host backing (each rank encodes its own shards, a node-shared copy's sharers 1/L
    of its blocks each); per component through :attr:`layer_options`."""

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODES)
        if self.components is not None:
            if isinstance(self.components, str) or not isinstance(self.components, (tuple, list)):
                raise TypeError(f"components must be a tuple of str, got {self.components!r}")
            for c in self.components:
                _check_choice("components", c, tuple(COMPONENT_ALIASES))
            canonical = tuple(COMPONENT_ALIASES[c] for c in self.components)
            if len(set(canonical)) != len(canonical):
                raise ValueError(f"components={self.components!r} has duplicates")
            if not self.components:
                raise ValueError("components=() selects nothing; use mode='none' to disable")
            object.__setattr__(self, "components", canonical)
        _check_choice("transfer", self.transfer, TRANSFERS)
        if self.resident_layers is not None:
            _check_int_or_auto("resident_layers", self.resident_layers, minimum=0)
        _check_bool("pin_memory", self.pin_memory)
        if self.num_slots is not None:
            _check_int_or_auto("num_slots", self.num_slots, minimum=1, maximum=MAX_SLOTS)
        _check_int("chunk_mb", self.chunk_mb, minimum=1, maximum=MAX_CHUNK_MB)
        if self.pin_budget_gb is not None:
            _check_positive_number("pin_budget_gb", self.pin_budget_gb)
        if self.host_budget_gb is not None:
            _check_positive_number("host_budget_gb", self.host_budget_gb, zero=True)
        if self.device_budget_gb is not None:
            _check_positive_number("device_budget_gb", self.device_budget_gb)
        if self.block_compute_ms is not None:
            _check_positive_number("block_compute_ms", self.block_compute_ms)
        _check_choice("pin_failure_policy", self.pin_failure_policy, PIN_FAILURE_POLICIES)
        _check_choice("weight_axis", self.weight_axis, WEIGHT_AXES)
        _check_positive_number("collective_timeout_s", self.collective_timeout_s)
        _check_bool("verify_block_sequence", self.verify_block_sequence)
        if self.nccl_max_ctas is not None:
            _check_int("nccl_max_ctas", self.nccl_max_ctas, minimum=1)
        _check_choice("gather_engine", self.gather_engine, GATHER_ENGINES)
        _check_choice("gather_sync", self.gather_sync, GATHER_SYNCS)
        _check_choice("host_backing", self.host_backing, HOST_BACKINGS)
        if self.codec is not None:
            _check_choice("codec", self.codec, CODECS)
        self._validate_layer_options()
        if self.mode == "module":
            layer_only = {
                "transfer": "rank-local",
                "resident_layers": None,
                "weight_axis": "auto",
                "num_slots": None,
                "device_budget_gb": None,
                "block_compute_ms": None,
                "host_backing": "region",
                "host_budget_gb": None,
                "codec": None,
            }
            old = {"resident_layers": 0, "num_slots": 2, "codec": "none"}  # the old defaults
            for name, default in layer_only.items():
                if getattr(self, name) not in (default, old.get(name, default)):
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} applies to mode='layer' only "
                        "(mode='module' swaps whole components)"
                    )
        if (
            self.components is not None
            and "dit" not in self.components
            and self.resident_layers_for("dit") not in (None, 0)
        ):
            raise ValueError(
                f"resident_layers={self.resident_layers_for('dit')} applies to DiT blocks but "
                f"components={self.components!r} does not select 'dit'"
            )

    def _validate_layer_options(self) -> None:
        if not isinstance(self.layer_options, Mapping):
            raise TypeError(f"layer_options must be a mapping, got {self.layer_options!r}")
        opts: dict[str, LayerOptions] = {}
        for key, value in self.layer_options.items():
            _check_choice("layer_options key", key, tuple(COMPONENT_ALIASES))
            if COMPONENT_ALIASES[key] not in COMPONENTS:
                raise ValueError(
                    f"layer_options key {key!r}: VAEs are never streamed (they stay device "
                    "resident); layer options apply to 'dit' and 'text_encoder'"
                )
            if COMPONENT_ALIASES[key] in opts:
                raise ValueError(f"layer_options gives {COMPONENT_ALIASES[key]!r} twice ({key!r})")
            opts[COMPONENT_ALIASES[key]] = LayerOptions.from_dict(key, value)
        if opts and self.mode == "module":
            raise ValueError(
                f"layer_options={sorted(opts)} given with mode={self.mode!r}; they apply to "
                "mode='layer' only"
            )
        for key, o in opts.items():
            if key != "dit" and o.resident_layers:
                raise ValueError(
                    f"layer_options[{key!r}].resident_layers={o.resident_layers}: resident "
                    "layers apply to DiT components only"
                )
            if self.components is not None and key not in self.components:
                raise ValueError(
                    f"layer_options[{key!r}] given but components={self.components!r} does "
                    "not select it"
                )
        object.__setattr__(self, "layer_options", types.MappingProxyType(opts))

    # ------------------------------------------------------------------ derived (pure)
    @property
    def strategy(self) -> str:
        """``"none"``, ``"module"`` or ``"layer"``."""
        return self.mode

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def chunk_nbytes(self) -> int:
        """:attr:`chunk_mb` in bytes."""
        return self.chunk_mb * MIB

    @property
    def pin_budget_nbytes(self) -> int | None:
        """:attr:`pin_budget_gb` in bytes (None: no budget)."""
        return _gib_nbytes(self.pin_budget_gb)

    @property
    def host_budget_nbytes(self) -> int | None:
        """:attr:`host_budget_gb` in bytes (None: no budget)."""
        return _gib_nbytes(self.host_budget_gb)

    def transfer_for(self, component: str) -> str:
        """Effective transfer of a component kind."""
        o = self.layer_options.get(component)
        return o.weight_transfer if o is not None and o.weight_transfer else self.transfer

    def codec_for(self, component: str) -> str | None:
        """Effective codec of a component kind's host blocks, or None (unset)."""
        o = self.layer_options.get(component)
        return o.codec if o is not None and o.codec else self.codec

    def resident_layers_for(self, component: str) -> int | str | None:
        """Effective resident leading blocks of a component kind (0 for non-DiTs), or
        ``"auto"``, or None (unset: see :func:`dlo.config.unset.for_device`)."""
        if component != "dit":
            return 0
        o = self.layer_options.get(component)
        if o is not None and o.resident_layers is not None:
            return o.resident_layers
        return self.resident_layers

    def weight_group(self, par: ParallelConfig, component: str = "dit") -> tuple[str, int]:
        """The (axis, size) of the weight-collective group for ``component``.

        Rank-local transfer is always ``("local", 1)``. Otherwise the axis is
        :attr:`weight_axis`, resolved as DESIGN.md section 3 says when ``"auto"`` (for
        ``"node-shared"`` the group whose ranks on one node share the host copy).
        """
        if self.mode != "layer" or self.transfer_for(component) == "rank-local":
            return ("local", 1)
        axis = self.weight_axis
        if axis == "auto":
            if par.use_hsdp:
                axis = "shard"
            elif par.data_parallel_size > 1:
                axis = "data"
            elif par.sequence_parallel_size > 1:
                axis = "sequence"
            else:
                axis = "local"
        if axis == "shard":
            if not par.use_hsdp:
                raise ValueError("weight_axis='shard' requires HSDP (hsdp_shard_size > 1)")
            return ("shard", par.hsdp_shard_size)
        if axis == "data":
            return ("data", par.data_parallel_size)
        if axis == "sequence":
            return ("sequence", par.sequence_parallel_size)
        return ("local", 1)

    def weight_group_size(self, par: ParallelConfig, component: str = "dit") -> int:
        return self.weight_group(par, component)[1]

    def replace(self, **changes: Any) -> OffloadConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_flags(cls, **flags: Any) -> OffloadConfig:
        """Build from the historical boolean flags (see [Note: config precedence]).

        Args:
            enable_cpu_offload: model-level swap.
            enable_layerwise_offload: single-rank layerwise ring.
            enable_distributed_layerwise_offload: distributed layerwise offload.
            dlo_use_allgather: DLO rebuilds blocks with AllGather (default True).
            dlo_resident_layers: DLO resident leading blocks (default 0).
            dlo_num_slots, dlo_chunk_mb: DLO slots and chunk size.
            pin_cpu_memory: pin host storage (default True).
        Raises:
            ValueError / TypeError: unknown flag, wrong type, or DLO tuning without DLO.
        """
        return cls(**legacy_kwargs(flags))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OffloadConfig:
        """Build from the compact form, legacy flags, or both when they agree.

        A dict without compact keys is read as legacy flags, so ``{}`` (no flag enabled)
        gives ``mode="none"``.

        Example:
            >>> OffloadConfig.from_dict({"mode": "layer", "components": ["dit"],
            ...     "layer_options": {"dit": {"weight_transfer": "allgather"}}}).transfer_for("dit")
            'allgather'
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"offload config must be a mapping, got {type(data).__name__}")
        compact_keys = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - compact_keys - set(LEGACY_FLAG_DEFAULTS))
        if unknown:
            raise ValueError(
                f"unknown offload config keys {unknown}; compact keys: {sorted(compact_keys)}, "
                f"legacy flags: {sorted(LEGACY_FLAG_DEFAULTS)}"
            )
        legacy = {k: v for k, v in data.items() if k in LEGACY_FLAG_DEFAULTS}
        compact = {k: v for k, v in data.items() if k in compact_keys}
        if not compact:
            return cls.from_flags(**legacy)
        if "components" in compact and isinstance(compact["components"], list):
            compact["components"] = tuple(compact["components"])
        cfg = cls(**compact)
        if legacy:
            check_legacy_agrees(cfg, legacy, lambda: cls.from_flags(**legacy))
        return cfg
