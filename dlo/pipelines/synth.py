"""Random-weight diffusers pipeline folders in real layouts (``dlo save-pipeline --like``).

Each :class:`~dlo.pipelines.layouts.FolderLike` names a diffusers pipeline class and its components at their
published configs (or a tiny size CPU tests run); :func:`save_folder` builds them on the CPU
with weights drawn from one pool of N(0, 0.02) values (:func:`fill_random`), tokenizers made
offline (:func:`offline_tokenizer`: letters and digits as word pieces, no download), and
writes the folder with ``save_pretrained`` (sharded safetensors with an index). Random
weights are a proxy for speed and memory, never for anything that depends on the values
(compression ratios, image quality).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlo.io.files import CheckpointWriteError, check_writable_dir
from dlo.pipelines.classes import quiet_imports
from dlo.pipelines.folder import dtype_kwarg, params_on_meta
from dlo.pipelines.layouts import FolderLike, Part
from dlo.platform.progress import library_bars

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- random weights
@contextlib.contextmanager
def no_init(dtype: torch.dtype) -> Iterator[None]:
    """Build without torch's initializers (the weights are drawn after), in ``dtype``."""
    init = torch.nn.init
    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(init, n) for n in names}
    before = torch.get_default_dtype()
    for n in names:
        setattr(init, n, lambda t, *a, **k: t)
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
        for n, f in saved.items():
            setattr(init, n, f)


POOL = 1 << 24
"""Random values drawn once per build; every weight is a window of them (drawing 14 B
normal samples would take minutes)."""


def fill_random(model: nn.Module, dtype: torch.dtype, *, seed: int = 0) -> nn.Module:
    """Every parameter of ``model`` a window of one pool of N(0, 0.02) values drawn with
    ``seed`` (each tensor at its own offset); returns it in eval mode, no grad."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2 * POOL, generator=g).mul_(0.02).to(dtype)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            flat = p.view(-1)
            start = (i * 7919) % POOL
            for at in range(0, flat.numel(), POOL):
                n = min(POOL, flat.numel() - at)
                flat[at : at + n].copy_(pool[start : start + n].to(p.dtype))
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------- tokenizers
_PIECES = "abcdefghijklmnopqrstuvwxyz0123456789"


def offline_tokenizer(model_max_length: int, *, clip: bool = False) -> Any:
    """A fast tokenizer made without a download: letters and digits as word pieces (any
    lowercase word is a sequence of known pieces), T5-style ``</s>`` at the end (CLIP:
    ``<|startoftext|>`` first, ``<|endoftext|>`` last)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bos, eos, pad, unk = (
        ("<|startoftext|>", "<|endoftext|>", "<|endoftext|>", "<unk>")
        if clip
        else (None, "</s>", "<pad>", "<unk>")
    )
    specials = list(dict.fromkeys(t for t in (pad, eos, unk, bos) if t is not None))
    vocab = {t: i for i, t in enumerate(specials)}
    for piece in (*_PIECES, *(f"##{c}" for c in _PIECES)):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    single = f"{bos} $A {eos}" if bos else f"$A {eos}"
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, vocab[t]) for t in specials]
    )
    extra = {"bos_token": bos} if bos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=model_max_length,
        pad_token=pad,
        eos_token=eos,
        unk_token=unk,
        **extra,
    )


# ----------------------------------------------------------------------------- folders
def build_part(part: Part, dtype: torch.dtype, seed: int) -> nn.Module:
    """``part`` on the CPU with random weights in ``dtype``: built with its parameters on
    ``meta`` (no library initializer runs: transformers' own would draw every weight), then
    each parameter given memory and filled (:func:`fill_random`)."""
    with quiet_imports():
        cls = getattr(importlib.import_module(part.library), part.cls)
    with params_on_meta(dtype):
        if part.library == "transformers":
            config = cls.config_class(**part.config)
            model = cls._from_config(config, **{dtype_kwarg(): dtype})
        else:
            model = cls(**part.config)
    real: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in real:  # tied parameters stay one
                    real[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), False)
                module._parameters[name] = real[id(p)]
    return fill_random(model, dtype, seed=seed)


def build_pipeline(like: FolderLike, dtype: torch.dtype | None = None, seed: int = 0) -> Any:
    """``like``'s diffusers pipeline on the CPU with random weights (``dtype``: its own)."""
    import diffusers

    dtype = dtype or like.dtype
    components: dict[str, Any] = {
        name: build_part(part, dtype, seed + i)
        for i, (name, part) in enumerate(like.modules.items())
    }
    for name, length in like.tokenizers.items():
        clip = like.modules.get(name.replace("tokenizer", "text_encoder"), None)
        components[name] = offline_tokenizer(length, clip=clip is not None and "CLIP" in clip.cls)
    sched_cls, sched_config = like.scheduler
    with quiet_imports():
        scheduler, pipeline = getattr(diffusers, sched_cls), getattr(diffusers, like.pipeline)
    components["scheduler"] = scheduler(**sched_config)
    return pipeline(**components, **like.options)


def save_folder(
    like: FolderLike,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write ``like`` as a pipeline folder at ``path`` (which must not exist or be empty).

    Raises:
        ValueError: ``path`` holds files.
        dlo.io.files.CheckpointWriteError: ``path`` is a file, or a folder this process
            cannot write in (both before the build), or a write failed (the folder, if this
            call made it, is removed).
    """
    out = Path(path)
    check_writable_dir(out, "save-pipeline: DIR")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"save-pipeline: DIR={str(out)!r} exists and is not empty")
    t0 = time.perf_counter()
    pipe = build_pipeline(like, dtype, seed)
    t1 = time.perf_counter()
    made = not out.exists()
    try:
        with library_bars():
            pipe.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    except OSError as e:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise CheckpointWriteError(f"save-pipeline: cannot write {out}: {e}") from e
    logger.info(
        "dlo save-pipeline: built %s in %.1fs, wrote it in %.1fs",
        like.name,
        t1 - t0,
        time.perf_counter() - t1,
    )
    return out
