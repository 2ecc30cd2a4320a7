"""Ranks that exchange blocks must hold the same weights (issue 39 item 1): the startup
agreement compares each exchanged block's content fingerprint ([Note: weight fingerprints]
in dlo.host.fingerprint), so two copies of one architecture with different weights are
refused on every rank instead of mixed into every rank's blocks. Real gloo ranks."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.host import fingerprint
from dlo.host.region import LEDGER
from dlo.io.checkpoint import Checkpoint
from dlo.io.sources import register_mapping
from dlo.io.writer import save_checkpoint
from dlo.models import build_pipeline
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder
from dlo.platform.device import CpuPlatform
from tests.cpu.test_dlo import _cfg, _par, _steps
from tests.harness import assert_all_ok, run_rank_processes, run_ranks
from tests.toys import ToyDiT, assert_same, clone, snapshot

TRANSFERS = ["allgather", "node-shared"]


def _message(e: BaseException) -> str:
    """The message without its ``[dlo rank N]`` prefix (equal on every rank)."""
    return str(e).split("]", 1)[1]


def _assert_refused_everywhere(res: list[dict[str, Any]]) -> str:
    """Every rank raised the weights refusal, the same message, and holds nothing."""
    assert [r["error_type"] for r in res] == ["WeightsDifferError"] * len(res), res
    assert len({r["message"] for r in res}) == 1, [r["message"] for r in res]
    assert all(r["ledger"] == (0, 0) for r in res), res
    return str(res[0]["message"])


# ----------------------------------------------------------------------------- in memory
def _in_memory(rank: int, world: int, transfer: str, changed: bool) -> dict[str, Any]:
    model = ToyDiT(5)
    if changed and rank == 1:  # one tensor of one block, on one rank
        lin = model.blocks[3].lin
        assert isinstance(lin, torch.nn.Linear)
        lin.weight.data = lin.weight.data * 1.01
    ref = _steps(clone(model), rank, 2)
    before = snapshot(model)
    backend = LayerwiseBackend(_cfg(transfer=transfer), _par(world), CpuPlatform())
    try:
        backend.enable(model)
    except dlo.OffloadError as e:
        assert_same(before, model)  # nothing changed, nothing held
        try:
            backend.enable(model)
            again = "re-enable allowed"
        except dlo.BackendPoisonedError as e2:
            again = str(e2)
        return {
            "error_type": type(e).__name__,
            "value_error": isinstance(e, ValueError),
            "message": _message(e),
            "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
            "again": again,
        }
    same = all(torch.equal(a, b) for a, b in zip(ref, _steps(model, rank, 2)))
    backend.disable()
    return {"error_type": None, "same": same, "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes)}


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("world", [2, 3])
def test_one_tensor_changed_on_one_rank_is_refused_on_every_rank(world: int, transfer: str) -> None:
    res = assert_all_ok(run_ranks(_in_memory, world, transfer, True, timeout_s=120))
    msg = _assert_refused_everywhere(res)
    others = [0, 2] if world == 3 else [0]
    assert f"block 'blocks.3' differs between ranks {others} and [1]" in msg, msg
    assert "rank 0: in-memory model (sampled); rank 1: in-memory model (sampled)" in msg
    assert all(r["value_error"] and "recreate the worker" in r["again"] for r in res)


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_the_same_in_memory_model_everywhere_still_enables_bitwise(transfer: str) -> None:
    res = assert_all_ok(run_ranks(_in_memory, 2, transfer, False, timeout_s=120))
    assert all(r["error_type"] is None and r["same"] and r["ledger"] == (0, 0) for r in res)


# ----------------------------------------------------------------------------- pipeline folders
@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``dlo save-pipeline --like tiny-flux`` with seeds 0 and 1 (no dlo checksums: the
    blocks are sampled from the files)."""
    root = tmp_path_factory.mktemp("weights")
    return [str(save_folder(FOLDERS["tiny-flux"], root / f"seed{s}", seed=s)) for s in (0, 1)]


