"""``dlo bench`` finishes with its defaults on the platform at hand and says up front what a run
will cost (see [Note: bench defaults by platform])."""

from __future__ import annotations

import logging

import pytest
import torch

from dlo.bench.cost import (
    bench_cost,
    default_preset,
    default_tokens,
    describe,
    forward_flops,
    matmul_flops_per_s,
)
from dlo.cli import main
from dlo.models import PRESETS


def test_defaults_by_platform() -> None:
    assert default_preset(has_streams=True) == "medium"
    assert default_preset(has_streams=False) == "tiny"
    assert default_tokens("medium") == "4096,16384" and default_tokens("tiny") == "64,256"


def test_forward_flops_of_the_medium_preset() -> None:
    medium = PRESETS["medium"]
    # 24 blocks of 18 * dim**2 parameters (+ biases) over every token, plus attention
    linear = 2 * 24 * 18 * 3072**2 * 16384
    attention = 4 * 24 * 16384**2 * 3072
    assert forward_flops(medium, 16384) == pytest.approx(linear + attention, rel=1e-3)
    # the tiny preset's cross-attention counts too
    tiny = PRESETS["tiny"]
    assert forward_flops(tiny, 64) > 5 * (
        2 * tiny.block_nbytes(__import__("torch").float32) / 4 * 64
    )


def test_the_old_default_on_a_cpu_is_said_to_take_hours() -> None:
    """What the newcomer ran: medium at 4096 and 16384 tokens, eight rows, 2 + 5 forwards."""
    cost = bench_cost(PRESETS["medium"], [4096, 16384], 8, warmup=2, reps=5)
    assert cost.num_forwards == 8 * 2 * 7
    line = describe(cost, 100e9)  # a fast CPU's bf16 matmul
    assert "hours" in line and cost.seconds_at(100e9) > 3 * 3600, line
    assert "TFLOP" in describe(cost, None) and "hours" not in describe(cost, None)


def test_the_matmul_rate_is_measured() -> None:
    rate = matmul_flops_per_s(torch.float32, n=128, seconds=0.05)
    assert 1e8 < rate < 1e14


def test_bench_with_no_flags_finishes_on_a_cpu(caplog: pytest.LogCaptureFixture) -> None:
    """``dlo bench`` as the README gives it: the tiny preset on a CPU, in seconds, saying up
    front what it runs and what it costs (before: medium at 4096 and 16384 tokens, hours)."""
    caplog.set_level(logging.WARNING)
    assert main(["bench"]) == 0
    text = caplog.text
    assert "dlo bench: preset tiny" in text and "tokens 64,256" in text, text
    assert "dlo bench: about " in text and "DiT forwards" in text and "at least" in text
    assert "diffusers-group: skipped: needs CUDA streams" in text
    assert text.index("dlo bench: about ") < text.index("resident ")


def test_an_explicit_preset_and_tokens_are_kept(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    argv = ["bench", "--preset", "tiny", "--tokens", "32", "--methods", "resident"]
    assert main([*argv, "--warmup", "0", "--reps", "1"]) == 0
    # the first forward runs even without warm-up
    assert "tokens 32," in caplog.text and "about 2 DiT forwards" in caplog.text
