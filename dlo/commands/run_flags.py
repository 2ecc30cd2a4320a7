"""The flags of ``dlo run``, and the offload config they ask for (``--offload-config`` JSON,
vLLM-Omni's compact form included, or the individual flags)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from dlo.commands.args import COMPILE_MODES, DTYPES, PRESET_HELP, check_minimums, int_or_auto
from dlo.commands.pipeline_flags import (  # noqa: F401  (re-exported: its importers)
    PIPELINE_CALL_FLAGS,
    PIPELINE_CALL_RANGES,
    PIPELINE_ONLY,
    add_pipeline_arguments,
)
from dlo.config.fields import (
    CODECS,
    COMPONENT_ALIASES,
    GATHER_ENGINES,
    GATHER_SYNCS,
    HOST_BACKINGS,
    MODES,
    TRANSFERS,
)
from dlo.config.offload import OffloadConfig
from dlo.config.parallel import ParallelConfig
from dlo.io.files import CheckpointWriteError
from dlo.io.header_checks import loads_json

# the flags --offload-config replaces (give them inside the JSON instead)
OFFLOAD_FLAGS = {
    "mode": "--mode",
    "components": "--components",
    "transfer": "--transfer",
    "resident_layers": "--resident-layers",
    "num_slots": "--num-slots",
    "chunk_mb": "--chunk-mb",
    "no_pin": "--no-pin",
    "gather_engine": "--gather-engine",
    "gather_sync": "--gather-sync",
    "device_budget_gb": "--device-budget-gb",
    "host_budget_gb": "--host-budget-gb",
    "block_compute_ms": "--block-compute-ms",
    "host_backing": "--host-backing",
    "codec": "--codec",
}


def add_arguments(r: argparse.ArgumentParser) -> None:
    """The flags of ``dlo run``."""
    r.add_argument("--preset", default="tiny", help=PRESET_HELP)
    add_pipeline_arguments(r)
    r.add_argument(
        "--mode",
        default="layer",
        choices=MODES,
        help="layer: stream blocks through device slots; module: swap whole components; "
        "none: no offload",
    )
    r.add_argument(
        "--components",
        type=component_list,
        default=None,
        metavar="NAMES",
        help="the component kinds to offload, comma-separated: dit, encoder (or text_encoder) "
        "(OffloadConfig.components; with --mode layer, naming encoder also streams the text "
        "encoders whose blocks dlo finds by itself) (default: every DiT and the encoders that "
        "declare their blocks with --mode layer; DiTs and encoders with --mode module)",
    )
    r.add_argument(
        "--transfer",
        default="rank-local",
        choices=TRANSFERS,
        help="how a block reaches the device: whole blocks per rank (rank-local), 1/N per "
        "rank rebuilt by AllGather (allgather), one host copy per node (node-shared), or "
        "chosen from measured bandwidths (auto)",
    )
    r.add_argument(
        "--resident-layers",
        type=int_or_auto,
        default=None,
        help="leading DiT blocks kept on the device: an int >= 0 or 'auto' (as many as fit: a "
        "model that fits streams nothing) (default: auto on a GPU or with a budget, else 0)",
    )
    r.add_argument(
        "--num-slots",
        type=int_or_auto,
        default=None,
        help="device slots the streamed blocks take turns in: an int >= 1 or 'auto' (2, 3 "
        "with allgather, fewer with no room) (default: auto on a GPU, 2 on a CPU device)",
    )
    r.add_argument(
        "--device-budget-gb",
        type=float,
        default=None,
        help="device memory per rank for everything the run holds (GiB), as on a GPU of that "
        "size (a fifth kept for activations); sizes the resident blocks, caps the allocator",
    )
    r.add_argument(
        "--host-budget-gb",
        type=float,
        default=None,
        help="host memory per rank for the blocks' copy (GiB, 0 allowed); the blocks beyond "
        "it stay in --pipeline's or --checkpoint's files and are read for every use, ahead "
        "of the ring, with O_DIRECT where the filesystem allows it (AllGather: each rank "
        "its 1/N)",
    )
    r.add_argument(
        "--block-compute-ms",
        type=float,
        default=None,
        help="expected compute time of one block (ms; `dlo bench` prints it): lets "
        "--transfer auto take node-shared where compute hides whole-block copies",
    )
    r.add_argument(
        "--offload-config",
        default=None,
        metavar="JSON",
        help="the offload settings as one JSON object, or the path of a .json file holding "
        "one (OffloadConfig.from_dict: the compact form, vLLM-Omni's diffusion_offload_config "
        "or the legacy flags); replaces --mode, --transfer and the other offload flags",
    )
    r.add_argument(
        "--explain",
        action="store_true",
        help="print the automatic policy's decision and the numbers behind it (rank 0)",
    )
    r.add_argument(
        "--chunk-mb",
        type=int,
        default=64,
        help="transfer chunk in MiB (an int >= 1): every transfer moves a block as chunks; "
        "with allgather each chunk's gather starts once this rank's slice of it has landed",
    )
    r.add_argument("--no-pin", action="store_true", help="keep host storage pageable")
    r.add_argument(
        "--gather-engine",
        default="auto",
        choices=GATHER_ENGINES,
        help="AllGather by NCCL kernels or by copy engines over peer access (CUDA, one "
        "node); auto: the copy engines where every rank can use them",
    )
    r.add_argument(
        "--gather-sync",
        default="auto",
        choices=GATHER_SYNCS,
        help="the copy engine's barriers: stream memory operations or the barrier kernel",
    )
    r.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        choices=COMPILE_MODES,
        help="compile every DiT block (block.compile(), as diffusers' compile_repeated_blocks) "
        "in this torch.compile mode, once offload is enabled; --check compiles the resident "
        "reference the same way",
    )
    r.add_argument("--steps", type=int, default=8, help="denoising steps (an int >= 1)")
    r.add_argument("--tokens", type=int, default=None, help="latent tokens (default: the preset's)")
    r.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype")
    r.add_argument(
        "--seed", type=int, default=0, help="input seed of rank 0 (rank r uses seed + r)"
    )
    r.add_argument("--check", action="store_true", help="bitwise parity against a resident run")
    r.add_argument("--json", action="store_true", help="print a machine-readable report")
    r.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: auto)")
    r.add_argument(
        "--hsdp-shard",
        type=int,
        default=1,
        help="HSDP shard-axis size: FSDP2 shards the non-block weights and dlo's "
        "AllGather runs on this axis (1: no HSDP)",
    )
    r.add_argument(
        "--hsdp-replicate",
        type=int,
        default=1,
        help="HSDP replicate-axis size (ranks = replicate x shard)",
    )
    r.add_argument(
        "--checkpoint",
        default=None,
        help="load the weights from this safetensors checkpoint (file, directory or index) "
        "into a meta skeleton instead of building them (see dlo save-checkpoint)",
    )
    r.add_argument(
        "--checkpoint-load",
        default="mapped",
        choices=["mapped", "copy"],
        help="mapped: each rank reads only its slices; copy: the ordinary path, a full "
        "pageable copy first (for comparison)",
    )
    r.add_argument(
        "--verify-checksum",
        action="store_true",
        help="check every byte read from --checkpoint or --pipeline against the checksums "
        "dlo save-checkpoint wrote with it (corrupted data is refused; files without "
        "checksums too)",
    )
    r.add_argument(
        "--host-backing",
        default="region",
        choices=HOST_BACKINGS,
        help="region: each rank copies its blocks into its own host memory; mapped: "
        "rank-local blocks are read from the --checkpoint file (page cache shared by the "
        "node's ranks) through two pinned staging buffers",
    )
    r.add_argument(
        "--codec",
        default=None,
        choices=CODECS,
        help="ans: the streamed blocks' host copies are stored losslessly compressed and "
        "decoded on the device (nvCOMP on CUDA): fewer bytes cross the link, same bits; auto: "
        "the policy decides per stack (at enable with --block-compute-ms; else a re-planned "
        "DiT ring measured to wait on its copies turns ans on between forwards); none: never "
        "(default: auto on a GPU, none on a CPU device)",
    )
    r.add_argument(
        "--save-encoded",
        action="store_true",
        help="with --codec ans and weights from --checkpoint or --pipeline: after enable, "
        "write the encoded blocks beside their checkpoint files (dlo-encoded.safetensors), "
        "so later runs read them instead of encoding",
    )


LAYER_ONLY_FLAGS = (
    "transfer",
    "resident_layers",
    "num_slots",
    "device_budget_gb",
    "host_budget_gb",
    "block_compute_ms",
    "host_backing",
    "codec",
    "gather_engine",
    "gather_sync",
)
"""Flags (argparse dest) of the layer backend alone; the other offload flags apply to
``--mode module`` too."""


def component_list(text: str) -> tuple[str, ...]:
    """``--components``: ``"dit,encoder"`` -> ``("dit", "encoder")``, the names
    ``OffloadConfig.components`` takes."""
    names = tuple(n.strip() for n in text.split(","))
    for name in names:
        if name not in COMPONENT_ALIASES:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {name!r} is not one of "
                f"{', '.join(map(repr, COMPONENT_ALIASES))} (comma-separated)"
            )
    kinds = [COMPONENT_ALIASES[n] for n in names]
    twice = sorted({k for k in kinds if kinds.count(k) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names {', '.join(twice)} twice")
    return names


def config_of(args: argparse.Namespace, parser_defaults: dict[str, Any]) -> OffloadConfig:
    """The offload config the flags ask for (bad values raise ValueError/TypeError naming
    the field, before any work)."""
    if args.offload_config is not None:
        given = [
            flag
            for dest, flag in OFFLOAD_FLAGS.items()
            if getattr(args, dest) != parser_defaults[dest]
        ]
        if given:
            raise ValueError(
                f"--offload-config replaces {', '.join(given)}: give those settings inside the "
                "JSON instead"
            )
        return OffloadConfig.from_dict(_json_object(args.offload_config))
    if args.mode == "none":
        _refuse_offload_flags(args, parser_defaults)
    # every flag goes to the config, which refuses layer-only settings with --mode module
    return OffloadConfig(
        mode=args.mode,
        components=args.components,
        transfer=args.transfer,
        resident_layers=args.resident_layers,
        num_slots=args.num_slots,
        chunk_mb=args.chunk_mb,
        pin_memory=not args.no_pin,
        gather_engine=args.gather_engine,
        gather_sync=args.gather_sync,
        device_budget_gb=args.device_budget_gb,
        host_budget_gb=args.host_budget_gb,
        block_compute_ms=args.block_compute_ms,
        host_backing=args.host_backing,
        codec=args.codec,
    )


def _refuse_offload_flags(args: argparse.Namespace, parser_defaults: dict[str, Any]) -> None:
    """``--mode none`` with an offload flag given: the config would keep the setting, and
    nothing would use it."""
    ignored = [
        (dest, flag)
        for dest, flag in OFFLOAD_FLAGS.items()
        if dest != "mode" and getattr(args, dest) != parser_defaults[dest]
    ]
    if ignored:
        raise ValueError(
            "; ".join(
                f"{_as_given(flag, getattr(args, dest))} applies to --mode "
                f"{'layer only' if dest in LAYER_ONLY_FLAGS else 'layer or module'}"
                for dest, flag in ignored
            )
            + " (--mode none disables offload)"
        )


def _as_given(flag: str, value: Any) -> str:
    if isinstance(value, bool):  # a switch
        return flag
    return f"{flag} {','.join(value) if isinstance(value, tuple) else value}"


def parallel_of(args: argparse.Namespace, world_size: int) -> ParallelConfig:
    """The layout ``--hsdp-replicate`` and ``--hsdp-shard`` ask for over the job's
    ``world_size`` ranks (torchrun's), or a ValueError naming the flags and the sizes."""
    replicate, shard = args.hsdp_replicate, args.hsdp_shard
    check_minimums((("--hsdp-replicate", replicate, 1), ("--hsdp-shard", shard, 1)))
    if (replicate > 1 or shard > 1) and replicate * shard != world_size:
        raise ValueError(
            f"--hsdp-replicate={replicate} x --hsdp-shard={shard} = {replicate * shard} ranks, "
            f"but the job has {world_size} (WORLD_SIZE): the two must multiply to the number "
            "of ranks torchrun starts"
        )
    return ParallelConfig(
        data_parallel_size=world_size, hsdp_replicate_size=replicate, hsdp_shard_size=shard
    )


def _json_object(text: str) -> Any:
    source = "--offload-config"
    if not text.lstrip().startswith("{"):
        if not os.path.isfile(text):
            raise ValueError(f"--offload-config={text!r} is neither a JSON object nor a file")
        source = f"--offload-config file {text!r}"
        with open(text, encoding="utf-8") as fh:
            text = fh.read()
    try:
        data = loads_json(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source} must hold a JSON object, got {type(data).__name__}")
    return data


def save_encoded_if_asked(
    args: argparse.Namespace, backend: Any, rank0: bool
) -> CheckpointWriteError | None:
    """``--save-encoded``: rank 0 writes the encoded blocks beside their checkpoint (see
    [Note: encoded checkpoint] in :mod:`dlo.codec.offline`); the paths go to stderr.

    Returns:
        The error of a write that failed (a read-only directory, a full disk; nothing
        partial is left, see [Note: writing files] in :mod:`dlo.io.files`): the run goes
        on, and the caller raises it once the run's report is printed. None otherwise.
    """
    if not getattr(args, "save_encoded", False):
        return None
    # checked on every rank (alike everywhere), so no rank goes on while rank 0 fails
    if backend is None or not hasattr(backend, "save_encoded"):
        raise ValueError("--save-encoded needs --mode layer with --codec ans")
    if not backend.stats()["host_encoded_nbytes"]:
        backend.disable()
        raise ValueError("save_encoded needs an enabled backend with codec='ans' blocks")
    # rank 0 writes; the others check the same conditions, so a refusal is every rank's (a
    # failed write is rank 0's alone: every rank runs on, rank 0 fails after the report)
    try:
        paths = backend.save_encoded(dry_run=not rank0)
    except CheckpointWriteError as e:
        return e
    except BaseException:
        backend.disable()  # the run ends here: nothing stays enabled behind the error
        raise
    if rank0:
        for path in paths:
            print(f"dlo: encoded blocks written to {path}", file=sys.stderr, flush=True)
    return None
