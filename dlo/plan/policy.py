"""The automatic policy: transfer, slots and resident blocks from measured numbers. Pure.

Everything here is a function of frozen dataclasses (block sizes, group sizes, measured
bandwidths, a memory capacity, the requested settings): no process group, no device, no
clock. The runtime measures (:mod:`dlo.runtime.measure`), agrees on one set of numbers for the whole
job, and hands them to :func:`decide`; every rank computes the same decision because it
feeds the same inputs to the same deterministic function.

[Note: policy model]
A block of ``nbytes`` payload bytes moves as ``n`` chunks of ``C`` bytes (the layout's
chunking for its group size G; see [Note: chunks and shards]). With ``h`` the per-rank
host-to-device bandwidth while every rank copies at once and ``a`` the AllGather bandwidth
of the weight group (output bytes per second):

* rank-local: one copy of the whole padded block; latency ``L = P = n * C / h``.
* AllGather: a two-stage pipeline per chunk, copy ``c = (C / G) / h`` then gather
  ``g = C / a``, where the gather of chunk k overlaps the copy of chunk k+1 ([Note: chunk
  pipeline]). The busiest stage is occupied ``P = n * max(c, g)`` per block; the block's
  latency is ``L = c + g + (n - 1) * max(c, g) = P + min(c, g)`` (the first copy or the last
  gather is never overlapped).

``transfer="auto"`` picks, per stack, the transfer with the smaller summed latency ``L`` over
the stack's blocks; a tie goes to whole blocks (fewer moving parts, no lock step). A stack
whose weight axis has one rank has nothing to gather with and is rank-local. Whole blocks
for a stack whose axis has more ranks are node-shared ([Note: node-shared host copy]: the
same copies as rank-local, one host copy per node) when every node's shared-memory folder
has room for all such stacks with ``SHARED_MEMORY_HEADROOM`` to spare; else rank-local.
Node-shared is chosen over a faster AllGather only when the user gives the compute time of
a block (``block_compute_ms``) and it hides the copy of the stack's largest whole block: then
both run at compute speed, and node-shared moves nothing between GPUs (peer traffic costs
compute clock on power-limited GPUs: 4-5% at 16384 tokens on 2 x H200). Without it enable
cannot know (the compute depends on the request). If the shared memory lacks room, such a
stack falls back to AllGather.

Slots. With S slots a slot is reused every S blocks, and one slot's cycle is the block's
load latency plus its compute ``t_c`` (the copy of block i+S waits for block i's ``free``).
So the ring runs at ``max(P, t_c, (L + t_c) / S)`` per block and needs
``S = ceil((L + t_c) / max(P, t_c))`` slots to hide its cycle. The compute time is not known
at enable (it depends on the request), and the cycle matters most when compute is about as
long as the transfer, so ``num_slots="auto"`` takes ``t_c = P``: rank-local has ``L = P`` and
needs 2; AllGather has ``P < L <= 2P`` and needs 3 (measured on 2 x H200 at 4096 tokens, a
third slot took AllGather from 83.5 to 81.6 ms per forward). Slots come before resident
blocks in the budget: the third slot is one block's bytes, and it helps every streamed block.

Memory. Device weight bytes are the non-block weights, ``num_slots`` slots of the largest
padded streamed block, and the padded bytes of every resident block. The capacity is
``(1 - FREE_MEMORY_HEADROOM)`` of the room left on the device minus the non-block weights not
yet on it (the headroom is left for activations, the allocator and communication buffers);
the room is the free device memory, and with a ``device_budget_gb`` at most the budget less
what the process already holds ([Note: device budget]). ``resident_layers="auto"`` keeps the
largest number r of leading blocks of each eligible DiT whose total fits, scanning every r
(the slot shrinks once the largest block is resident, so the cost is not monotonic in r).
"""

from __future__ import annotations

import dataclasses

