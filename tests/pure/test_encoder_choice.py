"""Which found encoders stream ([Note: encoders kept or streamed]): the policy keeps them whole
unless the DiT needs their memory. Pure."""

from __future__ import annotations

import dataclasses

import pytest

from dlo.config.fields import MIB
from dlo.plan.encoder_choice import kept_whole
from dlo.plan.policy import decide
from dlo.plan.policy_model import (
    FREE_MEMORY_HEADROOM,
    GIB,
    Measurements,
    PolicyInput,
    StackSpec,
)

BLOCK = 64 * MIB  # a DiT block; the encoder's are half as large
NUM_DIT, NUM_ENC = 8, 6
ENCODER = NUM_ENC * BLOCK // 2


def _stacks(*, optional: bool = True) -> tuple[StackSpec, ...]:
    dit = StackSpec("dit.blocks", "dit", "dit", (BLOCK,) * NUM_DIT, "rank-local", "local", 1)
    enc = StackSpec(
        "text_encoder.encoder.block",
        "encoder",
        "text_encoder",
        (BLOCK // 2,) * NUM_ENC,
        "rank-local",
        "local",
        1,
        optional=optional,
    )
    return dit, enc


def _input(room: int | None, *, resident: int | str = "auto", optional: bool = True) -> PolicyInput:
    """A budget whose usable room (after the activation headroom) is ``room`` bytes."""
    budget = None if room is None else room / (1 - FREE_MEMORY_HEADROOM) / GIB + 1e-9
    return PolicyInput(
        stacks=_stacks(optional=optional),
        chunk_nbytes=64 * MIB,
        measured=Measurements(h2d_bps=50e9, held_device_nbytes=0),
        num_slots="auto",
        resident_layers=resident,
        device_budget_gb=budget,
    )


def _resident(d) -> int:  # type: ignore[no-untyped-def]
    return sum(c.num_resident for c in d.stacks if c.name == "dit.blocks")


def test_everything_fits_the_encoder_stays_whole_and_nothing_streams() -> None:
    d = decide(_input(NUM_DIT * BLOCK + ENCODER + MIB))
    assert d.whole == ("text_encoder.encoder.block",)
    assert [c.name for c in d.stacks] == ["dit.blocks"]  # the encoder is no stack
    assert _resident(d) == NUM_DIT
    assert d.as_dict()["kept_whole"] == ["text_encoder.encoder.block"]
    assert "kept whole on the device (every DiT block is resident" in d.explanation
    # its bytes are weights on the device: counted with the non-block ones
    assert d.device_weight_nbytes == NUM_DIT * BLOCK + ENCODER


def test_the_dit_needs_the_room_the_encoder_streams() -> None:
    # whole: 3 DiT blocks beside 2 slots; streamed: 2 slots and 6 more resident blocks
    d = decide(_input(ENCODER + 5 * BLOCK + MIB))
    assert d.whole == ()
    assert [c.name for c in d.stacks] == ["dit.blocks", "text_encoder.encoder.block"]
    whole = decide(kept_whole(_input(ENCODER + 5 * BLOCK + MIB)))
    assert _resident(d) > _resident(whole) == 3
    assert "streamed (whole, 3 DiT blocks would be resident; streamed, " in d.explanation


def test_a_budget_that_cannot_hold_the_encoder_whole_streams_it() -> None:
    d = decide(_input(3 * BLOCK))  # less than the encoder and a slot
    assert d.whole == ()
    assert "the budget cannot hold them whole" in d.explanation


def test_streaming_that_keeps_no_more_blocks_resident_keeps_it_whole() -> None:
    # an explicit resident count: streaming the encoder cannot change it
    d = decide(_input(ENCODER + 5 * BLOCK + MIB, resident=2))
    assert d.whole == ("text_encoder.encoder.block",)
    assert "keeps no more DiT blocks resident" in d.explanation


def test_unknown_capacity_keeps_the_encoder_whole() -> None:
    d = decide(_input(None))  # no budget, no free-memory measurement
    assert d.whole == ("text_encoder.encoder.block",)


def test_a_stack_that_is_not_optional_always_streams() -> None:
    d = decide(_input(NUM_DIT * BLOCK + ENCODER + MIB, optional=False))
    assert d.whole == ()
    assert "encoders" not in d.explanation


@pytest.mark.parametrize("extra", [0, BLOCK // 2, BLOCK, 3 * BLOCK, 6 * BLOCK])
def test_the_choice_never_keeps_fewer_dit_blocks_resident(extra: int) -> None:
    room = ENCODER + 2 * BLOCK + extra
    d = decide(_input(room))
    assert _resident(d) >= _resident(decide(kept_whole(_input(room))))
    assert d.device_weight_nbytes <= room


def test_a_tie_on_resident_blocks_goes_to_the_plan_with_more_slots() -> None:
    """A small encoder: whole, it leaves room for one slot and no resident block (every load
    exposed); streamed, two slots fit and still no resident block: the encoder streams."""
    small = dataclasses.replace(_stacks()[1], block_nbytes=(BLOCK // 4,) * 2)
    inp = dataclasses.replace(
        _input(BLOCK // 2 + BLOCK + BLOCK // 2 + MIB), stacks=(_stacks()[0], small)
    )
    whole = decide(kept_whole(inp))
    assert (_resident(whole), whole.num_slots) == (0, 1)
    d = decide(inp)
    assert d.whole == () and (_resident(d), d.num_slots) == (0, 2)
