"""What the subcommands share: argument types, range checks, compiling the demo DiT."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from dlo.hooks.compiled import SUPPORTED_MODES

DTYPES = ("bfloat16", "float16", "float32")
PRESET_HELP = (
    "demo pipeline preset: tiny (seconds on a laptop CPU), medium (24 blocks, 8 GB), "
    "wan14b-like (40 blocks, 28 GB)"
)


def int_or_auto(text: str) -> int | str:
    """An int, or ``"auto"`` (the config checks the range and names the field)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or 'auto'") from None


COMPILE_MODES = SUPPORTED_MODES
"""The ``--compile`` modes (those dlo serves; CUDA-graph modes are refused)."""


def check_ranges(checks: Iterable[tuple[str, float | None, float, float | None]]) -> None:
    """Refuse a flag outside its range: ``(flag, value, low, high)`` each, ``high`` None for
    no bound above, a value of None skipped; NaN is in no range.

    Raises:
        ValueError: naming the flag, its value and the range.
    """
    for flag, value, low, high in checks:
        if value is None:
            continue
        if high is None and not value >= low:
            raise ValueError(f"{flag}={value} must be >= {low}")
        if high is not None and not low <= value <= high:
            raise ValueError(f"{flag}={value} must be in [{low}, {high}]")


def check_minimums(checks: Iterable[tuple[str, int | None, int]]) -> None:
    """Refuse a flag below its minimum: ``(flag, value, minimum)`` each, None skipped.

    Raises:
        ValueError: naming the flag, its value and the minimum.
    """
    check_ranges((flag, value, minimum, None) for flag, value, minimum in checks)


def compile_blocks(dit: Any, mode: str | None) -> Any:
    """Regional compile, as diffusers' ``compile_repeated_blocks``: ``block.compile()`` on
    every block of the DiT (``mode=None``: no compile)."""
    if mode is not None:
        getattr(dit, "compile_repeated_blocks")(mode=None if mode == "default" else mode)  # noqa: B009
    return dit


def steady_median(step_ms: list[float]) -> float:
    """The median step of the steady state: the steps after the first (the first alone when
    there is one; 0.0 with none), the upper one of an even count."""
    steady = step_ms[1:] or step_ms
    return sorted(steady)[len(steady) // 2] if steady else 0.0


def count_nonfinite(out: torch.Tensor) -> int:
    """How many values of a run's output are NaN or inf."""
    return int(out.numel() - torch.isfinite(out.float()).sum())


def say_nonfinite(reports: list[dict[str, Any]]) -> None:
    """One line on stderr naming the ranks whose output holds NaN or inf and how many
    values (the reports' ``output_nonfinite``); nothing where every output is finite."""
    bad = [f"rank {r['rank']}: {r['output_nonfinite']}" for r in reports if r["output_nonfinite"]]
    if bad:
        sys.stdout.flush()  # after the report
        print(
            f"dlo: error: the output has non-finite values (NaN or inf): {', '.join(bad)}",
            file=sys.stderr,
            flush=True,
        )


DISK_FIELDS = ("num_disk_blocks", "disk_read_nbytes", "disk_read_gbps", "disk_direct")
"""The disk tier's stats a run's report carries (``--host-budget-gb``)."""


def disk_fields(stats: dict[str, Any]) -> dict[str, Any]:
    """:data:`DISK_FIELDS` of a backend's ``stats()`` (0 / None without a layer backend)."""
    return {k: stats.get(k, None if k == "disk_direct" else 0) for k in DISK_FIELDS}


def report_ranks(
    report: dict[str, Any], world_size: int, rank0: bool, render: Callable[[list], str]
) -> bool:
    """Gather every rank's ``report``; rank 0 prints ``render(reports)`` and a line for any
    non-finite output. Returns whether every rank's output is finite and, where checked,
    bitwise (the run's exit status)."""
    reports = [report]
    if dist.is_initialized():
        reports = [None] * world_size  # type: ignore[list-item]
        dist.all_gather_object(reports, report)
    if rank0:
        print(render(reports))
        say_nonfinite(reports)
    return all(r["output_finite"] and r["parity"] in (None, True) for r in reports)


def parity_word(parity: bool | None) -> str:
    """How a summary row says a ``--check`` result."""
    return {None: "not checked", True: "bitwise equal", False: "MISMATCH"}[parity]
