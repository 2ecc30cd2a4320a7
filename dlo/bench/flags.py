"""The flags of ``dlo bench`` and their list parsing."""

from __future__ import annotations

import argparse
from typing import Any

from dlo.bench.budgets import sweep_counts
from dlo.bench.cost import DEFAULT_TOKENS, LIKE_DEFAULT_TOKENS
from dlo.bench.like import LIKE
from dlo.bench.methods import METHODS
from dlo.commands.args import COMPILE_MODES, DTYPES, PRESET_HELP
from dlo.config.fields import CODECS


def int_list(flag: str, text: Any) -> list[int]:
    """``"2,3"`` -> ``[2, 3]``: positive ints, or a ValueError naming the flag and value."""
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag}={text!r}: expected positive integers separated by commas")
    return values


def method_list(text: str, known: tuple[str, ...]) -> list[str]:
    """``--methods``: comma-separated names of ``known``, or a ValueError naming the others."""
    methods = [m for m in text.split(",") if m]
    bad = [m for m in methods if m not in known]
    if bad:
        raise ValueError(f"--methods: {bad} not among {list(known)}")
    return methods


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``dlo bench``."""
    p.add_argument(
        "--preset",
        default=None,
        help=PRESET_HELP + " (default: medium on a GPU; tiny on a CPU, where medium takes hours)",
    )
    p.add_argument(
        "--tokens",
        default=None,
        help="comma-separated token counts (default: the preset's: "
        + "; ".join(f"{k} {v}" for k, v in DEFAULT_TOKENS.items())
        + f"; with --like {LIKE_DEFAULT_TOKENS})",
    )
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated; each runs where the platform and world size allow (the others "
        "say why they are skipped)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed forwards per row (>= 0; the first forward, timed apart, runs even at 0)",
    )
    p.add_argument("--reps", type=int, default=5, help="timed forwards per row (>= 1)")
    p.add_argument(
        "--num-slots", default="2", help="slots of the dlo methods; a comma list sweeps them"
    )
    p.add_argument(
        "--chunk-mb", default="64", help="chunk MiB of the dlo methods; a comma list sweeps them"
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        choices=COMPILE_MODES,
        help="compile every DiT block of every method (block.compile(), as diffusers' "
        "compile_repeated_blocks) in this torch.compile mode; the first forward's time, "
        "compile included, is reported apart",
    )
    p.add_argument(
        "--codec",
        default="none",
        help="codecs of the manual dlo rows (ring, rank-local, node-shared, AllGather), comma-separated "
        f"from {','.join(CODECS)}: e.g. none,ans adds a row per codec; auto gives the "
        "dlo-auto rows codec='auto' (see [Note: block codecs])",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the lock-step check")
    p.add_argument(
        "--nccl-max-ctas", type=int, default=None, help="cap the SMs NCCL may use for dlo's gathers"
    )
    p.add_argument(
        "--profile",
        default=None,
        help="folder for one profiled forward per dlo method and token count",
    )
    p.add_argument(
        "--like",
        default=None,
        choices=sorted(LIKE),
        help="instead of a preset: this diffusers transformer at its published shape, random "
        "weights, under resident, dlo-ring and diffusers-group (--tokens: "
        + "; ".join(f"{k}: {v.tokens_help}" for k, v in sorted(LIKE.items()))
        + ")",
    )
    p.add_argument("--like-slots", type=int, default=2, help="slots of dlo-ring with --like")
    p.add_argument(
        "--budgets",
        default=None,
        help="with --like: comma-separated device budgets (GiB); per budget, every method "
        "under the same allocator cap: resident (where it fits), dlo with no flags, the best "
        "manual dlo setting of a sweep (dlo-best) and diffusers-group",
    )
    p.add_argument(
        "--host-budget-gb",
        type=float,
        default=0.0,
        help="the dlo-disk row's host budget (GiB; --methods must name dlo-disk: it writes the "
        "DiT to --disk-dir and streams the blocks beyond the budget from there)",
    )
    p.add_argument(
        "--disk-dir",
        default=None,
        help="the folder on the disk the dlo-disk row measures (default: the system's "
        "temporary folder; a tmpfs there is memory, and the row says it read buffered)",
    )
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--markdown", default=None, help="write the markdown table here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")


def add_call_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a pipeline folder's calls (the pipeline benches' shared part)."""
    p.add_argument(
        "--size",
        action="append",
        required=True,
        help="HEIGHTxWIDTH[xFRAMES] of a call; repeat for calls in sequence in one enable",
    )
    p.add_argument("--steps", default="4", help="steps per call: one, or one per --size")
    p.add_argument("--output-type", default="pt", choices=("pt", "latent"))
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", action="append", default=None)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--max-sequence-length", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--markdown", default=None, help="write the markdown table here")
    p.set_defaults(forward_marks=False)  # Bench reads it; pipeline_budgets has the flag


def parse_size(text: str) -> tuple[int, int, int | None]:
    """``"480x832"`` -> ``(480, 832, None)``, ``"480x832x81"`` -> ``(480, 832, 81)``; a
    ValueError naming ``--size`` otherwise."""
    try:
        parts = [int(v) for v in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (2, 3) or any(v < 1 for v in parts):
        raise ValueError(f"--size={text!r}: expected HEIGHTxWIDTH or HEIGHTxWIDTHxFRAMES")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def sweep_list(text: str, num_blocks: int, auto: int) -> list[int]:
    """``--sweep-counts``: ``"grid"`` (:func:`dlo.bench.budgets.sweep_counts`) or a comma
    list of counts and ``auto``/``auto+K``/``auto-K`` (the dlo row's resident count),
    within ``[0, num_blocks]``."""
    if text == "grid":
        return sweep_counts(num_blocks, auto)
    out: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        try:
            if item.startswith("auto"):
                out.add(auto + int(item[4:] or 0))
            else:
                out.add(int(item))
        except ValueError:
            raise ValueError(
                f"--sweep-counts={text!r}: expected 'grid' or counts and auto[+-K], "
                "separated by commas"
            ) from None
    return sorted(r for r in out if 0 <= r <= num_blocks)
