"""The functional all-gathers routed through gloo's ``all_gather_into_tensor``
([Note: functional all-gathers over gloo] in :mod:`dlo.runtime.gloo_gather`). On the GPU they
serve CUDA tensors (where torch's own kernel crashes on gloo); here the same kernels are
registered on the CPU key, where they must give what torch's own give, and are taken off
again. The GPU run is the one-GPU lane's context-parallel rows (launch/gpu_suite.sh lanecp)."""

from __future__ import annotations

from typing import Any

import torch

from dlo.runtime.gloo_gather import needs_routing
from tests.harness import assert_all_ok, run_ranks


def _registered_on_cpu() -> bool:
    dump = torch._C._dispatch_dump("_c10d_functional::all_gather_into_tensor")
    return any(line.startswith("CPU:") for line in dump.splitlines())


def _gathers(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from dlo.runtime.gloo_gather import route_gathers, unroute_gathers

    group = dist.group.WORLD
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    y = torch.arange(4, dtype=torch.bfloat16).reshape(1, 2, 2) - rank

    def run() -> list[torch.Tensor]:
        name = group.group_name
        out = torch.empty(2 * world, 3)
        torch.ops._c10d_functional.all_gather_into_tensor_out(x, world, name, out=out)
        pair = funcol.all_gather_tensor(y, 1, group)  # a gather along a later dimension
        return [
            funcol.all_gather_tensor(x, 0, group).wait(),
            out,
            *[
                funcol.wait_tensor(t)
                for t in funcol.all_gather_into_tensor_coalesced([x, y], group)
            ],
            pair.wait() if hasattr(pair, "wait") else pair,
        ]

    before = registered_before = _registered_on_cpu()
    reference = run()
    first = route_gathers("CPU")
    again = route_gathers("CPU")
    routed = _registered_on_cpu()
    got = run()
    unroute_gathers("CPU")
    return {
        "same": all(torch.equal(a, b) for a, b in zip(reference, got, strict=True)),
        "shapes": [tuple(t.shape) for t in got],
        "registered": (before, registered_before, first, again, routed, _registered_on_cpu()),
    }


def test_routed_gathers_match_torchs_own_and_come_off_again() -> None:
    outs = assert_all_ok(run_ranks(_gathers, 2, timeout_s=120))
    for o in outs:
        assert o["same"]
        assert o["shapes"] == [(4, 3), (4, 3), (4, 3), (2, 2, 2), (1, 4, 2)]
        # not registered before, registered once (the second call a no-op), off again after
        assert o["registered"] == (False, False, True, False, True, False)


def test_only_cuda_tensors_over_gloo_are_routed() -> None:
    assert needs_routing(torch.device("cuda", 0), "gloo")
    assert not needs_routing(torch.device("cuda", 0), "nccl")
    assert not needs_routing(torch.device("cpu"), "gloo")
    assert not needs_routing(torch.device("cuda", 0), None)
