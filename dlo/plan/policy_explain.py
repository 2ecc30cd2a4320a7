"""The policy's explanation lines (``--explain``, ``stats()["policy"]["explanation"]``). Pure."""

from __future__ import annotations

from typing import Any

from dlo.plan.policy_model import GB, GIB, PolicyInput, StackChoice, _size


def explain_lines(
    inp: PolicyInput,
    choices: list[StackChoice],
    num_slots: int,
    slot_note: str,
    per_dit: int,
    resident_note: str,
    slot_nbytes: int,
) -> list[str]:
    m = inp.measured
    ag = ", ".join(f"AllGather[{k}] {v / GB:.2f} GB/s" for k, v in sorted(m.allgather_bps.items()))
    free = (
        f", free device {_size(m.free_device_nbytes)}" if m.free_device_nbytes is not None else ""
    ) + (
        f", free shared memory {_size(m.shared_memory_nbytes)}"
        if m.shared_memory_nbytes is not None
        else ""
    )
    lines = [
        "dlo policy (this rank alone: its stacks exchange nothing at enable):"
        if inp.alone
        else f"dlo policy (group-wide minimum over {m.num_ranks} rank(s)):",
        f"  measured: host-to-device {m.h2d_bps / GB:.2f} GB/s per rank (all ranks copying)"
        + (f", {ag}" if ag else "")
        + free,
    ]
    for s, c in zip(inp.stacks, choices):
        mean = sum(s.block_nbytes) / max(1, len(s.block_nbytes))
        ag_ms = f"{c.allgather_ms:.3f} ms" if c.allgather_ms is not None else "-"
        lines.append(
            f"  stack {s.name}: {len(s.block_nbytes)} blocks x {mean / 1e6:.2f} MB, "
            f"axis {s.group_axis!r} of {s.group_size}; modeled per block: rank-local "
            f"{c.rank_local_ms:.3f} ms, allgather {ag_ms} -> {c.transfer} ({c.reason}); "
            f"{c.num_resident} resident; codec {c.codec} ({c.codec_reason})"
        )
    lines.append(f"  num_slots: {num_slots} x {_size(slot_nbytes)} ({slot_note})")
    lines.append(f"  resident_layers: {per_dit} per DiT ({resident_note})")
    return lines


def kept(knob: str, inp: PolicyInput) -> str:
    """How the explanation calls a knob the policy kept as given."""
    if knob in inp.defaults:
        if knob == "resident_layers" and not any(s.component == "dit" for s in inp.stacks):
            return "unset: no DiT selected, no resident blocks"
        return f"unset: a CPU device's default; {knob}='auto' decides it"
    return "explicit"


def replan_line(r: dict[str, Any]) -> str:
    """One re-plan record (``stats()["policy"]["replans"]``) as a line of ``--explain``."""
    if r["action"].startswith("codec"):  # [Note: codec turned on by measurement]
        return codec_line(r)
    return (
        f"dlo re-plan of {r['component'] or 'the model'} before forward {r['forward']} "
        f"({r['elements']} input elements): {r['action']}, {r['pinned']} of "
        f"{r['pinned'] + r['streamed']} blocks pinned, {r['num_slots']} slot(s) x "
        f"{r['slot_nbytes'] / (1 << 20):.1f} MiB, room for them "
        f"{(r['movable_room_nbytes'] or 0) / GIB:.2f} GiB of a {r['limit_nbytes'] / GIB:.2f} GiB limit"
        + (f", {r['ms']:.1f} ms" if "ms" in r else "")
    )


def codec_line(r: dict[str, Any]) -> str:
    """A record of the codec turned on by measurement as a line of ``--explain``."""
    head = (
        f"dlo re-plan of {r['component'] or 'the model'} before forward {r['forward']}: "
        f"{r['action']} (the last forward waited {r['exposed_wait_ms']:.1f} ms on copies of "
        f"its {r['forward_ms']:.1f} ms)"
    )
    if "ratio" in r:
        return (
            f"{head}, {r['blocks']} blocks encoded in the background, "
            f"{r['encoded_nbytes'] / GIB:.2f} GiB for {r['raw_nbytes'] / GIB:.2f} GiB "
            f"(ratio {r['ratio']:.3f})"
        )
    if "why" in r:
        return f"{head}: {r['why']}"
    return f"{head}, {r.get('blocks', 0)} blocks ({r.get('raw_nbytes', 0) / GIB:.2f} GiB)"


def late_codecs(states: dict[str, str]) -> list[str]:
    """The rings whose codec was turned on by measurement (``stats()["codec_late"]``: ring ->
    state), as the words of a ``dlo run: settled`` line (none where no ring's is on)."""
    on = [name or "the model" for name, state in sorted(states.items()) if state == "on"]
    return [f"codec=ans by measurement ({', '.join(on)})"] if on else []


def replans_explained(policy: dict[str, Any] | None) -> str:
    """Every re-plan of a run, a line each (``--explain`` after the run)."""
    records = (policy or {}).get("replans") or []
    if not records:
        return "dlo re-plans: none (every forward ran as enable planned it)"
    return "\n".join(replan_line(r) for r in records)


def disk_explained(stats: dict[str, Any]) -> str:
    """The disk tier's model (``host_budget_gb``; see [Note: host budget tiers] in
    :mod:`dlo.plan.host_tiers`) as lines of ``--explain``; empty without a disk tier."""
    if not stats.get("num_disk_blocks"):
        return ""
    how = "O_DIRECT" if stats.get("disk_direct") else "buffered, pages dropped behind them"
    return (
        f"dlo disk tier: {stats['num_disk_blocks']} blocks ({stats['disk_nbytes'] / GIB:.2f} GiB) "
        f"stay in their files, {stats['host_region_nbytes'] / GIB:.2f} GiB of blocks are kept "
        f"in host memory; reads {how}, {stats['disk_probe_gbps']:.2f} GB/s measured at enable: "
        f"a pass over the streamed ones takes {stats['disk_limit_ms']:.0f} ms at that rate "
        f"(the disk's term beside the copies' and the compute's), read "
        f"{stats['read_ahead_buffers']} blocks ahead into "
        f"{stats['read_ahead_buffers'] * stats['read_ahead_buffer_nbytes'] / GIB:.2f} GiB "
        "of page-locked staging"
    )
