"""The flags of ``dlo run --pipeline``: a folder's call (sizes, prompts, output) and
context parallelism."""

from __future__ import annotations

import argparse

CONTEXT_PARALLEL = ("ulysses", "ring")
"""``--context-parallel`` kinds (diffusers' ``ContextParallelConfig`` degrees)."""

PIPELINE_CALL_FLAGS = {
    "height": "height",
    "width": "width",
    "frames": "num_frames",
    "guidance": "guidance_scale",
    "negative_prompt": "negative_prompt",
    "max_sequence_length": "max_sequence_length",
}
"""``--pipeline`` flags (argparse dest) -> the pipeline ``__call__`` argument they set."""

PIPELINE_ONLY = ("prompt", *PIPELINE_CALL_FLAGS, "output", "context_parallel")
"""Flags (argparse dest) only ``--pipeline`` takes."""

MAX_SIDE_PX = 16384
"""The largest ``--height`` and ``--width`` (16K; larger sizes would allocate latents and
attention without end before any pipeline refused them)."""
MAX_FRAMES = 4096
"""The most ``--frames`` (video pipelines make 81 to 257)."""
MAX_GUIDANCE = 100
"""The largest ``--guidance`` (pipelines use 1 to 10; 1e308 overflows to inf, NaN images)."""

PIPELINE_CALL_RANGES: dict[str, tuple[float, float | None]] = {
    "height": (1, MAX_SIDE_PX),
    "width": (1, MAX_SIDE_PX),
    "frames": (1, MAX_FRAMES),
    "guidance": (0, MAX_GUIDANCE),
    "max_sequence_length": (1, None),
}
"""``--pipeline`` call flags (argparse dest) -> ``(low, high)``, their range (None: no bound
above), checked before any work; NaN is in none."""


def add_pipeline_arguments(r: argparse.ArgumentParser) -> None:
    """The flags of ``dlo run --pipeline``."""
    r.add_argument(
        "--pipeline",
        default=None,
        metavar="DIR",
        help="run this diffusers pipeline folder (model_index.json; see dlo save-pipeline) "
        "instead of the demo: loaded per rank, then the pipeline's own __call__",
    )
    r.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="--pipeline: the prompt (repeat it: rank r takes prompt r mod the count)",
    )
    r.add_argument("--negative-prompt", default=None, help="--pipeline: the negative prompt")
    r.add_argument(
        "--height",
        type=int,
        default=None,
        help=f"--pipeline: image height in px (1 to {MAX_SIDE_PX})",
    )
    r.add_argument(
        "--width",
        type=int,
        default=None,
        help=f"--pipeline: image width in px (1 to {MAX_SIDE_PX})",
    )
    r.add_argument(
        "--frames", type=int, default=None, help=f"--pipeline: video frames (1 to {MAX_FRAMES})"
    )
    r.add_argument(
        "--guidance",
        type=float,
        default=None,
        help=f"--pipeline: guidance scale (0 to {MAX_GUIDANCE})",
    )
    r.add_argument(
        "--max-sequence-length", type=int, default=None, help="--pipeline: text tokens (>= 1)"
    )
    r.add_argument(
        "--output",
        default=None,
        help="--pipeline: write the result: PATH.png (one image; a video is refused before "
        "any work), PATH.mp4 (video, needs imageio) or a directory (a PNG per frame: an "
        "existing one whatever its name, a path ending in /, or one without a suffix); other "
        "ranks add .rankR",
    )
    r.add_argument(
        "--context-parallel",
        default=None,
        choices=CONTEXT_PARALLEL,
        help="--pipeline under torchrun: every DiT split along the sequence over all ranks "
        "(diffusers' enable_parallelism: ulysses or ring attention), every rank running the "
        "same request (the first --prompt, --seed) in lock step; with --transfer allgather "
        "each rank also holds 1/N of every block. Rank 0 writes the output",
    )
