"""Which streamed blocks stay in host memory under ``host_budget_gb``, and which are read from
their file for every use. Pure.

[Note: host budget tiers]
``OffloadConfig.host_budget_gb`` caps the bytes of this rank's host copy of the blocks (its
private region: each block's bytes rounded up to the pages it gets there; an encoded copy's
bytes where a codec's encoded checkpoint tells them, see [Note: encoded blocks on disk] in
:mod:`dlo.codec.on_disk`). A block that does not fit stays in the checkpoint or pipeline
folder it was loaded from and is read into page-locked staging for each use, ahead of the
ring (see [Note: disk read-ahead] in :mod:`dlo.runtime.read_ahead`). Which blocks keep their
host copy:

* everything, when it all fits;
* else resident blocks never: they cross the link once, at enable, so their one read from the
  file never stalls a forward (they come first onto the disk tier);
* then the blocks that run most per call keep theirs: the DiT's blocks run at every step,
  an encoder's once per prompt, so a byte of the DiT's read from the disk costs a step's
  worth of reads per call and an encoder's one;
* within one component the time a forward spends reading is the same for any choice of
  blocks with the same bytes (every byte is read at the disk's rate), so the choice is how
  many bytes fit, and where: the kept blocks are spread evenly along the ring (by bytes,
  Bresenham-style), so the disk reads ahead while a kept block is copied and computed
  instead of standing idle through a run of kept blocks and then being the bottleneck
  through a run of read ones; what the even spread leaves of the budget goes to the largest
  remaining blocks that fit.

The choice is made in plan order and depends only on the layouts, so it is the same at
every enable with the same budget.
"""

from __future__ import annotations

from collections.abc import Sequence

READ_AHEAD_BUFFERS = 2
"""Whole-block page-locked buffers of the disk tier (see [Note: disk read-ahead] in
:mod:`dlo.runtime.read_ahead`): one is copied while the next is read."""

RUNS_PER_CALL = {"dit": 2, "encoder": 1}
"""How the tiers rank components: a DiT's blocks before an encoder's (their ratio is not
used, only the order)."""


def choose_on_disk(
    nbytes: Sequence[int],
    components: Sequence[str],
    resident: Sequence[bool],
    budget_nbytes: int,
) -> frozenset[int]:
    """Positions of the blocks read from their file under a host budget of ``budget_nbytes``
    (see [Note: host budget tiers]).

    Args:
        nbytes: each block's host bytes (its shard in the region).
        components: each block's component kind (``"dit"`` or ``"encoder"``).
        resident: whether each block is resident on the device.
        budget_nbytes: the bytes the kept blocks may hold together (>= 0).
    Returns:
        The positions of the blocks that are not kept in host memory.

    Example:
        >>> sorted(choose_on_disk([4, 4, 4, 4], ["dit"] * 4, [False] * 4, 8))
        [0, 2]
    """
    assert len(nbytes) == len(components) == len(resident) and budget_nbytes >= 0
    if sum(nbytes) <= budget_nbytes:
        return frozenset()
    kept: set[int] = set()
    left = budget_nbytes
    ranks = sorted({RUNS_PER_CALL.get(c, 1) for c in components}, reverse=True)
    for runs in ranks:
        group = [
            i
            for i in range(len(nbytes))
            if not resident[i] and RUNS_PER_CALL.get(components[i], 1) == runs
        ]
        total = sum(nbytes[i] for i in group)
        if not group or left <= 0:
            continue
        if total <= left:
            kept.update(group)
            left -= total
            continue
        spread = _spread(group, nbytes, left / total)
        kept.update(spread)
        left -= sum(nbytes[i] for i in spread)
        for i in sorted(set(group) - spread, key=lambda i: (-nbytes[i], i)):
            if nbytes[i] <= left:
                kept.add(i)
                left -= nbytes[i]
    return frozenset(i for i in range(len(nbytes)) if i not in kept)


def _spread(group: list[int], nbytes: Sequence[int], share: float) -> set[int]:
    """Blocks of ``group`` (in ring order) kept so that the kept bytes follow ``share`` of
    the bytes seen so far as closely as possible without exceeding it: an even spread."""
    kept: set[int] = set()
    seen = held = 0
    for i in group:
        seen += nbytes[i]
        if held + nbytes[i] <= share * seen:
            kept.add(i)
            held += nbytes[i]
    return kept
