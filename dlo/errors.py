"""Exception types of dlo.

Bad user input (config fields, declarations) raises the built-in ``ValueError`` or
``TypeError`` naming the field and the value. Failures of the offload runtime itself raise
:class:`OffloadError`, which carries the rank and, where one is involved, the block.
"""

from __future__ import annotations


class OffloadError(RuntimeError):
    """A runtime offload failure (enable, transfer, agreement, hook misuse).

    Attributes:
        rank: global rank of the process that raised (0 without a process group).
        block: dotted path of the block involved, or ``None``.
    """

    def __init__(self, message: str, *, rank: int = 0, block: str | None = None) -> None:
        self.rank = rank
        self.block = block
        where = f"[dlo rank {rank}]" + (f" block {block!r}:" if block else "")
        super().__init__(f"{where} {message}")


class BackendPoisonedError(OffloadError):
    """Raised when a backend whose multi-rank state failed after agreement is used again.

    The worker must be discarded (recreated); no recovery collective is attempted.
    """


class InjectedFault(RuntimeError):
    """Raised by a test-armed fault point (see :mod:`dlo.faults`)."""

    def __init__(self, point: str) -> None:
        self.point = point
        super().__init__(f"injected fault at {point!r}")


class ForwardRefused(OffloadError):
    """A forward refused before any block ran: it cannot fit the device even with every
    block streamed through one slot (see [Note: re-plan between forwards] in
    :mod:`dlo.plan.replan`). Nothing moved; the backend stays usable for smaller inputs."""


def refuse_in_forward(busy: bool, what: str, rank: int) -> None:
    """Refuse ``what()`` (a call that moves dlo's hooks or rebinds block tensors: a step
    cache's enable, an adapter call) while a block forward runs (``busy``)."""
    if busy:
        raise OffloadError(
            f"{what}() while a block forward runs: call it between pipeline calls", rank=rank
        )
