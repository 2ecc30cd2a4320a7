"""dlo: distributed layerwise offload for block-structured models (DiTs).

Blocks stream from host memory through a few preallocated device slots (the ring); with a
group of N ranks each rank keeps only 1/N of every block in pinned host memory and the group
rebuilds each block with an AllGather while the previous block computes. See
``docs/design.md`` for the architecture and ``docs/user_guide.md`` for usage.
"""

from dlo.backends.factory import enable_offload, get_offload_backend
from dlo.backends.loading import load_pipeline
from dlo.checkpoint import Checkpoint, CheckpointError, save_checkpoint
from dlo.config import LayerOptions, OffloadConfig, ParallelConfig
from dlo.errors import BackendPoisonedError, OffloadError
from dlo.hooks import HookRegistry, ModelHook
from dlo.lifecycle import OffloadBackend
from dlo.plan import (
    BlockStack,
    OffloadPlan,
    ResolvedOffloadPlan,
    SupportsComponentDiscovery,
    SupportsModelOffload,
    resolve_offload_plan,
)

__all__ = [
    "BackendPoisonedError",
    "BlockStack",
    "Checkpoint",
    "CheckpointError",
    "HookRegistry",
    "LayerOptions",
    "ModelHook",
    "OffloadBackend",
    "OffloadConfig",
    "OffloadError",
    "OffloadPlan",
    "ParallelConfig",
    "ResolvedOffloadPlan",
    "SupportsComponentDiscovery",
    "SupportsModelOffload",
    "enable_offload",
    "get_offload_backend",
    "load_pipeline",
    "resolve_offload_plan",
    "save_checkpoint",
]
__version__ = "0.1.0"
