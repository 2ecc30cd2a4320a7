"""Which encoders stream: the policy keeps an optional encoder whole on the device unless the
DiT needs its memory. Pure.

[Note: encoders kept or streamed]
A text encoder runs once per prompt, the DiT once or twice per step: device memory is worth
more to the DiT. With ``components`` unset and residency automatic, enable offers the
policy every encoder whose blocks it finds without the pipeline declaring them (from the
encoder's own ``_no_split_modules``: umT5-XXL, T5-XXL, CLIP; or its ``_repeated_blocks``,
an adapter, a structural guess) as an optional stack (:attr:`dlo.plan.topology.BlockStack.optional`), and :func:`choose_encoders`
decides twice:

* whole: the optional stacks leave the plan and their bytes join the non-block weights to
  place (counted as not on the device yet: where an encoder already is, the free-memory
  bound counts it twice, which only errs toward streaming);
* streamed: every stack as given.

The encoders stay whole where that plan fits and keeps every eligible DiT block resident
(nothing streams where the whole pipeline fits, and trivially where no DiT may keep
resident blocks), or where streaming them would keep neither more DiT blocks resident nor
more slots (a second slot prefetches), or cannot fit; else they stream, through the same slots, before the DiT's first
forward of each call. An encoder stack costs its bytes once per prompt; the DiT blocks its
memory keeps resident save their bytes on every forward (the FLUX.1-dev folder under a 24 GB
budget placed its 9.4 GiB of T5 and CLIP whole and streamed 41 of 57 DiT blocks, H100,
2026-12-06). An explicit ``components`` streams what it names and nothing else; a
quantized or sharded encoder (not plain tensors) is never optional.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dlo.plan.policy_model import PolicyDecision, PolicyInput, _size

Decide = Callable[[PolicyInput], PolicyDecision]


def kept_whole(inp: PolicyInput) -> PolicyInput:
    """``inp`` with its optional stacks kept whole: out of the stacks, their bytes with the
    non-block weights still to place."""
    nbytes = sum(sum(s.block_nbytes) for s in inp.stacks if s.optional)
    return dataclasses.replace(
        inp,
        stacks=tuple(s for s in inp.stacks if not s.optional),
        non_block_nbytes=inp.non_block_nbytes + nbytes,
        non_block_to_place_nbytes=inp.non_block_to_place_nbytes + nbytes,
    )


def all_dit_blocks_resident(inp: PolicyInput, d: PolicyDecision) -> bool:
    """Every block of every eligible DiT stack is resident in ``d``."""
    by_name = {c.name: c for c in d.stacks}
    return all(
        by_name[s.name].num_resident >= len(s.block_nbytes)
        for s in inp.stacks
        if s.component == "dit" and s.resident_eligible
    )


def resident_blocks(d: PolicyDecision) -> int:
    return sum(c.num_resident for c in d.stacks)


def kept(d: PolicyDecision) -> tuple[int, int]:
    """What a plan keeps on the device for the DiT: resident blocks, then slots (a second
    slot prefetches: without it every load is exposed)."""
    return resident_blocks(d), d.num_slots


def choose_encoders(inp: PolicyInput, decide_one: Decide) -> PolicyDecision:
    """The decision of ``decide_one`` with the optional stacks of ``inp`` kept whole or
    streamed ([Note: encoders kept or streamed]); ``decide_one(inp)`` where none is
    optional. Deterministic.

    Raises:
        ValueError: as ``decide_one`` where neither keeping the encoders whole nor streaming
            them fits (a budget that cannot hold even the streamed plan).
    """
    optional = [s for s in inp.stacks if s.optional]
    if not optional:
        return decide_one(inp)
    names = tuple(s.name for s in optional)
    label = ", ".join(names)
    nbytes = sum(sum(s.block_nbytes) for s in optional)
    whole_inp = kept_whole(inp)
    whole: PolicyDecision | None = None
    why_not = ""
    if whole_inp.stacks:
        try:
            whole = decide_one(whole_inp)
        except ValueError:
            why_not = "the budget cannot hold them whole"
    if whole is not None and all_dit_blocks_resident(whole_inp, whole):
        line = (
            f"  encoders {label} ({_size(nbytes)}): kept whole on the device (every DiT block "
            "is resident beside them)"
        )
        return _with(whole, names, line)
    try:
        streamed = decide_one(inp)
    except ValueError:
        if whole is None:
            raise
        streamed = None  # the encoders' blocks need slots the budget cannot hold
    if whole is not None and (streamed is None or kept(streamed) <= kept(whole)):
        why = (
            "streaming them needs slots the budget cannot hold"
            if streamed is None
            else "streaming them keeps no more DiT blocks resident, nor more slots"
        )
        line = (
            f"  encoders {label} ({_size(nbytes)}): kept whole on the device ({why}: "
            f"{resident_blocks(whole)} resident, {whole.num_slots} slot(s))"
        )
        return _with(whole, names, line)
    assert streamed is not None
    if whole is not None:
        why_not = (
            f"whole, {resident_blocks(whole)} DiT blocks would be resident; streamed, "
            f"{resident_blocks(streamed)}"
        )
    line = f"  encoders {label} ({_size(nbytes)}): streamed ({why_not or 'no DiT to weigh'})"
    return dataclasses.replace(streamed, lines=(*streamed.lines, line))


def _with(d: PolicyDecision, names: tuple[str, ...], line: str) -> PolicyDecision:
    return dataclasses.replace(d, whole=names, lines=(*d.lines, line))