from dlo.plan.codec_policy import choose_codec
from dlo.plan.encoder_choice import choose_encoders
from dlo.plan.policy_explain import explain_lines, kept
from dlo.plan.policy_model import (
    FREE_MEMORY_HEADROOM,
    GIB,
    SHARED_MEMORY_HEADROOM,
    PolicyDecision,
    PolicyInput,
    StackChoice,
    StackSpec,
    _check_input,
    _size,
    allocated_slots,
    block_times,
    padded_nbytes,
    slots_needed,
    staging_nbytes,
)


def _choose_transfer(s: StackSpec, inp: PolicyInput) -> StackChoice:
    m, chunk = inp.measured, inp.chunk_nbytes
    n = max(1, len(s.block_nbytes))
    rl = sum(
        block_times(b, group_size=1, chunk_nbytes=chunk, h2d_bps=m.h2d_bps, allgather_bps=1.0)[0]
        for b in s.block_nbytes
    )
    ag: float | None = None
    ag_bw = m.allgather_bps.get(s.group_axis)
    if s.group_size > 1 and ag_bw is not None:
        ag = sum(
            block_times(
                b,
                group_size=s.group_size,
                chunk_nbytes=chunk,
                h2d_bps=m.h2d_bps,
                allgather_bps=ag_bw,
            )[0]
            for b in s.block_nbytes
        )
    rl_ms, ag_ms = rl / n * 1e3, (ag / n * 1e3 if ag is not None else None)
    if s.transfer != "rank-local" and s.group_size > 1 and ag is None:
        # "auto" chooses by the gather's time, and an AllGather stack's slot count is sized
        # by it: a guessed bandwidth would decide wrong
        raise ValueError(f"stack {s.name!r}: no AllGather measurement for axis {s.group_axis!r}")
    if s.transfer != "auto":
        transfer, reason = s.transfer, "explicit"
    elif s.group_size == 1:
        transfer, reason = "rank-local", f"auto: the {s.group_axis!r} axis has one rank"
    elif inp.host_backing == "mapped":
        transfer, reason = "rank-local", "auto: host_backing='mapped' streams rank-local stacks"
    elif ag is not None and ag < rl and _compute_hides_whole_blocks(s, inp):
        t_c = inp.block_compute_s
        assert t_c is not None
        transfer, reason = (
            "node-shared",
            (
                f"auto: compute ({t_c * 1e3:.3f} ms per block) hides every whole-block copy: no "
                f"peer traffic ({ag_ms:.3f} < {rl_ms:.3f} ms per block)"
            ),
        )
    elif ag is not None and ag < rl:
        transfer, reason = (
            "allgather",
            f"auto: modeled AllGather {ag_ms:.3f} < whole blocks {rl_ms:.3f} ms per block",
        )
    else:  # whole blocks; node-shared if the shared memory holds them (see _fit_shared)
        transfer, reason = (
            "node-shared",
            f"auto: modeled whole blocks {rl_ms:.3f} <= AllGather {ag_ms:.3f} ms per block; "
            "the ranks of the weight axis on a node share one host copy of them",
        )
    choice = _choice(s, transfer, reason, rl_ms, ag_ms)
    if transfer == "node-shared" and inp.host_budget:  # the disk tier has no node copy
        return _without_sharing(choice, s, "host_budget_gb reads blocks per rank")
    if transfer == "allgather" and inp.host_budget and s.codec not in ("none", "auto"):
        # encoded checkpoints hold whole blocks ([Note: encoded blocks on disk])
        return _choice(
            s,
            "rank-local",
            f"auto: host_budget_gb with codec {s.codec!r} reads whole encoded blocks",
            rl_ms,
            ag_ms,
        )
    return choice


def _choice(
    s: StackSpec, transfer: str, reason: str, rl_ms: float, ag_ms: float | None
) -> StackChoice:
    local = transfer in ("rank-local", "node-shared")  # whole blocks, no collective
    return StackChoice(
        name=s.name,
        transfer=transfer,
        group_axis="local" if local else s.group_axis,
        group_size=1 if local else s.group_size,
        num_resident=s.num_resident,
        requested=s.transfer,
        rank_local_ms=rl_ms,
        allgather_ms=ag_ms,
        reason=reason,
    )


