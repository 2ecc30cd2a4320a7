"""Build the demo pipeline straight into its final dtype and device, deterministically.

[Note: deterministic materialization]
The skeleton is built on the ``meta`` device and cast there (free), then ``to_empty``
allocates every tensor once, in its final dtype, on the target device. Each parameter is then
filled from its own CPU ``torch.Generator`` seeded by ``(seed, dotted name)``, in the final
dtype, one tensor at a time per worker (straight into the tensor on CPU; through one
temporary host tensor otherwise), so no second copy of the model is ever held and the bits
depend only on ``(seed, name, shape, dtype)``: not on the device, the number of workers or
threads, or what was built before. Tensors are filled by ``torch.get_num_threads()`` worker
threads (the ops release the GIL; CPU sampling is serial per tensor, so this is where the
speed comes from: ``wan14b-like`` is 14B samples). Non-persistent buffers are recomputed by
their module's ``init_buffers``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from dlo.models.pipeline import DemoPipeline
from dlo.models.presets import Preset, get_preset
from dlo.platform.env import cpu_share
from dlo.platform.progress import progress

logger = logging.getLogger(__name__)

WEIGHT_STD = 0.02
"""Std of Linear, Embedding and other free weights (modulation tables, positions)."""


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of the tensor called ``name`` in a model built with ``seed``."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _init_rule(module: nn.Module, local_name: str, tensor: torch.Tensor) -> tuple[str, float]:
    """``("normal", std)``, ``("zeros", 0)`` or ``("ones", 0)`` for one parameter."""
    if local_name == "bias":
        return ("zeros", 0.0)
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
        return ("ones", 0.0)
    if isinstance(module, nn.Conv2d):
        fan_in = math.prod(tensor.shape[1:])
        return ("normal", 1.0 / math.sqrt(fan_in))
    return ("normal", WEIGHT_STD)


def _cast_skeleton(model: nn.Module, dtype: torch.dtype) -> None:
    # see [Note: fp32 tensors] in dlo.models.blocks
    for module in model.modules():
        keep = getattr(module, "_keep_in_fp32", ())
        for name, param in module.named_parameters(recurse=False):
            param.data = param.data.to(torch.float32 if name in keep else dtype)
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(module, name, buf.to(torch.float32 if name in keep else dtype))


@torch.no_grad()
def _fill(param: torch.Tensor, rule: tuple[str, float], seed: int) -> None:
    kind, std = rule
    if kind == "zeros":
        param.zero_()
    elif kind == "ones":
        param.fill_(1.0)
    else:
        generator = torch.Generator("cpu").manual_seed(seed)
        if param.device.type == "cpu" and param.is_contiguous():
            param.normal_(0.0, std, generator=generator)
        else:
            host = torch.empty(param.shape, dtype=param.dtype).normal_(
                0.0, std, generator=generator
            )
            param.copy_(host)


def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter and non-persistent buffer of ``model`` deterministically.

    See [Note: deterministic materialization]; names are relative to ``model``.
    """
    jobs = []
    for module_name, module in model.named_modules():
        for local_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{local_name}" if module_name else local_name
            jobs.append((param, _init_rule(module, local_name, param), tensor_seed(seed, name)))
    # largest first, so one big tensor does not start last
    jobs.sort(key=lambda job: -job[0].numel())
    total = sum(job[0].numel() * job[0].element_size() for job in jobs)
    with ThreadPoolExecutor(max_workers=max(torch.get_num_threads(), cpu_share())) as pool:
        futures = [pool.submit(_fill, *job) for job in jobs]
        for future in progress(futures, desc="dlo: random weights", unit="tensor"):
            future.result()
    logger.debug("filled %d tensors (%.2f GB)", len(jobs), total / 1e9)
    with torch.no_grad():
        for module in model.modules():
            init_buffers = getattr(module, "init_buffers", None)
            if callable(init_buffers):
                init_buffers()


def build_pipeline(
    preset: str | Preset,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> DemoPipeline:
    """Build the demo pipeline with deterministic random weights.

    Args:
        preset: a :class:`Preset` or one of ``"tiny"``, ``"medium"``, ``"wan14b-like"``.
        dtype: floating dtype of the weights; the tensors listed in ``_keep_in_fp32`` (the
            cross-attention norm, the RoPE table) stay float32.
        device: where the tensors are allocated. ``"meta"`` returns the cast skeleton
            without data (for counting and planning).
        seed: the same seed gives bitwise identical weights on any device.

    Returns:
        A :class:`DemoPipeline` in eval mode with ``requires_grad=False`` everywhere.

    Raises:
        ValueError: unknown preset.
        TypeError: ``dtype`` is not a floating dtype.

    Example:
        >>> pipe = build_pipeline("tiny", dtype=torch.float32, seed=1)
        >>> sum(p.numel() for p in pipe.parameters()) == PRESETS["tiny"].num_params()
        True
    """
    p = get_preset(preset)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    target = torch.device(device)
    with torch.device("meta"):
        pipe = DemoPipeline(p)
    _cast_skeleton(pipe, dtype)
    pipe.requires_grad_(False)
    pipe.eval()
    if target.type == "meta":
        return pipe
    pipe.to_empty(device=target)
    init_weights(pipe, seed)
    return pipe
