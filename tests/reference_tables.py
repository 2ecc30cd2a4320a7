"""The generated sections of ``docs/reference.md``.

Each section sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``; only
those lines are rewritten, the prose around them is kept. ``python -m tests.reference_tables``
regenerates them in place; ``tests/pure/test_docs_reference.py`` fails while a section differs
from what this module produces from the code now, so a field, flag or stats key added without
regenerating the reference fails the tests.

Everything is read from public names only (``dlo.OffloadConfig`` and the other top-level
classes, ``dlo.enable_offload``, ``dlo.cli.build_parser``, ``tests.toys``), because the
package layout under ``dlo/`` changes; a class's own module is reached through
``sys.modules[cls.__module__]``, never through a hard-coded path.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

import dlo
import dlo.cli

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
REGENERATE = "python -m tests.reference_tables"
END = "<!-- end generated -->"
_SECTION = re.compile(
    r"<!-- generated: (?P<name>[A-Za-z0-9_.-]+) -->\n(?P<body>.*?)" + re.escape(END), re.S
)

# classes whose fields get a table, by section name; all are exported by ``dlo`` itself
CONFIG_CLASSES: dict[str, type] = {
    "offload-config": dlo.OffloadConfig,
    "layer-options": dlo.LayerOptions,
    "parallel-config": dlo.ParallelConfig,
    "offload-plan": dlo.OffloadPlan,
    "resolved-offload-plan": dlo.ResolvedOffloadPlan,
    "block-stack": dlo.BlockStack,
}


# ----------------------------------------------------------------------------- text
def _cell(text: str) -> str:
    """One markdown table cell from a docstring or help text: one line, Sphinx roles and
    double backticks as plain code spans, pipes escaped (a bare one would split the cell)."""
    text = " ".join(inspect.cleandoc(text).split())
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    text = text.replace("|", "\\|")
    if not text.isascii():
        # the docs are ASCII only; say where instead of writing the character through
        raise ValueError(f"non-ASCII text would go into docs/reference.md: {text!r}")
    return text


def _code(value: Any) -> str:
    """A Python value as a code span; strings in double quotes, as the docs write them."""
    shown = json.dumps(value) if isinstance(value, str) else repr(value)
    return "`" + shown.replace("|", "\\|") + "`"


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- config fields
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the attribute docstring right after it in the class body (also what
    ``tests/pure/test_config.py::test_every_field_has_a_docstring`` checks)."""
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    nodes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    if len(nodes) != 1:
        raise LookupError(f"class {cls.__name__} not found at the top of {cls.__module__}")
    docs: dict[str, str] = {}
    body = nodes[0].body
    for stmt, nxt in zip(body, [*body[1:], None]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = nxt.value.value
    return docs


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return _code(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _code(f.default_factory())
    return "required"


def fields_table(cls: type) -> str:
    """Every dataclass field of ``cls``: name, type, default and docstring, in class order."""
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name not in docs:
            raise LookupError(f"{cls.__name__}.{f.name} has no attribute docstring")
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", f.type)
        rows.append([f"`{f.name}`", _code_text(str(annotation)), _default(f), _cell(docs[f.name])])
    return _table(["field", "type", "default", "meaning"], rows)


def _code_text(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


# ----------------------------------------------------------------------------- CLI flags
# The parser's help text is the meaning of a flag. A few flags have none; their meaning is
# written here, and the tests fail when a note is missing or the flag gained a help text
# (then the note is stale and goes).
FLAG_NOTES: dict[tuple[str, str], str] = {}
"""Meanings of flags the parser gives no help text (every flag has its own help today; a
flag added without one needs a note here, or better, a help text)."""


def subcommands(
    parser: argparse.ArgumentParser | None = None,
) -> dict[str, argparse.ArgumentParser]:
    """``dlo``'s subcommand name -> its parser."""
    parser = parser or dlo.cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise LookupError("dlo.cli.build_parser() has no subcommands")


def flag_actions(command: str) -> list[argparse.Action]:
    """The actions of ``dlo COMMAND`` in parser order, without ``--help``."""
    sub = subcommands()[command]
    return [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]


def _flag(action: argparse.Action) -> str:
    return ", ".join(action.option_strings) or action.dest


def _value_kind(action: argparse.Action) -> str:
    if action.nargs == 0:  # store_true and the like take no value
        return "switch"
    kind = action.type
    if kind is None:
        return "str"
    return getattr(kind, "__name__", repr(kind)).lstrip("_")


def _cli_default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0:
        return "on" if action.default else "off"
    if action.default is None:
        return "unset"
    return "`" + str(action.default).replace("|", "\\|") + "`"


def _meaning(command: str, action: argparse.Action) -> str:
    if action.help:
        text = action.help
        if "%(" in text:  # argparse's own expansion of %(default)s and the like
            text = text % {**vars(action), "prog": command}
        return _cell(text)
    note = FLAG_NOTES.get((command, _flag(action)))
    if note is None:
        raise LookupError(
            f"dlo {command} {_flag(action)} has no help text and no note in "
            "tests/reference_tables.py FLAG_NOTES"
        )
    return _cell(note)


def flags_table(command: str) -> str:
    """Every flag of ``dlo COMMAND``: flag, value, default, choices, meaning."""
    rows = []
    for a in flag_actions(command):
        choices = ", ".join(f"`{c}`" for c in a.choices) if a.choices else ""
        rows.append(
            [f"`{_flag(a)}`", _value_kind(a), _cli_default(a), choices, _meaning(command, a)]
        )
    return _table(["flag", "value", "default", "choices", "meaning"], rows)


# ----------------------------------------------------------------------------- stats keys
# Dicts whose keys are data (block names, component paths, weight axes), not stats keys: the
# table shows one placeholder for them and the keys of their values below it.
DATA_KEYED = {
    "block_wait_ms": "<block>",
    "components": "<component>",
    "policy.stacks": "<stack>",
    "policy.measured.allgather_GBps": "<axis>",
    "policy.per_rank[].allgather_GBps": "<axis>",
}

# What each key means, written from the code that fills it (``grep -rn '"host_nbytes"' dlo/``).
# Byte counts are this rank's; "cumulative" counters grow from enable on.
STATS_MEANINGS: dict[str, dict[str, str]] = {
    "layer": {
        "enabled": "`is_enabled()`",
        "transfer": '`"allgather"` if any stack gathers, else `"node-shared"` if any stack '
        'shares a node\'s host copy, else `"rank-local"`; a stack asked for AllGather whose '
        'group has one rank still counts as `"allgather"`',
        "group_size": "ranks of the weight group of the first AllGather stack whose group has "
        "more than one rank (DiT stacks come first); 1 when there is none (node-shared stacks "
        "have groups of one)",
        "group_rank": "this rank's index in that group",
        "host_backing": '`OffloadConfig.host_backing`: `"region"` or `"mapped"`',
        "host_nbytes": "host bytes of the selected blocks (streamed and resident) charged to "
        "this rank: its shards padded to whole chunks, a node-shared block's bytes divided by "
        'the ranks sharing it (rounded up); with `host_backing="mapped"` only the tensors the '
        "checkpoint file does not serve",
        "host_mapped_nbytes": 'block bytes served from the checkpoint file (`"mapped"`, and the '
        "disk tier of `host_budget_gb`: this rank's shards of its blocks; else 0): the node's "
        "page cache or the disk, not this rank's memory",
        "host_region_nbytes": "size of this rank's private host region holding its shards "
        '(shard bytes plus page alignment per block; 0 with `"mapped"` or when every stack is '
        "node-shared)",
        "host_shared_nbytes": "size of the node's shared host copy this rank maps "
        '(`transfer="node-shared"`; the whole file, not this rank\'s charge; else 0)',
        "host_share_ranks": "ranks of this node that share that copy (L; 1 without node-shared)",
        "host_pinned_nbytes": "pinned bytes charged to this rank: of its private region, its "
        "1/L charge of the pinned blocks of the shared copy, and the staging buffers of "
        '`"mapped"` (0 on the CPU platform and with `pin_memory=False`)',
        "num_staging_buffers": 'pinned staging buffers of `host_backing="mapped"` (0 otherwise)',
        "staging_buffer_nbytes": "bytes of each staging buffer (the largest chunk; 0 otherwise)",
        "staging_host_wait_ms": "total host time the compute thread waited for the staging "
        'thread to enqueue a block\'s copies (`"mapped"` and `host_budget_gb` only)',
        "num_disk_blocks": "blocks that host_budget_gb leaves in their file, read for every use "
        "(see [Note: host budget tiers])",
        "disk_nbytes": "their padded bytes (read from the file per load; encoded ones: their "
        "encoded bytes, read from the encoded checkpoint)",
        "num_disk_encoded_blocks": "of them, the ones read encoded from an encoded checkpoint "
        "(codec under host_budget_gb)",
        "disk_direct": "whether every file they are read from was opened with O_DIRECT (False: "
        "buffered reads, pages dropped behind them; None: no disk tier)",
        "disk_read_nbytes": "bytes of disk-tier blocks read into the read-ahead buffers since "
        "enable",
        "disk_read_ms": "time the read-ahead thread spent reading them",
        "disk_read_gbps": "disk_read_nbytes / disk_read_ms (GB/s): the disk tier's read rate",
        "num_disk_reads": "disk-tier block reads since enable",
        "num_wasted_disk_reads": "blocks read ahead and dropped before their load (a wrong "
        "prediction, or a buffer needed sooner)",
        "read_ahead_buffers": "whole-block page-locked read-ahead buffers (0: no disk tier)",
        "read_ahead_buffer_nbytes": "bytes of each (the largest disk-tier block)",
        "read_ahead_wait_ms": "total time the staging thread waited for a block's read (the "
        "disk did not keep ahead)",
        "num_read_ahead_waits": "loads whose block was not read yet when its copy was due",
        "disk_probe_gbps": "the disk tier's read rate measured at enable (GB/s): a short read "
        "of its largest file the tier's way (O_DIRECT where allowed); 0 without a disk tier",
        "disk_limit_ms": "the disk tier's model: one pass over its streamed blocks at that rate "
        "(ms), what a forward of every streamed block cannot beat",
        "codec": '`"ans"` when some stack\'s host blocks are encoded, else `"none"`',
        "codec_bitstream": 'the bitstream of the encoded blocks (`"nvcomp-ans-f2"` on CUDA, '
        '`"dlo-zlib-planes-v1"` on the CPU platform; None without a codec)',
        "host_encoded_nbytes": "bytes of the encoded blocks' host copies (what crosses the "
        "link for them)",
        "host_encoded_raw_nbytes": "raw bytes of the same blocks (their shards)",
        "encoded_read_blocks": "encoded blocks read from an encoded checkpoint instead of "
        "encoded at enable ([Note: encoded checkpoint])",
        "codec_ratio": "`host_encoded_nbytes / host_encoded_raw_nbytes` (1.0 without a codec; "
        "on random weights only a proxy of a real model's)",
        "decoded_nbytes": "raw bytes the decoder wrote into slots (cumulative)",
        "encoded_h2d_nbytes": "the encoded bytes copied for them (cumulative; also in "
        "`h2d_nbytes`)",
        "decode_ms": "device time the decoders spent decoding, over every load so far (0 on "
        "the CPU platform; a decode hidden behind the next piece's copy costs no step time, "
        "what it does not hide is in `exposed_wait_ms`)",
        "decode_ms_per_load": "`decode_ms` per encoded load (0 before the first)",
        "decode_tail_ms_per_load": "device time from a load's last encoded byte on the device "
        "to its last decode, per load: what the decode adds to a load's latency, an upper "
        "bound (it includes the decoder's wait for the slot to be free when copies run "
        "ahead; 0 on the CPU platform)",
        "decode_gbps": "raw bytes out of the decoder per second of `decode_ms` (GB/s; 0 on the "
        "CPU platform; a decode whose timing pair was dropped counts its bytes, not its time, "
        "so read it as an upper bound)",
        "device_decode_staging_nbytes": "device bytes of the two staging buffers encoded "
        "blocks cross the link into (each the largest encoded block)",
        "device_slot_nbytes": "device bytes of the slots: `num_slots` x the largest padded "
        "streamed block",
        "device_symmetric_nbytes": "device bytes dlo holds outside torch's caching allocator "
        "(the copy-engine gather's symmetric allocation: its slots and barrier counters; 0 "
        "otherwise); `torch.cuda.max_memory_allocated` does not count them, `dlo run` and "
        "`dlo bench` add them to their peak figures",
        "device_resident_block_nbytes": "device bytes of the resident blocks (padded)",
        "device_non_block_nbytes": "bytes of non-block tensors (of streamed components and "
        "declared resident modules) that enable moved to the device; tensors already there "
        "are not counted",
        "h2d_nbytes": "cumulative host-to-device bytes this rank copied (its shard of each "
        "loaded block)",
        "allgather_nbytes": "cumulative bytes produced by AllGather (the padded size of each "
        "gathered block)",
        "num_loads": "cumulative block loads, resident blocks and the preloads at enable included",
        "exposed_wait_ms": "total compute-stream time spent waiting for streamed blocks' "
        "transfers, measured with device events (0 on CPU); a lower bound when samples were "
        "dropped",
        "block_wait_ms": "`exposed_wait_ms` per streamed block",
        "block_wait_ms.<block>": "that block's exposed wait, ms",
        "dropped_wait_samples": "wait measurements dropped because their events had not "
        "completed when reused (the hot path never waits for them)",
        "num_demand_loads": "loads issued by a block's own pre-forward hook because no "
        "prefetch brought it (the first block after another ring ran, a skipped block, "
        "`num_slots=1`)",
        "num_wasted_loads": "loads evicted or dropped before their block ran (a prefetch of a "
        "block the forward skipped: a step cache); a block that ran keeps its slot until a "
        "load needs it, so running it again loads nothing",
        "wasted_nbytes": "the bytes of those wasted loads (each block's raw bytes, this "
        "rank's share)",
        "num_skipped_blocks": "block calls a step cache (diffusers' `enable_cache`) skipped "
        "while dlo's loads were inside it: none of them loaded anything",
        "num_cache_inner_blocks": "streamed blocks whose loads are inside their DiT's step "
        "cache now (a ring of its own with a cache enabled; 0 where blocks gather: there every "
        "block loads whatever each rank's cache skips)",
        "num_streamed_blocks": "blocks in the rings",
        "num_resident_blocks": "resident blocks (an explicit `resident_layers`, or a DiT that "
        "is not re-planned; the policy's are pinned ring blocks: `num_pinned_blocks`)",
        "num_slots": "slots allocated",
        "gather_engine": '`"copy"` when AllGather runs on the copy engines out of '
        'symmetric-memory slots, `"nccl"` when NCCL gathers, `None` when nothing gathers '
        "(whole blocks, or a group of one)",
        "gather_sync": 'the copy-engine gather\'s barriers, `"stream"` or `"kernel"`; `None` '
        "without the copy engine",
        "pageable_blocks": 'blocks kept pageable under `pin_failure_policy="whole_block_fallback"`',
        "enable_time_s": "wall time of `enable`",
        "fill_time_s": "of the enable: filling the host shards (from the model or the checkpoint file), each filled block pinned behind",
        "pin_time_s": "of the enable: the pinning left after the last block was filled",
        "enable_peak_rss_nbytes": "the process's peak resident set size (VmHWM) read at the "
        "end of enable: a process-lifetime peak, not a delta",
        "codec_late": "per DiT ring whose codec='auto' (given, or unset on a GPU) took 'none' "
        "at enable, where the codec "
        "turned on by measurement stands: watching, encoding (in the background), on, off "
        "(with why in the re-plan records) or closed ([Note: codec turned on by measurement])",
        "num_pinned_blocks": "ring blocks held in a device buffer of their own, loading nothing "
        "per forward: the blocks the policy keeps on the device (pinned at enable, so a re-plan "
        "may unpin them before a larger input) and those a re-plan pinned ([Note: re-plan "
        "between forwards])",
        "device_pinned_block_nbytes": "device bytes of the pinned blocks' buffers (padded)",
        "policy": "`None` unless a setting was automatic or a DiT ring is re-planned; else the "
        "automatic policy's record (the keys below)",
        "policy.stacks": "per stack, by container path",
        "policy.stacks.<stack>": "the decision for one stack",
        "policy.stacks.<stack>.transfer": "the transfer chosen",
        "policy.stacks.<stack>.requested": "the transfer asked for",
        "policy.stacks.<stack>.group_axis": "the weight axis the stack's group uses",
        "policy.stacks.<stack>.group_size": "ranks on that axis",
        "policy.stacks.<stack>.num_resident": "resident leading blocks of the stack",
        "policy.stacks.<stack>.rank_local_ms_per_block": "modeled ms per block with whole-block "
        "copies (mean over the stack)",
        "policy.stacks.<stack>.allgather_ms_per_block": "modeled ms per block with AllGather; "
        "`None` without a group or a measurement",
        "policy.stacks.<stack>.reason": "why that transfer (one line)",
        "policy.stacks.<stack>.codec": "the codec of that stack (`none` or `ans`)",
        "policy.stacks.<stack>.codec_reason": "why that codec (`explicit` when given other "
        "than `auto`, `unset: ...` when unset on a CPU device)",
        "policy.num_slots": "slots chosen (or kept)",
        "policy.resident_layers": "resident leading blocks per eligible DiT",
        "policy.slot_nbytes": "bytes of one slot",
        "policy.device_weight_nbytes": "modeled device bytes of weights: non-block + slots + "
        "resident blocks",
        "policy.capacity_nbytes": "device bytes the slots and resident blocks may take: "
        "the room on the device (the free memory; with `device_budget_gb`, at most the budget "
        "less what the process holds) less a headroom for activations and less the non-block "
        "weights still to place; `None` when unknown",
        "policy.kept_whole": "the encoder stacks the policy kept whole on the device instead "
        "of streaming them (found encoders with `components` unset: [Note: encoders kept or "
        "streamed])",
        "policy.measured": "the numbers decided from: the minimum over all ranks",
        "policy.measured.h2d_GBps": "host-to-device GB/s of one rank while every rank copies",
        "policy.measured.allgather_GBps": "AllGather output GB/s per weight axis measured",
        "policy.measured.shared_memory_nbytes": "free bytes of the shared-memory folder of the "
        "fullest node (`None`: unknown)",
        "policy.measured.free_device_nbytes": "free device memory at enable, before dlo "
        "allocates (`None`: unknown)",
        "policy.measured.held_device_nbytes": "device bytes the process held at enable, "
        "blocks enable moves off excluded, the largest over the ranks (`None`: unknown); a "
        "device budget counts them",
        "policy.measured.num_ranks": "ranks that measured",
        "policy.explanation": "the text `dlo run --explain` prints",
        "policy.per_rank": "each rank's own measurements, in rank order",
        "policy.per_rank[].rank": "the rank",
        "policy.per_rank[].h2d_GBps": "its host-to-device GB/s",
        "policy.per_rank[].allgather_GBps": "its AllGather GB/s per weight axis",
        "policy.per_rank[].free_device_nbytes": "its free device memory",
        "policy.per_rank[].held_device_nbytes": "the device bytes it held at enable",
        "policy.per_rank[].shared_memory_nbytes": "free bytes of its node's shared-memory folder",
        "policy.per_rank[].non_block_nbytes": "its non-block weight bytes (the policy budgets "
        "for the largest)",
        "policy.replans": "while enabled, every re-plan between forwards of a DiT ring whose "
        "resident count the policy chose: `component`, `forward` (the forward it preceded), "
        "`elements` (its first block's input elements), `pinned`, `streamed`, `num_slots`, "
        "`slot_nbytes`, `movable_room_nbytes` (what pinned blocks and slots could take), "
        "`limit_nbytes` (what the allocator may hold), `action` (`pin`, `unpin` or `slots`); "
        'and each step of the codec turned on by measurement (`codec="auto"`): `component`, '
        "`forward`, `action` (`codec: encoding`, `codec: on` or `codec: off`), `forward_ms` and "
        "`exposed_wait_ms` (the last steady forward measured), `blocks`, `raw_nbytes`, with "
        "`encoded_nbytes` and `ratio` when on, `why` when off; present where the policy "
        "decided at enable or a re-plan happened",
    },
    "module": {
        "enabled": "`is_enabled()`",
        "transfer": 'always `"swap"`',
        "group_size": "always 1 (no collective)",
        "group_rank": "always 0",
        "delegated": "`True` when enable was delegated to a `SupportsModelOffload` model (the "
        "byte counts are then 0)",
        "host_nbytes": "host bytes of the copies of every DiT and encoder (padded to whole chunks)",
        "host_region_nbytes": "size of the host region holding them (page-aligned)",
        "host_pinned_nbytes": "bytes of the region that are pinned",
        "device_slot_nbytes": "always 0 (no slots)",
        "device_component_nbytes": "device bytes of the components loaded now",
        "device_vae_nbytes": "bytes of VAE tensors enable moved to the device",
        "h2d_nbytes": "cumulative host-to-device bytes of component loads",
        "allgather_nbytes": "always 0",
        "exposed_wait_ms": "total compute-stream time waiting for component loads (every load "
        "is exposed; 0 on CPU)",
        "num_streamed_blocks": "always 0",
        "num_resident_blocks": "always 0",
        "components": "per swapped component, by path",
        "components.<component>": "one component",
        "components.<component>.kind": '`"dit"` or `"encoder"`',
        "components.<component>.nbytes": "its tensor bytes (unpadded)",
        "components.<component>.num_loads": "cumulative loads",
        "components.<component>.resident": "`True` while it is loaded",
        "components.<component>.load_ms": "total device time of its timed loads",
        "components.<component>.timed_loads": "loads whose time has been read",
    },
}

# how each backend is enabled to read its keys: a setting left to the policy fills
# ``stats()["policy"]``, so its keys are read too
STATS_CONFIGS: dict[str, dict[str, Any]] = {
    "layer": {"mode": "layer", "transfer": "auto", "num_slots": "auto"},
    "module": {"mode": "module"},
}


def _keys(value: Any, prefix: str) -> list[str]:
    """The dotted key paths of a stats value (``a.b``, ``a[].c`` for a list of dicts)."""
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{prefix}{k}"
            out.append(path)
            if path in DATA_KEYED:
                entry = f"{path}.{DATA_KEYED[path]}"
                if v:  # an empty map (no AllGather axis on one rank) has no entry to show
                    out.append(entry)
                    out += _union(_keys(item, f"{entry}.") for item in v.values())
            else:
                out += _keys(v, f"{path}.")
    elif isinstance(value, list):
        out += _union(_keys(item, f"{prefix[:-1]}[].") for item in value)
    return out


def _union(lists: Iterable[list[str]]) -> list[str]:
    seen: dict[str, None] = {}
    for keys in lists:
        seen.update(dict.fromkeys(keys))
    return list(seen)


def stats_keys(mode: str) -> list[str]:
    """Every key path of ``backend.stats()`` for ``mode``, read from a backend enabled on the
    CPU on ``tests.toys.ToyPipeline`` after one forward."""
    from tests.toys import ToyPipeline

    pipe = ToyPipeline()
    backend = dlo.enable_offload(pipe, dlo.OffloadConfig(**STATS_CONFIGS[mode]), device="cpu")
    assert backend is not None
    try:
        with torch.inference_mode():
            pipe(torch.randn(2, 16))
        stats = backend.stats()
    finally:
        backend.disable()
    return _keys(stats, "")


def stats_table(mode: str, keys: list[str] | None = None) -> str:
    """Every key of ``stats()`` for ``mode`` with its meaning, in the order ``stats()``
    returns them."""
    keys = stats_keys(mode) if keys is None else keys
    meanings = STATS_MEANINGS[mode]
    missing = [k for k in keys if k not in meanings]
    stale = [k for k in meanings if k not in keys]
    if missing or stale:
        raise LookupError(
            f"stats() of mode={mode!r} and STATS_MEANINGS[{mode!r}] in tests/reference_tables.py "
            f"differ: keys without a meaning {missing}, meanings of keys that no longer exist "
            f"{stale}; write or remove the meanings, then run {REGENERATE}"
        )
    return _table(["key", "meaning"], ([f"`{k}`", _cell(meanings[k])] for k in keys))


# ----------------------------------------------------------------------------- sections
def section_builders() -> dict[str, Callable[[], str]]:
    """Section name -> a function returning its markdown (without the markers)."""
    out: dict[str, Callable[[], str]] = {}
    for name, cls in CONFIG_CLASSES.items():
        out[name] = functools.partial(fields_table, cls)
    for command in subcommands():
        out[f"cli-{command}"] = functools.partial(flags_table, command)
    for mode in STATS_MEANINGS:
        out[f"stats-{mode}"] = functools.partial(stats_table, mode)
    return out


def body(markdown: str) -> str:
    """What goes between the markers: the markdown between two blank lines."""
    return f"\n{markdown}\n\n"


def read_sections(text: str) -> dict[str, str]:
    """Section name -> its current body in ``text``."""
    found: dict[str, str] = {}
    for m in _SECTION.finditer(text):
        if m.group("name") in found:
            raise ValueError(f"generated section {m.group('name')!r} appears twice")
        found[m.group("name")] = m.group("body")
    return found


def rewrite(text: str, bodies: dict[str, str]) -> str:
    """``text`` with every generated section's body replaced by ``bodies[name]``."""
    present = read_sections(text)
    unknown = sorted(set(present) - set(bodies))
    missing = sorted(set(bodies) - set(present))
    if unknown or missing:
        raise ValueError(
            f"docs/reference.md has generated sections no generator knows {unknown} and lacks "
            f"{missing}: add '<!-- generated: NAME -->' and '{END}' lines where each "
            "missing table belongs (or remove the unknown ones)"
        )
    return _SECTION.sub(
        lambda m: f"<!-- generated: {m.group('name')} -->\n{bodies[m.group('name')]}{END}", text
    )


def main(argv: list[str] | None = None) -> int:
    del argv  # no options: the command always rewrites docs/reference.md
    text = REFERENCE.read_text()
    bodies = {name: body(build()) for name, build in section_builders().items()}
    new = rewrite(text, bodies)
    if new == text:
        print(f"{REFERENCE.name}: up to date")
    else:
        REFERENCE.write_text(new)
        changed = [n for n, b in read_sections(text).items() if bodies[n] != b]
        print(f"{REFERENCE.name}: rewrote {', '.join(changed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