def _compute_hides_whole_blocks(s: StackSpec, inp: PolicyInput) -> bool:
    """The known compute time of a block is at least the copy of the stack's largest block
    (so node-shared, moving whole blocks, runs at compute speed like AllGather)."""
    t_c, m = inp.block_compute_s, inp.measured
    if t_c is None or not s.block_nbytes or s.component != "dit":  # the DiT's compute
        return False
    largest = max(s.block_nbytes)
    copy = block_times(
        largest, group_size=1, chunk_nbytes=inp.chunk_nbytes, h2d_bps=m.h2d_bps, allgather_bps=1.0
    )[0]
    return copy <= t_c


def _fit_shared(inp: PolicyInput, choices: list[StackChoice]) -> list[StackChoice]:
    """Keep the automatic node-shared choices if the fullest node's copies of every
    node-shared stack (explicit ones too: one file holds them all; one copy per weight group
    on the node) fit the free shared memory less the headroom; else give the automatic ones
    the transfer they would have had without it (AllGather where it is faster, else
    rank-local), saying why."""
    shared = [(s, c) for s, c in zip(inp.stacks, choices) if c.transfer == "node-shared"]
    auto = [(s, c) for s, c in shared if c.requested == "auto"]
    if not auto:
        return choices
    copies = inp.shared_copies_per_node
    need = copies * sum(
        padded_nbytes(b, 1, inp.chunk_nbytes) for s, _ in shared for b in s.block_nbytes
    )
    free = inp.measured.shared_memory_nbytes
    what = "the node's copy needs" if copies == 1 else f"the node's {copies} copies need"
    if free is not None and need <= free * (1 - SHARED_MEMORY_HEADROOM):
        fits = f" ({what} {_size(need)} of the {_size(free)} free in shared memory)"
        return [
            dataclasses.replace(c, reason=c.reason + fits)
            if c.requested == "auto" and c.transfer == "node-shared"
            else c
            for c in choices
        ]
    why = f"{what} {_size(need)}, shared memory has " + (
        f"{_size(free)} free" if free is not None else "an unknown size"
    )
    spec = {id(c): s for s, c in auto}
    return [_without_sharing(c, spec[id(c)], why) if id(c) in spec else c for c in choices]


def _without_sharing(c: StackChoice, s: StackSpec, why: str) -> StackChoice:
    rl = c.rank_local_ms
    if c.allgather_ms is not None and rl is not None and c.allgather_ms < rl:
        return dataclasses.replace(
            c,
            transfer="allgather",
            group_axis=s.group_axis,
            group_size=s.group_size,
            reason=f"{c.reason}; allgather: {why}",
        )
    return dataclasses.replace(c, transfer="rank-local", reason=f"{c.reason}; rank-local: {why}")


def _resident_split(stacks: tuple[StackSpec, ...], per_dit: int) -> list[int]:
    """Resident count per stack for ``per_dit`` leading blocks of every eligible DiT."""
    left: dict[str, int] = {}
    out = []
    for s in stacks:
        if s.component != "dit" or not s.resident_eligible:
            out.append(0)
            continue
        k = min(left.setdefault(s.dit_path, per_dit), len(s.block_nbytes))
        left[s.dit_path] -= k
        out.append(k)
    return out


def _weights(
    stacks: tuple[StackSpec, ...],
    choices: list[StackChoice],
    resident: list[int],
    num_slots: int,
    chunk: int,
) -> tuple[int, int]:
    """``(slot_nbytes, slots + resident bytes)`` for one candidate (the ring allocates at
    most one slot per streamed block: :attr:`~dlo.plan.layers.LayerPlan.allocated_slots`)."""
    slot, resident_nbytes = 0, 0
    for s, c, r in zip(stacks, choices, resident):
        for i, b in enumerate(s.block_nbytes):
            p = padded_nbytes(b, c.group_size, chunk)
            if i < r:
                resident_nbytes += p
            else:
                slot = max(slot, p)
    staging = staging_nbytes(stacks, choices, chunk)
    return slot, allocated_slots(stacks, resident, num_slots) * slot + resident_nbytes + staging


