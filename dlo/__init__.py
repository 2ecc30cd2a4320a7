"""dlo: distributed layerwise offload for block-structured models (DiTs).

Blocks stream from host memory through a few preallocated device slots (the ring); with a
group of N ranks each rank keeps only 1/N of every block in pinned host memory and the group
rebuilds each block with an AllGather while the previous block computes. See
``docs/design.md`` for the architecture and ``docs/user_guide.md`` for usage.
"""

from dlo.backends.base import OffloadBackend
from dlo.backends.factory import enable_offload, get_offload_backend
from dlo.config.offload import LayerOptions, OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.errors import BackendPoisonedError, ForwardRefused, OffloadError
from dlo.hooks.dispatch import ModelHook
from dlo.hooks.registry import HookRegistry
from dlo.io.checkpoint import Checkpoint, CheckpointError
from dlo.io.writer import save_checkpoint
from dlo.pipelines.load import load_pipeline
from dlo.plan.declarations import OffloadPlan, SupportsComponentDiscovery, SupportsModelOffload
from dlo.plan.topology import BlockStack, ResolvedOffloadPlan, resolve_offload_plan

__all__ = [
    "BackendPoisonedError",
    "BlockStack",
    "Checkpoint",
    "CheckpointError",
    "ForwardRefused",
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
