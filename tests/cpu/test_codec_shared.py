"""``codec="ans"`` with ``transfer="node-shared"`` (issue 22): the sharers of a node each encode
the blocks they pack, exchange the piece tables and hold one encoded copy per node (see
[Note: node-shared host copy] in dlo.host.node_share). Real gloo ranks on the CPU platform
(the reference codec)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
import dlo.backends.layer_codec as layer_codec
from dlo import faults
from dlo.backends.layerwise import LayerwiseBackend
from dlo.host.region import LEDGER
from dlo.platform.device import CpuPlatform
from dlo.platform.env import page_size
from tests.cpu.test_codec import Fp8DiT
from tests.harness import assert_all_ok, run_ranks
from tests.toys import assert_same, clone, snapshot


def _backend(world: int, resident: int = 0) -> LayerwiseBackend:
    cfg = dlo.OffloadConfig(
        mode="layer",
        transfer="node-shared",
        codec="ans",
        resident_layers=resident,
        collective_timeout_s=20.0,
    )
    return LayerwiseBackend(cfg, dlo.ParallelConfig(data_parallel_size=world), CpuPlatform())


def _xs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(2, 5, 16, generator=g) for _ in range(3)]


def _shared(rank: int, world: int, resident: int) -> dict[str, Any]:
    encoded: list[str] = []
    real = layer_codec.encode_packed

    def encode_packed(*args: Any, **kw: Any) -> Any:
        encoded.append(args[2])  # (platform, codec, name, ...)
        return real(*args, **kw)

    layer_codec.encode_packed = encode_packed  # type: ignore[assignment]
    model = Fp8DiT(5)  # bf16 weights, fp32 norms, fp8 weights with fp32 scales
    ref = clone(model)
    with torch.no_grad():
        want = [ref(x) for x in _xs(rank)]
    want_sd = {k: v.clone() for k, v in model.state_dict().items()}
    before = snapshot(model)
    b = _backend(world, resident)
    b.enable(model)
    with torch.no_grad():
        got = [model(x) for x in _xs(rank)]
    sd = model.state_dict()
    st = b.stats()
    blocks = [
        (blk.name, blk.encoded.layout.nbytes, blk.encoded.layout.raw_nbytes)
        for blk in b._state.host.blocks  # type: ignore[attr-defined]
        if blk.encoded is not None
    ]
    b.disable()
    assert_same(before, model)
    return {
        "same": all(torch.equal(a, c) for a, c in zip(want, got)),
        "state_dict": all(torch.equal(sd[k], v) for k, v in want_sd.items()),
        "stats": st,
        "blocks": blocks,
        "encoded": encoded,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.mark.parametrize(("world", "resident"), [(1, 0), (2, 1), (3, 0), (4, 0)])
def test_one_encoded_copy_per_node_each_sharer_encodes_its_share(
    tmp_path: Path, world: int, resident: int
) -> None:
    res = assert_all_ok(
        run_ranks(_shared, world, resident, timeout_s=120, env={"DLO_SHM_DIR": str(tmp_path)})
    )
    names = [n for n, _, _ in res[0]["blocks"]]
    assert len(names) == 5  # every block encoded, resident ones too
    for rank, r in enumerate(res):
        st = r["stats"]
        assert r["same"] and r["state_dict"] and r["ledger"] == (0, 0), rank
        assert r["blocks"] == res[0]["blocks"]  # every rank reads the same tables
        assert st["transfer"] == "node-shared" and st["host_share_ranks"] == world
        assert st["codec"] == "ans" and st["host_region_nbytes"] == 0
        enc = sum(n for _, n, _ in r["blocks"])
        raw = sum(n for _, _, n in r["blocks"])
        assert st["host_encoded_nbytes"] == enc < raw == st["host_encoded_raw_nbytes"]
        # one encoded copy for the node, each sharer charged 1/L of it
        assert st["host_nbytes"] == sum(-(-n // world) for _, n, _ in r["blocks"])
        page = page_size()
        header = -(-world * 64 // page) * page  # one mark per sharer, its own pages
        assert st["host_shared_nbytes"] == header + sum(
            -(-n // page) * page for _, n, _ in r["blocks"]
        )
        assert st["decoded_nbytes"] > 0 and st["encoded_h2d_nbytes"] < st["decoded_nbytes"]
        assert r["encoded"] == names[rank::world], (rank, r["encoded"])
    assert os.listdir(tmp_path) == []


def _failure(rank: int, world: int, how: str) -> dict[str, Any]:
    if how == "malformed" and rank == 1:  # rank 1 sends a table that lies outside its bytes
        real = layer_codec.HostCodec.layout

        def layout(self: Any, index: int) -> Any:
            enc = real(self, index)
            p = dataclasses.replace(enc.pieces[-1], offset=enc.pieces[-1].offset + 4096)
            return dataclasses.replace(enc, pieces=(*enc.pieces[:-1], p))

        layer_codec.HostCodec.layout = layout  # type: ignore[method-assign]
    model = Fp8DiT(4)
    before = snapshot(model)
    b = _backend(world)
    try:
        if how == "encode" and rank == 1:
            with faults.inject("encode"):
                b.enable(model)
        else:
            b.enable(model)
    except dlo.OffloadError as e:
        msg = str(e).split("]", 1)[1]
    else:
        return {"msg": "enabled"}
    assert_same(before, model)
    return {"msg": msg, "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes)}


@pytest.mark.parametrize("how", ["encode", "malformed"])
def test_an_encode_failure_or_a_malformed_table_fails_every_sharer_alike(
    tmp_path: Path, how: str
) -> None:
    res = assert_all_ok(
        run_ranks(_failure, 3, how, timeout_s=120, env={"DLO_SHM_DIR": str(tmp_path)})
    )
    assert len({r["msg"] for r in res}) == 1, res
    msg = res[0]["msg"]
    if how == "encode":
        assert "node-shared host copy failed on rank(s) [1]" in msg and "encode" in msg, msg
    else:
        assert "a malformed piece table (sent by rank 1): piece 0 lies at 4096" in msg, msg
    assert all(r["ledger"] == (0, 0) for r in res)
    assert os.listdir(tmp_path) == []
