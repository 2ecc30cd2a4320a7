"""Call-frame forensics: telling whether a module call ended without its post-hook (a
``KeyboardInterrupt`` inside a block, a worker thread that died in one).

See [Note: calls that ended without post-hooks] below.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import FrameType

from torch import nn

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- call frames
# [Note: calls that ended without post-hooks]
# torch calls ``always_call`` forward hooks when a forward raised an ``Exception``, not for
# other ``BaseException`` (KeyboardInterrupt, SystemExit, GeneratorExit): after Ctrl-C inside
# a block, a backend's "this block is running" marker would stay set forever. A backend keeps,
# with each such marker, the Python frame of the module call (torch's ``_call_impl``) that set
# it (:func:`module_call_frame`). A later call from the same thread whose marker's frame is no
# longer on its own stack (:func:`call_ended`) knows that call ended without its
# post-hook, and releases it as on an error path. A legitimately nested call still has the
# outer frame on its stack. The frame is held (not its id, which Python may reuse: the next
# call of the same block can get the same address) until the call's post-hook runs; after an
# interrupt, until the next forward or disable, so the interrupted call's locals (its
# activations) live that long. A claim whose thread is gone, or whose frame is not on that
# thread's stack, is stale too (:func:`call_ended`).
_CALL_IMPL_CODES = tuple(
    f.__code__
    for f in (
        getattr(nn.Module, "_call_impl", None),
        getattr(nn.Module, "_wrapped_call_impl", None),
    )
    if f is not None and hasattr(f, "__code__")
)


def module_call_frame() -> FrameType | None:
    """The innermost frame of torch's module call on this thread's stack (from a forward
    pre-hook: the call being entered), or None (a call path torch does not use)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if f.f_code in _CALL_IMPL_CODES:
            return f
        f = f.f_back
    return None


def call_ended(frame: FrameType | None, thread: int | None) -> bool:
    """Whether the module call ``frame``, made on ``thread``, ended without its post-hook:
    ``frame`` is no longer on that thread's stack, or the thread is gone (a worker that died
    of ``SystemExit`` inside a forward). False when unknown (no frame recorded)."""
    if frame is None or thread is None:
        return False
    if thread == threading.get_ident():
        return not _in_chain(frame, sys._getframe(1))
    top = sys._current_frames().get(thread)
    return top is None or not _in_chain(frame, top)


def _in_chain(frame: FrameType, top: FrameType | None) -> bool:
    f = top
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False