def _room(inp: PolicyInput) -> tuple[int | None, int]:
    """The device bytes this run may still take (the free memory, capped by the budget less
    what the process holds: [Note: device budget]) and the held bytes counted."""
    m = inp.measured
    held = m.held_device_nbytes
    if held is None:  # unknown (a CPU device): the non-block weights already there
        held = inp.non_block_nbytes - inp.non_block_to_place_nbytes
    room = m.free_device_nbytes
    if inp.device_budget_gb is not None:
        left = max(0, int(inp.device_budget_gb * GIB) - held)
        room = left if room is None else min(room, left)
    return room, held


def decide(inp: PolicyInput) -> PolicyDecision:
    """The automatic settings for ``inp`` (see [Note: policy model]; optional encoder stacks:
    [Note: encoders kept or streamed] in :mod:`dlo.plan.encoder_choice`). Deterministic.

    Args:
        inp: block sizes, groups, measured numbers, capacity and the requested settings.
    Returns:
        The :class:`PolicyDecision`: a concrete transfer per stack, the slot count, the
        resident count, the modeled bytes, and the explanation lines.
    Raises:
        ValueError: malformed input, or a ``device_budget_gb`` that cannot hold the
            non-block weights and one slot (naming ``device_budget_gb`` and its value).

    Example:
        >>> m = Measurements(h2d_bps=50e9, allgather_bps={"data": 500e9}, num_ranks=2)
        >>> s = StackSpec(name="blocks", component="dit", dit_path="", block_nbytes=(1 << 28,),
        ...               transfer="auto", group_axis="data", group_size=2)
        >>> decide(PolicyInput(stacks=(s,), chunk_nbytes=1 << 26, measured=m)).stacks[0].transfer
        'allgather'
    """
    _check_input(inp)
    return choose_encoders(inp, _decide_one)


