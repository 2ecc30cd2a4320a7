"""The guard: who may run a managed module's forward now, and what no forward may do.

Shared by the ring (a block at a time) and the model-level swap (a component group at a
time). Every forward of a module dlo manages first takes a *claim* on it, under one lock:

* a claim conflicting with one held (the backend says what conflicts) is refused with the
  backend's own message, before anything is enqueued;
* a claim whose call ended without its post-hook (a ``KeyboardInterrupt`` inside the
  forward, or a worker thread that died in one) is *stale*: it is dropped when the next
  claim or a disable looks at the claims, and the backend releases what it held (see
  [Note: calls that ended without post-hooks] in :mod:`dlo.hooks.frames`);
* once a disable has begun (:meth:`Guard.begin_disable`), every forward is refused until the
  hooks are gone, and a disable is refused while another thread runs a forward (its
  weights would vanish mid-forward; waiting would look like a hang).

:meth:`Guard.refuse_unsupported` refuses what no streamed or swapped module can serve: a
CUDA graph capture around it (which would replay one step's loads into fixed slots and wait
on events recorded outside the capture), autograd (slots are reused, so weights saved for
backward would be overwritten), and inputs on another device. ``torch.compile`` is served:
the hooks run outside compiled frames (see [Note: hooks outside compiled frames] in
:mod:`dlo.hooks.compiled`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from dlo.errors import OffloadError
from dlo.hooks.frames import call_ended, module_call_frame
from dlo.platform.device import Platform

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Claim:
    """One forward in progress."""

    key: Any
    """What the forward runs (a ring's block, a swap's component)."""
    name: str
    thread: int
    frame: FrameType | None
    """The module call that took the claim (see :func:`~dlo.hooks.frames.module_call_frame`)."""


class Guard:
    """Claims on the modules one backend serves (see the module docstring).

    Args:
        platform: the device (inputs must be on it; stream capture is read from it).
        rank: this rank, for errors.
        what: how errors name the managed modules: ``"block"`` or ``"component"``.
        on_stale: called with a stale claim's key, under the claim lock, after the claim is
            dropped: the backend releases what that forward held.
    """

    def __init__(
        self,
        platform: Platform,
        *,
        rank: int,
        what: str,
        on_stale: Callable[[Any], None] | None = None,
        order: Callable[[Any], int] | None = None,
        disable_drops_own_stale: bool = False,
        check_devices: bool = True,
    ) -> None:
        self.platform = platform
        self.rank = rank
        self.what = what
        self.on_stale = on_stale
        self.order = order
        """Sorts keys in the backend's module order, for messages."""
        self.disable_drops_own_stale = disable_drops_own_stale
        """A disable also drops the calling thread's own stale claims (else it proceeds over
        them: the teardown releases everything)."""
        self.check_devices = check_devices
        """Refuse inputs on another device (the ring's blocks; not whole components, whose
        forwards may take host tensors such as a timestep)."""
        self.claims: list[Claim] = []
        self.closing = False
        """Set by :meth:`begin_disable`: later forwards are refused."""
        self._lock = threading.Lock()

    def claim(self, key: Any, name: str, conflicts: Callable[[Claim], bool]) -> list[Claim]:
        """Claim ``key`` for this thread's forward unless a held claim ``conflicts``; stale
        claims are dropped first. Returns the conflicting claims (empty: claimed).

        Raises:
            OffloadError: a disable has begun.
        """
        claim = Claim(key, name, threading.get_ident(), module_call_frame())
        with self._lock:  # check and claim in one step: two threads never both get past
            if self.closing:
                raise OffloadError(
                    "forward started while offload is being disabled (another thread called "
                    "disable()); call it again once disable() returned",
                    rank=self.rank,
                    block=name,
                )
            if self.claims:
                self._drop_stale(others_only=False)
            busy = [c for c in self.claims if conflicts(c)]
            if not busy:
                self.claims.append(claim)
        return busy

    def release(self, key: Any) -> bool:
        """Drop this thread's latest claim on ``key``; False when it holds none (its claim
        was refused, or released already)."""
        me = threading.get_ident()
        with self._lock:
            claims = self.claims
            for i in range(len(claims) - 1, -1, -1):
                c = claims[i]
                if c.key is key and c.thread == me:
                    del claims[i]
                    return True
        return False

    def busy(self) -> bool:
        """Whether a claim is held now (stale ones, of calls that ended without their
        post-hook, dropped first)."""
        with self._lock:
            if self.claims:
                self._drop_stale(others_only=False)
            return bool(self.claims)

    def in_forward(self) -> bool:
        """This thread runs a managed module's forward now (a claim whose call is live)."""
        me = threading.get_ident()
        return any(c.thread == me and not call_ended(c.frame, c.thread) for c in self.claims)

    def held_by_me(self, key: Any) -> bool:
        me = threading.get_ident()
        return any(c.key is key and c.thread == me for c in self.claims)

    def clear(self) -> None:
        """Forget every claim (teardown)."""
        self.claims = []

    def names(self, claims: list[Claim]) -> list[str]:
        """The names of ``claims``' keys, each once, in the backend's module order."""
        keys = list({id(c.key): c for c in claims}.values())
        if self.order is not None:
            order = self.order
            keys.sort(key=lambda c: order(c.key))
        return [c.name for c in keys]

    def begin_disable(self) -> None:
        """Decide, under the claim lock, whether disable may proceed: refused while another
        thread runs a forward; otherwise every later forward is refused. The calling
        thread's own forward (disable from inside a forward) does not count.

        Raises:
            OffloadError: another thread runs a forward (nothing was changed).
        """
        me = threading.get_ident()
        with self._lock:
            self._drop_stale(others_only=not self.disable_drops_own_stale)
            busy = [c for c in self.claims if c.thread != me]
            if busy:
                names = self.names(busy)
                running = (
                    "this block's forward" if self.what == "block" else f"the forward of {names}"
                )
                raise OffloadError(
                    f"disable() called while another thread runs {running}; nothing was "
                    "changed: let that forward return (join its thread), then disable",
                    rank=self.rank,
                    block=names[0],
                )
            self.closing = True

    def _drop_stale(self, *, others_only: bool) -> None:
        """Drop the claims whose call ended without its post-hook (the lock is held)."""
        me = threading.get_ident()
        stale = [
            c
            for c in self.claims
            if not (others_only and c.thread == me) and call_ended(c.frame, c.thread)
        ]
        for name in self.names(stale):
            logger.warning(
                "dlo: %s %s ended without its post-forward hook (KeyboardInterrupt or another "
                "BaseException inside it); released",
                "block" if self.what == "block" else "forward of",
                name,
            )
        for c in stale:
            self.claims.remove(c)
            if self.on_stale is not None:
                self.on_stale(c.key)

    def refuse_unsupported(
        self,
        name: str,
        weights: list[torch.Tensor],
        args: tuple,
        kwargs: dict,
    ) -> None:
        """What a managed module's forward cannot do, refused before anything is enqueued
        (see the module docstring); ``weights`` are the module's managed tensors."""
        # torch.compile needs nothing here: the hooks run outside compiled frames ([Note:
        # hooks outside compiled frames] in dlo.hooks.compiled)
        if self.platform.stream_capturing():
            # [Note: CUDA graphs] a graph would replay one step's loads into fixed slots and
            # its waits on events recorded by streams outside the capture; refuse before
            # anything is enqueued, so the capture holds nothing of dlo's
            where, inside = self._where()
            raise OffloadError(
                f"CUDA graph capture around {where} is not supported: capture code inside "
                f"{inside} forward, or disable offload",
                rank=self.rank,
                block=name,
            )
        self._check_inputs(name, weights, args, kwargs)

    def _where(self) -> tuple[str, str]:
        if self.what == "block":
            return "modules whose blocks dlo streams", "the blocks'"
        return "components dlo swaps", "the components'"

    def _check_inputs(
        self, name: str, weights: list[torch.Tensor], args: tuple, kwargs: dict
    ) -> None:
        # read now, not at enable: requires_grad may have been switched on since, and an
        # input may sit in a tuple or dict (only walked when autograd is on at all)
        if torch.is_grad_enabled() and (
            any(t.requires_grad for t in weights)
            or any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in tree_leaves((args, kwargs))
            )
        ):
            raise OffloadError(
                "forward with autograd enabled: dlo is an inference runtime (slots are reused, "
                "so saved weights would be overwritten before backward); run under "
                "torch.no_grad() or torch.inference_mode()",
                rank=self.rank,
                block=name,
            )
        if not self.check_devices:
            return
        want = self.platform.device
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.device != want:
                raise OffloadError(
                    f"input on {t.device} but dlo streams this {self.what} to {want}",
                    rank=self.rank,
                    block=name,
                )


def every_claim(claim: Claim) -> bool:
    """``conflicts`` for a backend that runs one managed module at a time."""
    return True
