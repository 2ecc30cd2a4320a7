"""Declarations for known third-party classes (diffusers), so they need none of their own.

A diffusers transformer does not carry ``_layerwise_offload_blocks_attrs`` and a diffusers
pipeline does not carry ``SupportsComponentDiscovery`` lists; this registry says it for them.
:mod:`dlo.plan.topology` consults it after every declaration the model or pipeline makes itself (see
its module docstring for the order), so a declaration always wins over the registry.

[Note: adapters are keyed by class path]
Entries are keyed by the fully qualified name of the class that defines them,
``f"{cls.__module__}.{cls.__qualname__}"``, and a lookup walks the class's MRO. So this module
never imports diffusers (it is pure data and works whether or not the ``diffusers`` extra is
installed), a user's subclass of a registered class matches, and so does the dynamic
``FSDP<Class>`` subclass that FSDP2's ``fully_shard`` swaps in. The keys name the module where
diffusers defines the class, not the package that re-exports it.

No resident modules are registered: everything outside the block containers of these
transformers (patch/time/text embedders, rotary embedders, output norm and projection) is
non-block state of the DiT, which the layer backend already places on the device.
Text encoders are listed as pipeline components but stream no blocks (no
``encoder_block_attrs``): they are ``transformers`` models, outside this registry.

Verified against diffusers 0.42.1 (``diffusers/models/transformers/*.py`` and
``diffusers/pipelines/*/pipeline_*.py``).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class ModelAdapter:
    """What a registered DiT class would declare itself.

    Example:
        >>> ModelAdapter(block_attrs=("transformer_blocks", "single_transformer_blocks"))
        ModelAdapter(block_attrs=('transformer_blocks', 'single_transformer_blocks'))
    """

    block_attrs: tuple[str, ...]
    """Ordered block container attrs (execution order), as ``_layerwise_offload_blocks_attrs``."""


@dataclass(frozen=True)
class PipelineAdapter:
    """Component attribute names of a registered pipeline class.

    Names whose attribute is missing or not an ``nn.Module`` on the instance are skipped
    without a problem: diffusers pipelines have optional components (``image_encoder``,
    Wan 2.1's absent ``transformer_2``) that are ``None``.
    """

    dits: tuple[str, ...]
    encoders: tuple[str, ...] = ()
    vaes: tuple[str, ...] = ()


_DIFFUSERS_MODELS = "diffusers.models.transformers"


_DIFFUSERS_PIPELINES = "diffusers.pipelines"


MODEL_ADAPTERS: Mapping[str, ModelAdapter] = types.MappingProxyType(
    {
        # double-stream blocks, then single-stream blocks (FluxTransformer2DModel.forward)
        f"{_DIFFUSERS_MODELS}.transformer_flux.FluxTransformer2DModel": ModelAdapter(
            block_attrs=("transformer_blocks", "single_transformer_blocks")
        ),
        f"{_DIFFUSERS_MODELS}.transformer_wan.WanTransformer3DModel": ModelAdapter(
            block_attrs=("blocks",)
        ),
        f"{_DIFFUSERS_MODELS}.transformer_sd3.SD3Transformer2DModel": ModelAdapter(
            block_attrs=("transformer_blocks",)
        ),
        f"{_DIFFUSERS_MODELS}.transformer_qwenimage.QwenImageTransformer2DModel": ModelAdapter(
            block_attrs=("transformer_blocks",)
        ),
    }
)


PIPELINE_ADAPTERS: Mapping[str, PipelineAdapter] = types.MappingProxyType(
    {
        f"{_DIFFUSERS_PIPELINES}.flux.pipeline_flux.FluxPipeline": PipelineAdapter(
            dits=("transformer",),
            encoders=("text_encoder", "text_encoder_2", "image_encoder"),
            vaes=("vae",),
        ),
        # Wan 2.2 A14B: transformer (high noise) and transformer_2 (low noise) take turns
        f"{_DIFFUSERS_PIPELINES}.wan.pipeline_wan.WanPipeline": PipelineAdapter(
            dits=("transformer", "transformer_2"),
            encoders=("text_encoder",),
            vaes=("vae",),
        ),
        (
            f"{_DIFFUSERS_PIPELINES}.stable_diffusion_3.pipeline_stable_diffusion_3."
            "StableDiffusion3Pipeline"
        ): PipelineAdapter(
            dits=("transformer",),
            encoders=("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder"),
            vaes=("vae",),
        ),
        f"{_DIFFUSERS_PIPELINES}.qwenimage.pipeline_qwenimage.QwenImagePipeline": PipelineAdapter(
            dits=("transformer",),
            encoders=("text_encoder",),
            vaes=("vae",),
        ),
    }
)


def class_path(cls: type) -> str:
    """The registry key of ``cls``: ``f"{cls.__module__}.{cls.__qualname__}"``."""
    return f"{cls.__module__}.{cls.__qualname__}"


_Entry = TypeVar("_Entry")


def _lookup(cls: type, registry: Mapping[str, _Entry]) -> _Entry | None:
    for base in cls.__mro__:
        entry = registry.get(class_path(base))
        if entry is not None:
            return entry
    return None


def model_adapter(cls: type) -> ModelAdapter | None:
    """The registered declaration of DiT class ``cls`` or its nearest registered base.

    Example:
        >>> class MyFlux(FluxTransformer2DModel): ...  # doctest: +SKIP
        >>> model_adapter(MyFlux).block_attrs  # doctest: +SKIP
        ('transformer_blocks', 'single_transformer_blocks')
    """
    return _lookup(cls, MODEL_ADAPTERS)


def pipeline_adapter(cls: type) -> PipelineAdapter | None:
    """The registered components of pipeline class ``cls`` or its nearest registered base."""
    return _lookup(cls, PIPELINE_ADAPTERS)
