"""``host_budget_gb``: blocks beyond the budget stay in their file and are read for every
use, ahead of the ring ([Note: host budget tiers], [Note: disk read-ahead]). Real gloo
process groups (pure data parallelism, each rank its own budget), real files read with
O_DIRECT where the temporary directory allows it; the same staging thread and reader as on
CUDA, ordered on the host here."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import json
import os
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.cli import main
from dlo.errors import OffloadError
from dlo.host.region import LEDGER
from dlo.io.checkpoint import Checkpoint
from dlo.io.direct import DirectFile
from dlo.io.writer import save_checkpoint
from dlo.models import build_pipeline, make_inputs
from dlo.models.presets import Preset
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.load import load_pipeline
from dlo.pipelines.synth import save_folder
from dlo.platform.env import process_peak_rss_bytes
from tests.cpu.test_direct_reads import _takes_direct
from tests.cpu.test_loader import DTYPE, PRESET
from tests.cpu.test_mapped import checkpoint
from tests.harness import assert_all_ok, run_ranks

__all__ = ["checkpoint"]  # fixture

MIB = 1 << 20


def _cfg(**kw: Any) -> dlo.OffloadConfig:
    base: dict[str, Any] = dict(
        mode="layer",
        components=("dit", "encoder"),
        transfer="rank-local",
        chunk_mb=4,
        collective_timeout_s=20.0,
    )
    base.update(kw)
    return dlo.OffloadConfig(**base)


def _skeleton(preset: Preset = PRESET) -> Any:
    return build_pipeline(preset, dtype=DTYPE, device="meta")


def _steps(pipe: Any, ids: torch.Tensor, latents: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    for i in range(3):
        with torch.no_grad() if i % 2 else torch.inference_mode():
            outs.append(pipe.decode(pipe.denoise(latents, pipe.encode(ids), 2)))
    return outs


def _block_nbytes(ckpt: Checkpoint) -> int:
    return sum(e.nbytes for n, e in ckpt.entries.items() if ".blocks." in n or ".layers." in n)


def _budgeted_vs_resident(rank: int, world: int, ckpt_dir: str, share: float) -> dict[str, Any]:
    par = dlo.ParallelConfig(data_parallel_size=world)
    ids, latents = make_inputs(PRESET, seed=rank, dtype=DTYPE)
    resident = build_pipeline(PRESET, dtype=DTYPE)
    refs = _steps(resident, ids, latents)
    state = {k: v.clone() for k, v in resident.state_dict().items()}
    del resident
    checkpoint = Checkpoint(ckpt_dir)
    budget = share * _block_nbytes(checkpoint)
    pipe, backend = load_pipeline(
        _skeleton, checkpoint, _cfg(host_budget_gb=budget / (1 << 30)), par, "cpu"
    )
    assert isinstance(backend, LayerwiseBackend)
    plan = backend.layer_plan
    assert plan is not None
    ledger_enabled = LEDGER.host_nbytes
    outs = _steps(pipe, ids, latents)
    sd = pipe.state_dict()
    st = backend.stats()
    reads = backend._state.host.reads if backend._state.host else None
    backend.disable()
    after = _steps(pipe, ids, latents)  # the blocks alias the file again, as loaded
    ref = weakref.ref(backend)
    del backend
    gc.collect()
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(outs, refs)),
        "bitwise_after_disable": all(torch.equal(a, b) for a, b in zip(after, refs)),
        "state_dict": sorted(sd) == sorted(state)
        and all(torch.equal(sd[k], state[k]) for k in state),
        "stats": st,
        "budget": budget,
        "on_disk": sorted(plan.on_disk),
        "num_blocks": len(plan.blocks),
        "ledger_enabled": ledger_enabled,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
        "collected": ref() is None,
        "reads_closed": reads is not None and reads.files == [],
    }


@pytest.mark.parametrize(("world", "share"), [(1, 0.0), (1, 0.5), (2, 0.3), (3, 0.5)])
def test_blocks_beyond_the_budget_are_read_from_the_file_bitwise(
    world: int, share: float, checkpoint: str
) -> None:
    res = assert_all_ok(run_ranks(_budgeted_vs_resident, world, checkpoint, share, timeout_s=300))
    for r in res:
        st = r["stats"]
        assert r["bitwise"] and r["bitwise_after_disable"] and r["state_dict"], r
        assert r["on_disk"] and st["num_disk_blocks"] == len(r["on_disk"])
        if share == 0.0:
            assert len(r["on_disk"]) == r["num_blocks"] and st["host_region_nbytes"] == 0
        else:
            assert len(r["on_disk"]) < r["num_blocks"]
        # the host copy dlo keeps is within the budget; the rest is read from the file
        assert st["host_region_nbytes"] <= r["budget"]
        assert st["disk_nbytes"] > 0 and st["disk_read_nbytes"] >= st["disk_nbytes"]
        assert st["num_disk_reads"] >= len(r["on_disk"])
        assert st["disk_direct"] == _takes_direct(next(Path(checkpoint).glob("*.safetensors")))
        assert st["read_ahead_buffers"] == 2 and st["num_staging_buffers"] == 0
        assert r["ledger_enabled"] >= 2 * st["read_ahead_buffer_nbytes"]
        assert r["ledger"] == (0, 0) and r["collected"] and r["reads_closed"]


# ----------------------------------------------------------------------------- AllGather
def _gathered_vs_resident(
    rank: int, world: int, ckpt_dir: str, share: float, restore: bool
) -> dict[str, Any]:
    """Each rank keeps and reads only its 1/N of every block; at disable the disk-tier
    blocks alias their file again (a plain disable too: no gather needed), the others are
    gathered back by restore=True."""
    par = dlo.ParallelConfig(data_parallel_size=world)
    ids, latents = make_inputs(PRESET, seed=rank, dtype=DTYPE)
    resident = build_pipeline(PRESET, dtype=DTYPE)
    refs = _steps(resident, ids, latents)
    del resident
    checkpoint = Checkpoint(ckpt_dir)
    budget = share * _block_nbytes(checkpoint) / world  # a rank's share of the blocks
    cfg = _cfg(transfer="allgather", host_budget_gb=budget / (1 << 30), resident_layers=1)
    pipe, backend = load_pipeline(_skeleton, checkpoint, cfg, par, "cpu")
    assert isinstance(backend, LayerwiseBackend) and backend.layer_plan is not None
    outs = _steps(pipe, ids, latents)
    st = backend.stats()
    host = backend._state.host
    assert host is not None
    read = host.reads.read_nbytes if host.reads else 0  # what this rank's files gave
    backend.disable(restore=restore)
    after = _steps(pipe, ids, latents)
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(outs, refs)),
        "bitwise_after_restore": all(torch.equal(a, b) for a, b in zip(after, refs)),
        "stats": st,
        "budget": budget,
        "shards": sum(
            b.layout.shard_nbytes
            for i, b in enumerate(backend.layer_plan.blocks)
            if i in backend.layer_plan.on_disk
        ),
        "largest_shard": max(
            (
                b.layout.shard_nbytes
                for i, b in enumerate(backend.layer_plan.blocks)
                if i in backend.layer_plan.on_disk
            ),
            default=0,
        ),
        "whole_blocks": _block_nbytes(checkpoint),
        "read": read,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.mark.parametrize(("world", "share", "restore"), [(2, 0.5, True), (3, 0.0, False)])
def test_allgather_ranks_read_their_one_nth_of_each_block_bitwise(
    world: int, share: float, restore: bool, checkpoint: str
) -> None:
    res = assert_all_ok(
        run_ranks(_gathered_vs_resident, world, checkpoint, share, restore, timeout_s=300)
    )
    for r in res:
        st = r["stats"]
        # after a plain disable with every block on disk, the model is whole again too
        assert r["bitwise"] and r["bitwise_after_restore"], r
        assert st["group_size"] == world and st["allgather_nbytes"] > 0
        assert st["num_disk_blocks"] > 0 and st["host_region_nbytes"] <= r["budget"]
        # what the tier holds and reads per rank is its shards: 1/N of each block
        assert st["disk_nbytes"] == r["shards"]
        assert 0 < st["host_mapped_nbytes"] <= st["disk_nbytes"]  # the file serves 1/N too
        assert st["read_ahead_buffer_nbytes"] == r["largest_shard"]
        assert st["disk_read_nbytes"] >= st["disk_nbytes"]
        # the bytes this rank's files gave: its shards (with O_DIRECT, the aligned ranges
        # around them), well under the whole blocks they are read from
        passes = st["disk_read_nbytes"] / st["disk_nbytes"]
        assert st["disk_read_nbytes"] <= r["read"] < passes * r["whole_blocks"] / world * 1.5
        assert r["ledger"] == (0, 0)


def _one_rank_cannot_read(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    par = dlo.ParallelConfig(data_parallel_size=world)
    ids, latents = make_inputs(PRESET, seed=rank, dtype=DTYPE)
    cfg = _cfg(transfer="allgather", host_budget_gb=0, collective_timeout_s=8.0)
    pipe, backend = load_pipeline(_skeleton, Checkpoint(ckpt_dir), cfg, par, "cpu")
    assert backend is not None
    pipe.generate(ids, latents, 1)
    t0 = time.monotonic()
    with _reads_fail(".safetensors") if rank == 1 else contextlib.nullcontext():
        try:
            pipe.generate(ids, latents, 1)
            error = None
        except OffloadError as e:
            error = (str(e), e.block)
    waited = time.monotonic() - t0
    backend.disable()
    return {
        "error": error,
        "waited_s": waited,
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


def test_one_ranks_failed_read_under_allgather_is_bounded_on_every_rank(checkpoint: str) -> None:
    """FAULTS.md: the rank whose read failed raises at once naming the file and the block;
    its peer, left in the gather, raises within the collective timeout; both disable with
    nothing left behind."""
    r0, r1 = assert_all_ok(run_ranks(_one_rank_cannot_read, 2, checkpoint, timeout_s=120))
    assert r1["error"] is not None and r1["error"][1] is not None
    assert "Input/output error" in r1["error"][0] and ".safetensors" in r1["error"][0]
    assert r1["waited_s"] < 5
    assert r0["error"] is not None and r0["waited_s"] < 8.0 + 20
    assert r0["ledger"] == r1["ledger"] == (0, 0)


# ----------------------------------------------------------------------------- read-ahead
@contextlib.contextmanager
def _slow_blocks(delay_s: float) -> Iterator[None]:
    """Every block forward of the demo DiT sleeps first (compute longer than a read)."""
    from dlo.models.blocks import DiTBlock

    forward = DiTBlock.forward

    def slow(self: Any, *args: Any, **kw: Any) -> Any:
        time.sleep(delay_s)
        return forward(self, *args, **kw)

    DiTBlock.forward = slow  # type: ignore[method-assign]
    try:
        yield
    finally:
        DiTBlock.forward = forward  # type: ignore[method-assign]


def test_reads_run_ahead_of_the_loads_while_blocks_compute(checkpoint: str) -> None:
    ids, latents = make_inputs(PRESET, seed=0, dtype=DTYPE)
    cfg = _cfg(components=("dit",), host_budget_gb=0, num_slots=2)
    with _slow_blocks(0.15):  # patched before dlo's hooks wrap the forwards
        pipe, backend = load_pipeline(_skeleton, checkpoint, cfg, None, "cpu")
        assert backend is not None
        with torch.inference_mode():
            pipe.denoise(latents, pipe.encode(ids), 4)
        st = backend.stats()
        backend.disable()
    # 12 block runs; the first forward learns the order (its blocks may wait for their
    # read), then every read is done before its copy is due
    assert st["num_loads"] >= 12 and st["num_disk_reads"] >= 12
    assert st["num_read_ahead_waits"] <= 3, st
    assert st["num_wasted_disk_reads"] == 0


# ----------------------------------------------------------------------------- faults
@contextlib.contextmanager
def _reads_fail(path_part: str) -> Iterator[None]:
    """Every read of a file whose path holds ``path_part`` fails with EIO (a disk gone)."""
    real_direct, real_buffered = DirectFile._read_direct, DirectFile._read_buffered

    def broken(real: Any) -> Any:
        def read(self: DirectFile, fd: int, offset: int, out: memoryview) -> None:
            if path_part in str(self.path):
                raise OSError(errno.EIO, "Input/output error")
            real(self, fd, offset, out)

        return read

    DirectFile._read_direct = broken(real_direct)  # type: ignore[method-assign]
    DirectFile._read_buffered = broken(real_buffered)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DirectFile._read_direct = real_direct  # type: ignore[method-assign]
        DirectFile._read_buffered = real_buffered  # type: ignore[method-assign]


def test_a_read_error_fails_the_forward_naming_the_block_and_the_file(checkpoint: str) -> None:
    ids, latents = make_inputs(PRESET, seed=0, dtype=DTYPE)
    ref = build_pipeline(PRESET, dtype=DTYPE).generate(ids, latents, 2)
    pipe, backend = load_pipeline(_skeleton, checkpoint, _cfg(host_budget_gb=0), None, "cpu")
    assert backend is not None
    with _reads_fail(".safetensors"), pytest.raises(OffloadError, match="Input/output") as e:
        pipe.generate(ids, latents, 2)
    assert e.value.block is not None and ".safetensors" in str(e.value)
    assert torch.equal(pipe.generate(ids, latents, 2), ref)  # the next forward reads again
    backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_a_file_truncated_while_serving_fails_the_forward_and_the_disable_names_the_block(
    tmp_path: Path,
) -> None:
    path = save_checkpoint(build_pipeline(PRESET, dtype=DTYPE), tmp_path, max_shard_nbytes=12 << 20)
    ids, latents = make_inputs(PRESET, seed=0, dtype=DTYPE)
    pipe, backend = load_pipeline(_skeleton, str(path.parent), _cfg(host_budget_gb=0), None, "cpu")
    assert backend is not None
    pipe.generate(ids, latents, 1)
    files = sorted(path.parent.glob("*.safetensors"))
    for f in files:
        os.truncate(f, os.path.getsize(f) // 2)
    with pytest.raises(OffloadError, match="changed while dlo reads blocks") as e:
        pipe.generate(ids, latents, 1)
    assert e.value.block is not None and any(str(f) in str(e.value) for f in files)
    with pytest.raises(OffloadError, match="disable could not restore block"):
        backend.disable()
    assert not backend.is_enabled() and (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


# ----------------------------------------------------------------------------- memory
RSS_PRESET = dataclasses.replace(PRESET, name="disk-rss", num_blocks=24)


def _rss_reference(rank: int, world: int, ckpt_dir: str) -> list[torch.Tensor]:
    save = build_pipeline(RSS_PRESET, dtype=DTYPE)
    save_checkpoint(save, ckpt_dir, max_shard_nbytes=64 << 20)
    ids, latents = make_inputs(RSS_PRESET, seed=0, dtype=DTYPE)
    return _steps(save, ids, latents)


def _rss_budgeted(
    rank: int, world: int, ckpt_dir: str, budget_mib: int, codec: str = "none"
) -> dict[str, Any]:
    ids, latents = make_inputs(RSS_PRESET, seed=0, dtype=DTYPE)
    gc.collect()
    base = process_peak_rss_bytes()
    cfg = _cfg(components=("dit",), host_budget_gb=budget_mib / 1024, codec=codec)
    pipe, backend = load_pipeline(lambda: _skeleton(RSS_PRESET), ckpt_dir, cfg, None, "cpu")
    assert backend is not None
    outs = _steps(pipe, ids, latents)
    peak = process_peak_rss_bytes()
    st = backend.stats()
    non_block = sum(
        t.numel() * t.element_size() for n, t in pipe.state_dict().items() if ".blocks." not in n
    )
    backend.disable()
    return {"outs": outs, "growth": peak - base, "stats": st, "non_block": non_block}


@pytest.mark.parametrize("codec", ["none", "ans"])
def test_peak_rss_stays_within_the_budget_plus_staging(tmp_path: Path, codec: str) -> None:
    """With ``codec="ans"`` the enable first encodes every disk block into the encoded
    checkpoint (none exists): one block at a time, so the bound gains a few blocks only
    ([Note: encoded blocks on disk])."""
    (refs,) = assert_all_ok(run_ranks(_rss_reference, 1, str(tmp_path), timeout_s=300))
    budget_mib = 48
    run = run_ranks(_rss_budgeted, 1, str(tmp_path), budget_mib, codec, timeout_s=300)
    (r,) = assert_all_ok(run)
    st = r["stats"]
    assert all(torch.equal(a, b) for a, b in zip(r["outs"], refs))
    blocks = st["disk_nbytes"] + st["host_region_nbytes"]
    assert st["host_region_nbytes"] <= budget_mib * MIB and st["disk_nbytes"] > blocks // 2
    staging = st["read_ahead_buffers"] * st["read_ahead_buffer_nbytes"]
    staging += st["device_slot_nbytes"]  # the "device" is this host's memory here
    # the O_DIRECT scratch buffers: the fill's readers (at most 16) and the read-ahead thread
    scratch = 17 * (2 * MIB + 4096)
    slack = 48 * MIB  # activations, allocator and interpreter growth
    if codec != "none":  # encoding: two raw bounces, the block's pieces, its encoded copy
        assert st["num_disk_encoded_blocks"] == st["num_disk_blocks"] > 0
        slack += 4 * st["read_ahead_buffer_nbytes"]
    bound = budget_mib * MIB + staging + r["non_block"] + scratch + slack
    # the whole DiT's blocks would not fit it: the budget is what bounds the footprint
    assert blocks > bound - slack
    assert r["growth"] <= bound, (r["growth"] / MIB, bound / MIB, blocks / MIB)


# ----------------------------------------------------------------------------- folders, CLI
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan2.1"])
def test_a_pipeline_folder_under_a_host_budget_is_bitwise(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / name
    save_folder(FOLDERS[name], folder, max_shard_size=40_000)
    call: list[str] = []
    names = {"guidance_scale": "--guidance", "num_frames": "--frames"}
    for k, v in FOLDERS[name].call.items():
        call += [names.get(k, "--" + k.replace("_", "-")), str(v)]
    argv = ["run", "--pipeline", str(folder), "--steps", "2", "--check", "--json"]
    argv += ["--device", "cpu", "--dtype", "float32", *call, "--host-budget-gb", "0.00005"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    (r,) = json.loads(out[out.index("[") :])
    assert r["parity"] is True and r["num_disk_blocks"] > 0 and r["disk_read_nbytes"] > 0, r
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_cli_host_budget_needs_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    assert main(["save-checkpoint", "--preset", "tiny", "--out", str(ckpt)]) == 0
    argv = ["run", "--steps", "2", "--check", "--json", "--device", "cpu", "--chunk-mb", "1"]
    argv += ["--resident-layers", "0", "--host-budget-gb", "0.0003"]
    capsys.readouterr()
    assert main([*argv, "--checkpoint", str(ckpt), "--explain"]) == 0
    captured = capsys.readouterr()
    (r,) = json.loads(captured.out)
    assert r["parity"] is True and r["num_disk_blocks"] > 0
    # --explain: the disk tier's model (on stderr with --json)
    assert f"dlo disk tier: {r['num_disk_blocks']} blocks" in captured.err
    assert "measured at enable" in captured.err
    assert main(argv) == 2
    assert "--host-budget-gb leaves blocks in the checkpoint file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "error"), [(-1.0, ValueError), (float("nan"), ValueError), ("8", TypeError)]
)
def test_the_config_field_is_checked(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="host_budget_gb"):
        dlo.OffloadConfig(mode="layer", host_budget_gb=value)
    assert dlo.OffloadConfig(mode="layer", host_budget_gb=0).host_budget_nbytes == 0
    with pytest.raises(ValueError, match="host_budget_gb=8 applies to mode='layer' only"):
        dlo.OffloadConfig(mode="module", host_budget_gb=8)


def test_a_model_not_loaded_from_a_file_is_refused_naming_the_field() -> None:
    pipe = build_pipeline(PRESET, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"host_budget_gb leaves .* not in one"):
        dlo.enable_offload(pipe, _cfg(host_budget_gb=0), device="cpu")
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    ids, latents = make_inputs(PRESET, seed=0, dtype=DTYPE)
    assert torch.isfinite(pipe.generate(ids, latents, 1)).all()  # rolled back, whole