def _flux_call(pipe: Any) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    call: dict[str, Any] = {**FOLDERS["tiny-flux"].call, "output_type": "pt"}
    call.update(prompt="a red fox", num_inference_steps=2)
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images  # type: ignore[no-any-return]


def _load_folder(
    rank: int, world: int, paths: list[str], transfer: str, write: bool = False
) -> dict[str, Any]:
    """Rank ``r`` loads ``paths[r]``; ``write``: rank 1 scales one block weight in place
    between load and enable (a write through ``.data`` into the file's mapping, as a fused
    LoRA does)."""
    from dlo.commands.pipeline_calls import resident_reference

    cfg = _cfg(transfer=transfer)

    def prepare(p: Any) -> None:
        if write and rank == 1:
            p.transformer.transformer_blocks[0].attn.to_q.weight.data.mul_(1.01)

    try:
        pipe, backend = dlo.load_pipeline(
            paths[rank], cfg, parallel=_par(world), device="cpu", prepare=prepare
        )
    except dlo.OffloadError as e:
        return {
            "error_type": type(e).__name__,
            "message": _message(e),
            "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
        }
    assert backend is not None
    ref = resident_reference(paths[rank], torch.float32, torch.device("cpu"))
    same = torch.equal(_flux_call(pipe), _flux_call(ref))
    backend.disable()
    return {"error_type": None, "same": same}


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("world", [2, 3])
def test_folders_of_different_seeds_are_refused_naming_each_ranks_file(
    folders: list[str], world: int, transfer: str
) -> None:
    paths = [folders[r % 2] for r in range(world)]
    res = assert_all_ok(run_ranks(_load_folder, world, paths, transfer, timeout_s=240))
    msg = _assert_refused_everywhere(res)
    assert "differs between ranks" in msg and "transformer_blocks.0'" in msg, msg
    for r in range(world):
        assert f"rank {r}: {paths[r]}/transformer/" in msg, msg
    assert "(sampled)" in msg


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_the_same_folder_everywhere_still_loads_bitwise(folders: list[str], transfer: str) -> None:
    res = assert_all_ok(run_ranks(_load_folder, 2, [folders[0]] * 2, transfer, timeout_s=240))
    assert all(r["error_type"] is None and r["same"] for r in res), res


def test_a_weight_written_in_place_on_one_rank_before_enable_is_refused(
    folders: list[str],
) -> None:
    """The file's pages a write copied are memory of the rank's own: sampled from there."""
    res = assert_all_ok(
        run_ranks(_load_folder, 2, [folders[0]] * 2, "allgather", True, timeout_s=240)
    )
    msg = _assert_refused_everywhere(res)
    assert "transformer.transformer_blocks.0'" in msg and "in-memory tensor(s)" in msg, msg


# ----------------------------------------------------------------------------- dlo checkpoints
def _load_checkpoint(rank: int, world: int, paths: list[str]) -> dict[str, Any]:
    factory = functools.partial(build_pipeline, "tiny", dtype=torch.float32, device="meta")
    ckpt = Checkpoint(paths[rank])
    try:
        dlo.load_pipeline(factory, ckpt, _cfg(), _par(world), "cpu")
    except dlo.OffloadError as e:
        return {
            "error_type": type(e).__name__,
            "message": _message(e),
            "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
        }
    return {"error_type": None}


def test_dlo_checkpoints_of_different_seeds_are_refused_by_their_checksums(
    tmp_path: Path,
) -> None:
    """``dlo save-checkpoint`` files carry checksums: the fingerprints read nothing."""
    paths = [
        str(save_checkpoint(build_pipeline("tiny", dtype=torch.float32, seed=s), tmp_path / str(s)))
        for s in (0, 1)
    ]
    res = assert_all_ok(run_ranks(_load_checkpoint, 2, paths, timeout_s=180))
    msg = _assert_refused_everywhere(res)
    # the non-persistent buffers are computed, not read: sampled from memory
    for r in (0, 1):
        assert f"rank {r}: {paths[r]} and 1 in-memory tensor(s) (dlo checksums and sampled)" in msg


