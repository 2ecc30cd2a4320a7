"""The order a component's streamed blocks run in, learned on its first forward.

[Note: prefetch chain]
A component's blocks form one ring across all its stacks, so the last block of one stack
prefetches the first block of the next and a multi-stack model (Flux: double-stream then
single-stream blocks) never waits on a demand load at the seam. The order of the stacks is
not always their attribute order (Lumina2 runs ``context_refiner`` before ``noise_refiner``;
Wan VACE runs ``vace_blocks`` first) and two stacks may interleave (Latte's spatial and
temporal blocks), so it is learned: until the first forward of the component has run, the
prediction after a block is the blocks not seen yet in declared cyclic order, then the ones
seen; the order is fixed as the sequence of first entries when a block enters a second time
(the next forward began) or every block has entered. From then on the ring prefetches in
that order. A block that did not run in the first forward (an optional stack, or a first
forward cut short by an exception) joins the ring the first time it runs, after the block
that ran before it, so it costs one demand load once; until then the prediction after it
is its declared successors.

Every decision depends only on the sequence of block entries, which ranks of an AllGather
group share (the lock-step check compares every load), so they learn the same order. The
learned order is also compared once, by digest, the moment it is fixed (see
:meth:`~dlo.runtime.sequence.SequenceCheck.agree`), so a divergence is reported as ranks that
ran their blocks in different orders, naming both.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)


Block = TypeVar("Block")


class ExecutionOrder(Generic[Block]):
    """Learns and predicts the cyclic order of ``declared`` (see [Note: prefetch chain]).

    Example:
        >>> order = ExecutionOrder(["a0", "a1", "b0", "b1"], name=str)
        >>> [order.observe(x) for x in ["b0", "b1", "a0", "a1"]][-1]
        True
        >>> order.after("a1", 2)
        ['b0', 'b1']
    """

    def __init__(self, declared: Sequence[Block], *, name: Callable[[Block], str]) -> None:
        self.declared = list(declared)
        self._name = name
        self._declared_at = {id(b): i for i, b in enumerate(self.declared)}
        self._seen: list[Block] = []
        self._seen_ids: set[int] = set()
        self.learned: list[Block] | None = None
        """The fixed order (None while the first forward runs)."""
        self._learned_at: dict[int, int] = {}
        self._previous: Block | None = None

    def observe(self, block: Block) -> bool:
        """Record that ``block`` entered; True when this entry fixed the order."""
        previous, self._previous = self._previous, block
        if self.learned is not None:
            if id(block) not in self._learned_at:
                self._join(block, previous)
            return False
        if id(block) in self._seen_ids:
            self._fix()
            return True
        self._seen.append(block)
        self._seen_ids.add(id(block))
        if len(self._seen) == len(self.declared):
            self._fix()
            return True
        return False

    def _join(self, block: Block, previous: Block | None) -> None:
        """Put a block that was off the ring into it, after the block that ran before it."""
        assert self.learned is not None
        at = len(self.learned)
        if previous is not None and id(previous) in self._learned_at:
            at = self._learned_at[id(previous)] + 1
        self.learned.insert(at, block)
        self._learned_at = {id(b): i for i, b in enumerate(self.learned)}

    def _fix(self) -> None:
        self.learned = list(self._seen)
        self._learned_at = {id(b): i for i, b in enumerate(self.learned)}

    def after(self, block: Block, n: int) -> list[Block]:
        """Up to ``n`` blocks predicted to run after ``block``, ``block`` itself excluded."""
        if self.learned is not None and id(block) in self._learned_at:
            ring, start = self.learned, self._learned_at[id(block)]
            candidates = ring[start + 1 :] + ring[:start]
        else:
            start = self._declared_at[id(block)]
            rest = self.declared[start + 1 :] + self.declared[:start]
            if self.learned is not None:  # off the ring: its declared successors
                candidates = rest
            else:
                unseen = [b for b in rest if id(b) not in self._seen_ids]
                candidates = unseen + [b for b in self._seen if b is not block]
        return candidates[:n]

    def digest(self) -> int:
        """A 63-bit digest of the learned order (names and count), for the agreement."""
        assert self.learned is not None
        h = hashlib.blake2b(digest_size=8)
        for b in self.learned:
            h.update(self._name(b).encode() + b"\0")
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)

    def describe(self) -> str:
        """The learned order, as block names."""
        assert self.learned is not None
        names = [self._name(b) for b in self.learned]
        return f"{', '.join(names)} ({len(names)} blocks)"


def learn(
    order: ExecutionOrder[Block],
    block: Block,
    agree: Callable[[int, str], None],
    component: str,
) -> None:
    """Record ``block``'s entry in ``order``; the moment the order is fixed, log it when it
    is not the declared one and ``agree`` on its digest across the weight group (before the
    block's load, so every rank issues the comparison at the same point)."""
    if not order.observe(block):
        return
    if order.learned != order.declared:
        logger.info(
            "dlo: %s runs its blocks out of declared order; prefetching in the order it ran: %s",
            component or "the model",
            order.describe(),
        )
    agree(order.digest(), order.describe())
