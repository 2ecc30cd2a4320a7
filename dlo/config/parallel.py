"""The parallel layout of the job (:class:`ParallelConfig`): data, sequence, tensor and HSDP
sizes. Pure; nothing here reads a live process group (see [Note: rank layout] in
:mod:`dlo.parallel.groups`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dlo.config.fields import _check_int


# ----------------------------------------------------------------------------- parallel
@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallel layout of the job. Sizes multiply to the world size.

    ``data_parallel_size * sequence_parallel_size * tensor_parallel_size`` is the world size.
    HSDP (on when either HSDP size is > 1) shards weights over the same ranks:
    ``hsdp_replicate_size * hsdp_shard_size`` must equal that world size, and
    ``tensor_parallel_size`` must be 1 (HSDP's consecutive shard groups would be the tensor
    groups). Given only the HSDP sizes, the data-parallel size is their product.
    """

    data_parallel_size: int = 1
    """Ranks running different requests of the same shapes, in lock step (with only HSDP
    sizes given: ``hsdp_replicate_size * hsdp_shard_size``)."""
    sequence_parallel_size: int = 1
    """Ranks splitting one request's sequence."""
    tensor_parallel_size: int = 1
    """Ranks splitting each weight; never a weight-collective axis for dlo."""
    hsdp_replicate_size: int = 1
    """HSDP replicate axis (outer; typically across nodes)."""
    hsdp_shard_size: int = 1
    """HSDP shard axis (inner; typically within a node). dlo's AllGather runs on it."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_int(f.name, getattr(self, f.name), minimum=1)
        if self.use_hsdp and self.world_size == 1:
            # only HSDP given: its ranks are data-parallel ranks of one request each
            object.__setattr__(
                self, "data_parallel_size", self.hsdp_replicate_size * self.hsdp_shard_size
            )
        if self.use_hsdp and self.tensor_parallel_size > 1:
            # HSDP's shard groups are consecutive ranks, which with TP are the tensor groups:
            # dlo would gather over TP, which never is a weight axis (DESIGN.md section 3)
            raise ValueError(
                f"HSDP (hsdp_replicate_size={self.hsdp_replicate_size}, hsdp_shard_size="
                f"{self.hsdp_shard_size}) cannot be combined with tensor_parallel_size="
                f"{self.tensor_parallel_size}: its shard groups would be the tensor-parallel "
                "groups; use tensor_parallel_size=1 with HSDP"
            )
        if self.use_hsdp and self.hsdp_replicate_size * self.hsdp_shard_size != self.world_size:
            raise ValueError(
                f"hsdp_replicate_size={self.hsdp_replicate_size} x hsdp_shard_size="
                f"{self.hsdp_shard_size} must equal the world size data_parallel_size="
                f"{self.data_parallel_size} x sequence_parallel_size="
                f"{self.sequence_parallel_size} x tensor_parallel_size="
                f"{self.tensor_parallel_size} = {self.world_size}"
            )

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.sequence_parallel_size * self.tensor_parallel_size

    @property
    def use_hsdp(self) -> bool:
        return self.hsdp_shard_size > 1 or self.hsdp_replicate_size > 1

    @classmethod
    def for_world(cls, world_size: int) -> ParallelConfig:
        """Pure data parallelism over ``world_size`` ranks (the default under torchrun)."""
        return cls(data_parallel_size=world_size)

    def check_world_size(self, world_size: int) -> None:
        """Raise if the configured sizes do not multiply to the live ``world_size``."""
        if self.world_size != world_size:
            raise ValueError(
                f"ParallelConfig sizes multiply to {self.world_size} (data_parallel_size="
                f"{self.data_parallel_size}, sequence_parallel_size={self.sequence_parallel_size},"
                f" tensor_parallel_size={self.tensor_parallel_size}) but WORLD_SIZE={world_size}"
            )