# ----------------------------------------------------------------------------- the CLI
def test_dlo_run_pipeline_with_another_folder_on_one_rank_is_one_error_line(
    folders: list[str], tmp_path: Path
) -> None:
    """Two ``dlo run --pipeline`` processes of one job (torchrun's variables set by hand,
    so each rank names its own folder): both exit 2 with one ``dlo: error:`` line naming
    both folders."""
    call = {"guidance_scale": "--guidance"}
    flags = [
        x
        for k, v in FOLDERS["tiny-flux"].call.items()
        for x in (call.get(k, "--" + k.replace("_", "-")), str(v))
    ]

    def argv(rank: int) -> list[str]:
        out = [sys.executable, "-m", "dlo", "run", "--pipeline", folders[rank], "--steps", "1"]
        out += ["--device", "cpu", "--dtype", "float32", "--transfer", "allgather"]
        return [*out, "--output", str(tmp_path / f"out{rank}.png"), *flags]

    outs = [(rc, err) for rc, _, err in run_rank_processes(argv, 2)]
    for rc, err in outs:
        lines = [line for line in err.splitlines() if line.startswith("dlo: error:")]
        assert rc == 2 and len(lines) == 1, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert folders[0] in lines[0] and folders[1] in lines[0], lines[0]


# ----------------------------------------------------------------------------- the sample
def test_sample_windows_cover_small_tensors_whole_and_spread_over_large_ones() -> None:
    whole = fingerprint.SAMPLE_WINDOWS * fingerprint.SAMPLE_WINDOW_NBYTES
    assert fingerprint.sample_windows(0) == []
    assert fingerprint.sample_windows(whole) == [(0, whole)]
    n = 10 * whole + 3
    windows = fingerprint.sample_windows(n)
    assert len(windows) == fingerprint.SAMPLE_WINDOWS
    assert windows[0][0] == 0 and windows[-1][1] == n  # the first and the last bytes
    assert all(b - a == fingerprint.SAMPLE_WINDOW_NBYTES for a, b in windows)
    assert all(windows[i][1] <= windows[i + 1][0] for i in range(len(windows) - 1))


def _digest(t: torch.Tensor) -> bytes:
    return fingerprint.tensor_print(t)[1]


def test_what_a_sample_sees_and_what_it_misses() -> None:
    t = torch.randn(64, 1024)  # 256 KiB: eight 4 KiB windows
    base = _digest(t)
    assert _digest(t.clone()) == base
    assert _digest(torch.randn(64, 1024)) != base  # another seed
    assert _digest(t + 1e-3 * torch.randn(64, 1)) != base  # fine-tuned: most bytes change
    first, second = fingerprint.sample_windows(t.numel() * 4)[:2]
    edited = t.clone()
    edited.view(-1)[first[1] // 4] += 1.0  # one element between the first two windows
    assert _digest(edited) == base  # missed: documented in [Note: weight fingerprints]
    edited.view(-1)[second[0] // 4] += 1.0  # one element inside a window
    assert _digest(edited) != base
    # the bytes a tensor addresses, as packed: a transposed view samples the same span (the
    # manifest, which holds strides, tells the two apart before fingerprints are compared)
    assert _digest(t.t()) == base


def test_a_file_tensor_is_fingerprinted_from_its_checksums_or_sampled_from_the_file(
    tmp_path: Path,
) -> None:
    tensors = {"w": torch.randn(64, 1024), "b": torch.randn(16)}
    dlo_file = save_checkpoint(torch.nn.ParameterDict(tensors), tmp_path / "dlo")
    plain = tmp_path / "plain.safetensors"
    save_file(tensors, str(plain))
    kinds = {}
    for path in (dlo_file, plain):
        ckpt = Checkpoint(path)
        mapped = ckpt.tensor("w")
        register_mapping(mapped, ckpt, "w")
        kind, digest, file = fingerprint.tensor_print(mapped)
        assert file == str(path)
        kinds[kind] = (digest, ckpt.read_nbytes)
    assert kinds["checksums"][1] == 0  # free: the header held them
    # read from the file with pread, the same digest as the same bytes in memory
    assert kinds["sample"] == (_digest(tensors["w"]), 8 * fingerprint.SAMPLE_WINDOW_NBYTES)