def _decide_one(inp: PolicyInput) -> PolicyDecision:
    chunk, m = inp.chunk_nbytes, inp.measured
    choices = _fit_shared(inp, [_choose_transfer(s, inp) for s in inp.stacks])
    choices = [choose_codec(s, c, inp) for s, c in zip(inp.stacks, choices)]

    # slots: hide the longest per-slot cycle of any streamed block
    cycle_slots = 2
    for s, c in zip(inp.stacks, choices):
        for b in s.block_nbytes:
            lat, occ = block_times(
                b,
                group_size=c.group_size,
                chunk_nbytes=chunk,
                h2d_bps=m.h2d_bps,
                allgather_bps=m.allgather_bps.get(c.group_axis, 0.0),  # unused at G = 1
            )
            # the assumption t_c = P, even with a known compute time: a known one can only
            # lower the count, and the third AllGather slot measured faster at 4096 tokens
            # where the model with the real t_c says two suffice
            cycle_slots = max(cycle_slots, slots_needed(lat, occ, None))

    budget = int(inp.device_budget_gb * GIB) if inp.device_budget_gb is not None else None
    room, held = _room(inp)
    capacity: int | None = None
    if room is not None and (
        budget is not None or inp.resident_layers == "auto" or inp.num_slots == "auto"
    ):
        usable = int(room * (1 - FREE_MEMORY_HEADROOM))
        capacity = usable - inp.non_block_to_place_nbytes

    # candidate resident splits: every per-DiT count when "auto", else the explicit one
    if inp.resident_layers == "auto":
        dits: dict[str, int] = {}
        for s in inp.stacks:
            if s.component == "dit" and s.resident_eligible:
                dits[s.dit_path] = dits.get(s.dit_path, 0) + len(s.block_nbytes)
        r_max = min(dits.values(), default=0)
        splits = {r: _resident_split(inp.stacks, r) for r in range(r_max + 1)}
    else:
        assert isinstance(inp.resident_layers, int)
        r_max = inp.resident_layers
        splits = {r_max: [s.num_resident for s in inp.stacks]}

    def fitting(slots: int) -> list[int]:
        return [
            r
            for r, split in splits.items()
            if capacity is None or _weights(inp.stacks, choices, split, slots, chunk)[1] <= capacity
        ]

    slot_note = kept("num_slots", inp)
    if inp.num_slots == "auto":
        num_slots = cycle_slots
        while num_slots > 1 and not fitting(num_slots):
            num_slots -= 1
        slot_note = f"auto: a slot's cycle (load latency + compute) needs {cycle_slots}" + (
            f", {num_slots} fit" if num_slots < cycle_slots else ""
        )
    else:
        assert isinstance(inp.num_slots, int)
        num_slots = inp.num_slots
    fits = fitting(num_slots)
    if budget is not None and not fits:
        need = min(
            _weights(inp.stacks, choices, split, num_slots, chunk)[1] for split in splits.values()
        )
        reserve, free = FREE_MEMORY_HEADROOM, m.free_device_nbytes
        total = held + (inp.non_block_to_place_nbytes + need) / (1 - reserve)
        limit = f"device_budget_gb={inp.device_budget_gb!r}"
        if free is not None and free < budget - held:  # the device, not the budget, binds
            limit += f" (the device has only {_size(free)} free)"
        raise ValueError(
            f"{limit} cannot hold what the run needs on the device: {_size(held)} already "
            f"there, the non-block weights still to place "
            f"({_size(inp.non_block_to_place_nbytes)}) and {num_slots} slot(s) and resident "
            f"blocks ({_size(need)}), with {reserve:.0%} of the rest kept for activations: a "
            f"budget of at least {_size(int(total))} and as much free memory"
        )
    if inp.resident_layers == "auto":
        # the cost is not monotonic in r (the slot shrinks once the largest block is
        # resident, and disappears once every block is): take the largest r that fits
        per_dit = max(fits) if fits and capacity is not None else 0
        resident_note = (
            f"auto: the most leading blocks of each DiT that fit ({per_dit} of {r_max})"
            if capacity is not None
            else "auto: capacity unknown, none kept"
        )
    else:
        per_dit, resident_note = r_max, kept("resident_layers", inp)
    resident = splits[per_dit]
    choices = [
        dataclasses.replace(c, num_resident=r)
        if not (s.codec == "auto" and c.codec != "none" and r >= len(s.block_nbytes))
        else dataclasses.replace(
            c, num_resident=r, codec="none", codec_reason="auto: every block is resident"
        )
        for s, c, r in zip(inp.stacks, choices, resident)
    ]
    slot_nbytes, dlo_nbytes = _weights(inp.stacks, choices, resident, num_slots, chunk)
    device_nbytes = dlo_nbytes + inp.non_block_nbytes
    allocated = allocated_slots(inp.stacks, resident, num_slots)
    staging = staging_nbytes(inp.stacks, choices, chunk)
    if allocated < num_slots:
        slot_note += f"; {allocated} allocated, one per streamed block"
    lines = explain_lines(inp, choices, num_slots, slot_note, per_dit, resident_note, slot_nbytes)
    if budget is not None and capacity is not None:
        bound = (
            f" (device_budget_gb {_size(budget)}: at most {_size(capacity + inp.non_block_nbytes)}"
            f" of weights, {_size(held)} held at enable, {FREE_MEMORY_HEADROOM:.0%} of the "
            "rest kept for activations)"
        )
    elif capacity is not None:
        bound = f" (free memory less headroom: {_size(capacity + inp.non_block_nbytes)})"
    else:
        bound = ""
    lines.append(
        f"  device weights: {_size(device_nbytes)} = non-block {_size(inp.non_block_nbytes)}"
        f" + {allocated} slot(s) x {_size(slot_nbytes)} + resident "
        f"{_size(dlo_nbytes - allocated * slot_nbytes - staging)}"
        + (f" + decode staging {_size(staging)} (at most)" if staging else "")
        + bound
    )
    return PolicyDecision(
        stacks=tuple(choices),
        num_slots=num_slots,
        resident_layers=per_dit,
        slot_nbytes=slot_nbytes,
        device_weight_nbytes=device_nbytes,
        capacity_nbytes=capacity,
        measured=m,
        lines=tuple(lines),
    )
