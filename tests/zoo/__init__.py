"""A zoo of real model classes at tiny sizes: every diffusers DiT class and the text encoders
(transformers) the supported pipelines use, each as a :class:`Case` that builds the model from
a tiny config with random weights and makes forward inputs. Nothing is downloaded.

The cases are test data: ``tests/cpu/test_zoo.py`` runs each one through dlo with no
declarations, and ``tests/reference_tables.py`` writes the compatibility table from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Case:
    """One model class at a tiny size.

    ``build`` returns the model in eval mode, float32, on CPU, with random weights drawn
    from torch's global generator (the caller seeds it). ``inputs(g)`` returns the forward
    keyword arguments, drawn from ``g``. ``call(model, inputs)`` runs one forward (default:
    ``model(**inputs)``) and returns whatever it returns; the tensors in it are compared.
    """

    name: str
    """The model class name (``type(build()).__name__``)."""
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], dict[str, Any]]
    call: Callable[[nn.Module, dict[str, Any]], Any] | None = None
    note: str = ""
    """Anything a reader of the table should know (e.g. an optional stack left unused)."""
    needs: dict[str, Any] | None = None
    """``OffloadConfig`` fields the ring needs for this class (None: nothing), with the
    reason in ``note``."""

    def run(self, model: nn.Module, inputs: dict[str, Any]) -> Any:
        if self.call is not None:
            return self.call(model, inputs)
        return model(**inputs)


def tensors_of(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a forward's output (tuples, lists, dicts, ModelOutput dataclasses)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, dict):  # transformers / diffusers ModelOutput are dicts too
        for v in output.values():
            yield from tensors_of(v)
    elif isinstance(output, (tuple, list)):
        for v in output:
            yield from tensors_of(v)
    elif hasattr(output, "__dataclass_fields__"):
        for k in output.__dataclass_fields__:
            yield from tensors_of(getattr(output, k))


DIT_MODULES = ("diffusers_a", "diffusers_b", "diffusers_c", "diffusers_d")
ENCODER_MODULE = "encoders"


def cases(module: str) -> list[Case]:
    """The cases of ``tests.zoo.<module>``."""
    import importlib

    return list(importlib.import_module(f"{__name__}.{module}").CASES)


def not_built(module: str) -> dict[str, str]:
    """Classes of ``tests.zoo.<module>`` that do not build on CPU, with the reason."""
    import importlib

    return dict(getattr(importlib.import_module(f"{__name__}.{module}"), "NOT_BUILT", {}))
