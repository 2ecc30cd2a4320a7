"""The weight collectives: the only module of the runtime that calls ``torch.distributed``
collectives on tensors (the copy-engine gather moves bytes with copies, not collectives).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


_all_gather_single = getattr(dist, "all_gather_single", None)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """AllGather ``input`` of every rank into ``output`` (``all_gather_single`` where torch
    has it, else ``all_gather_into_tensor``; no deprecation warning on either)."""
    if _all_gather_single is not None:
        _all_gather_single(output, input, group=group)
    else:
        dist.all_gather_into_tensor(output, input, group=group)


def all_gather_objects(obj: Any, group: Any) -> list[Any]:
    """Gather one picklable object from every rank of ``group`` (setup path only)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
