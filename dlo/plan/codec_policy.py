"""``codec="auto"``: which stacks the policy encodes (see [Note: block codecs] in
:mod:`dlo.codec.codecs`; the rest of the policy is :mod:`dlo.plan.policy`)."""

from __future__ import annotations

import dataclasses

from dlo.plan.policy_explain import kept
from dlo.plan.policy_model import (
    CODEC_TRANSFER_BOUND,
    PolicyInput,
    StackChoice,
    StackSpec,
    padded_nbytes,
)


def choose_codec(s: StackSpec, c: StackChoice, inp: PolicyInput) -> StackChoice:
    """``codec="auto"``: the encoded copy shortens the step where this rank's host-to-device
    copy, not the compute nor a gather of raw bytes, bounds it (the decode runs on its own
    stream behind the next piece's copy; ``block_compute_ms`` is a DiT block's)."""
    t_c, m, n = inp.block_compute_s, inp.measured, max(1, len(s.block_nbytes))
    g, chunk = c.group_size, inp.chunk_nbytes
    h2d_ms = sum(padded_nbytes(b, g, chunk) / g for b in s.block_nbytes) / m.h2d_bps / n * 1e3
    ag_bps = m.allgather_bps.get(c.group_axis) if g > 1 else None
    gather_ms = (
        sum(padded_nbytes(b, g, chunk) for b in s.block_nbytes) / ag_bps / n * 1e3
        if ag_bps
        else 0.0
    )
    if s.codec != "auto":
        codec, why = s.codec, kept("codec", inp)
    elif inp.host_backing == "mapped":
        codec, why = "none", "auto: the mapped backing streams the checkpoint's own bytes"
    elif inp.host_budget:
        codec, why = "none", "auto: host_budget_gb streams the file's own bytes"
    elif not m.codec_available:
        codec, why = "none", "auto: no codec on this platform (nvCOMP is not installed)"
    elif s.component != "dit" or t_c is None:
        codec, why = "none", "auto: no compute time for this stack (block_compute_ms: DiT)"
    elif t_c * 1e3 < CODEC_TRANSFER_BOUND * h2d_ms and gather_ms < h2d_ms:
        codec, why = (
            "ans",
            (
                f"auto: the copy ({h2d_ms:.3f} ms per block) outlasts the compute "
                f"({t_c * 1e3:.3f} ms): fewer bytes shorten the step"
            ),
        )
    else:
        codec, why = (
            "none",
            (
                f"auto: the copy ({h2d_ms:.3f} ms per block) is hidden by the compute "
                f"({t_c * 1e3:.3f} ms) or the gather ({gather_ms:.3f} ms): a decode would only "
                "add to the step"
            ),
        )
    return dataclasses.replace(c, codec=codec, codec_reason=why)
