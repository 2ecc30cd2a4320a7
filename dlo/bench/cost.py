"""What a ``dlo bench`` run will cost, said before it starts: the platform's default preset and
token counts, the arithmetic of the DiT forwards it will run, and, on a CPU, the time that
arithmetic takes at the CPU's measured matmul rate.

[Note: bench defaults by platform]
``dlo bench`` with no flags measures the ``medium`` preset (24 blocks, 8 GB in bf16) at 4096
and 16384 tokens on a GPU: seconds per method. On a CPU the same forwards take hours (a CPU
does tens of GFLOP/s in bf16, and each medium forward at 16384 tokens is about 140 TFLOP), and
on a CPU the timings only check that every method runs (nothing overlaps without streams).
So on a CPU the defaults are the ``tiny`` preset at small token counts, which finishes in
seconds; a preset or token counts given explicitly are kept, and the run says up front how
long it will take at the rate this CPU measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dlo.models.presets import Preset

DEFAULT_PRESET = {"gpu": "medium", "cpu": "tiny"}
"""The preset ``dlo bench`` measures when ``--preset`` is not given, by platform."""

DEFAULT_TOKENS = {"tiny": "64,256", "medium": "4096,16384", "wan14b-like": "4096,16384"}
"""The token counts ``dlo bench`` measures when ``--tokens`` is not given, by preset."""

LIKE_DEFAULT_TOKENS = "4096,16384"
"""``--tokens`` of ``dlo bench --like`` when not given (each model reads it in its own unit)."""


def default_preset(has_streams: bool) -> str:
    """The preset of a bench run with no ``--preset`` (see [Note: bench defaults by platform])."""
    return DEFAULT_PRESET["gpu" if has_streams else "cpu"]


def default_tokens(preset: str) -> str:
    """The token counts of a bench run with no ``--tokens``, for ``preset``."""
    return DEFAULT_TOKENS.get(preset, DEFAULT_TOKENS["medium"])


def forward_flops(preset: Preset, tokens: int) -> float:
    """Multiply-adds (x2) of one DiT forward at ``tokens``: every block's linear layers over
    every token, plus self-attention's two ``tokens x tokens`` products and, with
    cross-attention, the two against the text. Pure arithmetic over the preset's sizes."""
    block_numel = preset.block_nbytes(torch.float32) / 4
    per_block = 2.0 * block_numel * tokens + 4.0 * tokens * tokens * preset.dim
    if preset.cross_attention:
        per_block += 4.0 * tokens * preset.text_len * preset.dim
    return per_block * preset.num_blocks


@dataclass(frozen=True)
class Cost:
    """What a bench run will compute: ``num_forwards`` DiT forwards, ``flops`` in all."""

    num_forwards: int
    flops: float

    def seconds_at(self, flops_per_s: float) -> float:
        """The time the run's arithmetic takes at ``flops_per_s`` (a lower bound: copies,
        enables and the limits' probes come on top)."""
        return self.flops / flops_per_s


def bench_cost(
    preset: Preset, tokens: list[int], num_rows_per_tokens: int, *, warmup: int, reps: int
) -> Cost:
    """The forwards of ``num_rows_per_tokens`` rows at each token count: each row runs
    ``max(1, warmup) + reps`` forwards (the first one runs even without warm-up)."""
    per_row = max(1, warmup) + reps
    flops = sum(forward_flops(preset, t) for t in tokens) * num_rows_per_tokens * per_row
    return Cost(num_rows_per_tokens * len(tokens) * per_row, flops)


def matmul_flops_per_s(dtype: torch.dtype, *, n: int = 512, seconds: float = 0.2) -> float:
    """This CPU's rate on an ``n x n`` matmul in ``dtype``, measured for about ``seconds``."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b  # the first call pays for the kernel's setup
    done, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or done == 0:
        a @ b
        done += 1
    return 2.0 * n**3 * done / elapsed


def describe(cost: Cost, flops_per_s: float | None) -> str:
    """One line for the run's header: the forwards and, with a measured rate, the time."""
    line = f"{cost.num_forwards} DiT forwards, {cost.flops / 1e12:.2f} TFLOP"
    if flops_per_s is None:
        return line
    s = cost.seconds_at(flops_per_s)
    when = (
        f"{s / 3600:.1f} hours"
        if s >= 3600
        else f"{s / 60:.1f} minutes"
        if s >= 60
        else f"{s:.0f} s"
    )
    return f"{line}: at this CPU's {flops_per_s / 1e9:.0f} GFLOP/s (matmul), at least {when}"
