"""The disk tier with a codec ([Note: encoded blocks on disk] in dlo.codec.on_disk): blocks
beyond ``host_budget_gb`` are read encoded from the encoded checkpoint at every use, every
piece checked against its checksums at every read, and decoded by the ring's decoder; the
blocks no encoded checkpoint serves yet are encoded into it at enable, one at a time. CPU
platform (the reference codec;
its ratio on random weights says nothing about real ones: only that fewer bytes are read)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.codec.offline import ENCODED_FILE
from dlo.codec.on_disk import EncodedOnDisk
from dlo.host.region import LEDGER
from dlo.models import build_pipeline, make_inputs
from dlo.plan.layout import round_up
from dlo.platform.env import page_size
from tests.cpu.test_codec_offline import (
    DTYPE,
    _Counted,
    _load,
    _ref,
    _rewrite_record,
    _saved,
    ckpt,
)
from tests.harness import assert_all_ok, run_ranks

__all__ = ["ckpt"]  # fixture


def _resident_state() -> dict[str, torch.Tensor]:
    return build_pipeline("tiny", dtype=DTYPE).state_dict()


def _raw_block_nbytes(backend: Any) -> int:
    return sum(b.layout.shard_nbytes for b in backend._blocks)


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_blocks_beyond_the_budget_are_read_encoded_bitwise(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, share: float
) -> None:
    ref = _ref()
    path, n = _saved(ckpt)
    counted = _Counted(monkeypatch)
    _, probe, _ = _load(ckpt)
    raw = _raw_block_nbytes(probe)
    probe.disable()
    counted.names.clear()
    budget = share * raw
    pipe, backend, out = _load(ckpt, host_budget_gb=budget / (1 << 30))
    st = backend.stats()
    on_disk = [b for b in backend._blocks if isinstance(b.encoded, EncodedOnDisk)]
    assert torch.equal(out, ref)
    assert on_disk and st["num_disk_encoded_blocks"] == st["num_disk_blocks"] == len(on_disk)
    assert (len(on_disk) == n) == (share == 0.0)
    disk_encoded = sum(b.encoded.read_nbytes for b in on_disk)
    disk_raw = sum(b.layout.shard_nbytes for b in on_disk)
    assert st["disk_nbytes"] == disk_encoded < disk_raw  # the disk gives the encoded bytes
    assert st["disk_read_nbytes"] >= disk_encoded and st["num_disk_reads"] >= len(on_disk)
    assert st["host_region_nbytes"] <= budget  # the budget holds the kept blocks' encoded bytes
    # no disk block was encoded at enable (it would be held in memory): each is read from the
    # file; the kept ones were read from it once, into the region
    assert not {b.name for b in on_disk} & set(counted.names) and counted.names == []
    # state_dict() serves the raw checkpoint's bytes of a block read encoded
    sd = pipe.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in _resident_state().items())
    # the host's encoded bytes are the kept blocks' only; the disk's are counted apart
    kept = [b.encoded for b in backend._blocks if b.encoded is not None and b not in on_disk]
    assert st["host_encoded_nbytes"] == sum(e.layout.nbytes for e in kept)
    read0 = st["disk_read_nbytes"]
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)
    assert torch.equal(pipe.generate(ids, lat, 2), ref)
    assert backend.stats()["disk_read_nbytes"] > read0  # read again: nothing kept
    backend.disable()
    assert torch.equal(pipe.generate(ids, lat, 2), ref)  # the tensors alias the file again
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    assert path.exists()


@pytest.mark.parametrize("written", [True, False], ids=["file-written", "no-file-yet"])
def test_the_budget_holds_encoded_copies(ckpt: Path, written: bool) -> None:
    """The tiers count what the budget holds: a kept block's encoded copy, not its raw
    bytes. A budget of every block's encoded bytes keeps them all in memory (raw bytes would
    leave some on disk), one byte less leaves one on disk; with no encoded checkpoint yet,
    the enable writes it first and chooses by it too."""
    ref = _ref()
    path, _ = _saved(ckpt)
    _, backend, _ = _load(ckpt, host_budget_gb=0.0)
    coded = [b for b in backend._blocks if b.encoded is not None]
    page = page_size()  # what the host region gives each block
    encoded = sum(round_up(b.encoded.read_nbytes, page) for b in coded)
    raw = sum(round_up(b.layout.shard_nbytes, page) for b in coded)
    backend.disable()
    assert encoded < raw  # the reference codec on random weights: fewer bytes
    for budget, disk in ((encoded, 0), (encoded - 1, 1)):
        if not written:
            path.unlink()
        _, backend, out = _load(ckpt, host_budget_gb=budget / (1 << 30))
        st = backend.stats()
        assert torch.equal(out, ref)
        assert st["host_region_nbytes"] <= budget
        assert (st["num_disk_blocks"] == 0) == (disk == 0), st["num_disk_blocks"]
        backend.disable()
    assert path.exists()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_the_first_budgeted_enable_encodes_the_disk_blocks_into_the_file_once(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No encoded checkpoint yet: the blocks the budget leaves on disk are encoded at enable,
    one at a time, into the encoded checkpoint (a model larger than the host's memory can be
    encoded where it runs), then read from it; a smaller budget later encodes only the
    blocks the file lacks and keeps the others; the blocks kept in memory are written into
    it beside them, so later enables read those too."""
    ref = _ref()
    counted = _Counted(monkeypatch)
    _, probe, _ = _load(ckpt)
    half = 0.5 * _raw_block_nbytes(probe) / (1 << 30)
    probe.disable()
    counted.names.clear()
    path = ckpt.parent / ENCODED_FILE
    assert not path.exists()
    _, backend, out = _load(ckpt, host_budget_gb=half)
    first = {b.name for b in backend._blocks if isinstance(b.encoded, EncodedOnDisk)}
    kept = {b.name for b in backend._blocks if b.encoded is not None} - first
    assert torch.equal(out, ref) and path.exists() and first and kept
    # the disk blocks and the kept ones encoded into the file, each once; the kept ones
    # then read from it into the region
    assert sorted(counted.names) == sorted(first | kept)
    assert backend.stats()["encoded_read_blocks"] == len(kept)
    backend.disable()
    counted.names.clear()
    _, backend, out = _load(ckpt, host_budget_gb=0.0)
    every = {b.name for b in backend._blocks if isinstance(b.encoded, EncodedOnDisk)}
    assert torch.equal(out, ref) and every == first | kept
    assert counted.names == []  # the file serves every block: read, nothing encoded
    backend.disable()
    # a file lacking a block (an entry dropped): only that one is encoded, the rest kept
    lost = sorted(every)[0]
    _rewrite_record(path, lambda record: record["blocks"].pop(lost))
    _, backend, out = _load(ckpt, host_budget_gb=0.0)
    assert torch.equal(out, ref) and counted.names == [lost]
    backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    assert [p.name for p in ckpt.parent.iterdir() if p.name.startswith(".")] == []  # no temp


def test_an_encoded_byte_corrupted_while_serving_fails_the_forward(ckpt: Path) -> None:
    """Every read is checked: a byte changed after a forward read it once (its size and
    modification time put back, so only the checksum can tell) fails the next forward,
    naming the block; nvCOMP would decode it without a word."""
    path, _ = _saved(ckpt)
    pipe, backend, _ = _load(ckpt, host_budget_gb=0.0)  # its forward read every block once
    st = os.stat(path)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x40  # in the last block's encoded bytes
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)
    with pytest.raises(dlo.OffloadError, match="checksum") as e:
        pipe.generate(ids, lat, 2)
    assert "reading from disk failed" in str(e.value)
    backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_save_encoded_under_a_budget_names_the_file_that_holds_the_blocks(ckpt: Path) -> None:
    path, _ = _saved(ckpt)
    _, backend, _ = _load(ckpt, host_budget_gb=0.0)
    with pytest.raises(ValueError, match="holds it already"):
        backend.save_encoded()
    backend.disable()
    assert path.exists()


def _rank_encodes(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    import dlo.backends.layer_codec as layer_codec
    import dlo.backends.layer_codec_disk as layer_codec_disk
    from dlo.pipelines.load import load_pipeline
    from tests.cpu.test_codec_offline import _cfg, _factory

    encoded: list[str] = []
    real = layer_codec_disk.encode_packed

    def counting(*args: Any, **kw: Any) -> Any:
        encoded.append(args[2])
        return real(*args, **kw)

    layer_codec.encode_packed = counting  # type: ignore[assignment]  # into memory
    layer_codec_disk.encode_packed = counting  # type: ignore[assignment]  # into the file
    par = dlo.ParallelConfig(data_parallel_size=world)
    pipe, backend = load_pipeline(_factory(), Path(ckpt_dir), _cfg(host_budget_gb=0.0), par, "cpu")
    assert backend is not None
    ids, lat = make_inputs("tiny", seed=1, dtype=DTYPE)
    out = pipe.generate(ids, lat, 2)
    n = backend.stats()["num_disk_encoded_blocks"]
    backend.disable()
    return {"out": out, "encoded": encoded, "disk": n}


def test_ranks_sharing_the_folder_encode_it_once(ckpt: Path) -> None:
    """Rank-local ranks of one node, the same folder, no encoded checkpoint: one rank
    encodes the disk blocks into the file under the folder's lock, the other reads them."""
    ref = _ref()
    outs = assert_all_ok(run_ranks(_rank_encodes, 2, str(ckpt), timeout_s=300))
    assert all(torch.equal(o["out"], ref) and o["disk"] > 0 for o in outs)
    counts = sorted(len(o["encoded"]) for o in outs)
    assert counts == [0, outs[0]["disk"]], counts
    assert (ckpt.parent / ENCODED_FILE).exists()


def test_a_folder_that_cannot_take_the_file_is_named(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dlo.codec.spool as offline

    def refuse(*args: Any, **kw: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(ckpt.parent))

    monkeypatch.setattr(offline.tempfile, "TemporaryFile", refuse)
    monkeypatch.setattr(offline, "anonymous_file", refuse)
    with pytest.raises(ValueError, match=r"could not be written .*Permission denied"):
        _load(ckpt, host_budget_gb=0.0)
    assert not (ckpt.parent / ENCODED_FILE).exists()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_re_tiering_never_leaves_a_block_no_file_serves_on_disk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chosen again by encoded bytes, the tiers could move a block no encoded checkpoint can
    serve (no file entry: its file was not writable, or its tensors come from no checkpoint)
    from memory to disk, where the enable would then fail: the raw choice is kept instead."""
    import math
    from types import SimpleNamespace

    import dlo.backends.layer_host as layer_host
    from dlo.plan.layers import plan_layers
    from tests.pure.test_host_tiers import _stack

    p = page_size()
    dim = math.isqrt(p)  # blocks of 4 pages
    t = {f"blocks.{i}": [("w", "param", (dim, dim), (dim, 1), torch.float32)] for i in range(4)}
    plan = plan_layers(
        [_stack(codec="ans")], t, host_budget_nbytes=4 * p, chunk_nbytes=1 << 20, num_slots=2
    )
    assert plan.on_disk == {0, 1, 2}  # block 0 resident; of the streamed ones 3 is kept
    blocks = [
        SimpleNamespace(
            index=i,
            name=b.name,
            resident=b.resident,
            layout=b.layout,
            node_shared=False,
            tensors=[],
        )
        for i, b in enumerate(plan.blocks)
    ]
    host = SimpleNamespace(blocks=blocks, _codec=lambda journal: None)
    monkeypatch.setattr(layer_host, "file_nbytes", lambda codec, todo: {1: p, 2: p})
    assert layer_host.LayerHost._tier_encoded(host, plan, None).on_disk == {0, 1, 2}  # type: ignore[arg-type]
    monkeypatch.setattr(layer_host, "file_nbytes", lambda codec, todo: {1: p, 2: p, 3: p})
    assert layer_host.LayerHost._tier_encoded(host, plan, None).on_disk == {0}  # type: ignore[arg-type]


@pytest.mark.parametrize("fits", [True, False], ids=["header-in-its-space", "header-outgrew"])
def test_the_encoded_file_is_written_once_where_the_folder_allows(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, fits: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the folder takes anonymous files, the encoded bytes go straight into the new
    file after the space kept for its header, and the file is linked into place (``linkat``
    through /proc): no second copy on the disk (a Wan2.1-14B folder with 26 GB free could not
    take two). Where the header outgrows that space, the file is copied once more. Either
    file serves the next enable, bitwise."""
    import struct

    import dlo.backends.layer_codec_disk as layer_codec_disk
    import dlo.codec.spool as spool

    copies: list[Path] = []
    real_staged = spool.staged

    def staged() -> Any:
        copies.append(ckpt)
        return real_staged()

    monkeypatch.setattr(spool, "staged", staged)
    if not fits:
        monkeypatch.setattr(layer_codec_disk, "spool_reserve", lambda layouts, old: 8)
    ref = _ref()
    with caplog.at_level("WARNING", logger="dlo.codec.spool"):
        _, backend, out = _load(ckpt, host_budget_gb=0.0)  # writes the file
    assert torch.equal(out, ref)
    backend.disable()
    path = ckpt.parent / ENCODED_FILE
    assert copies == ([] if fits else [ckpt]), caplog.text  # linked, or copied once more
    assert ("copied once more" in caplog.text) != fits
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = f.read(n)
    assert head.rstrip(b" ").endswith(b"}") and (head.endswith(b" ") or not fits)
    _, backend, out = _load(ckpt, host_budget_gb=0.0)  # reads it
    assert torch.equal(out, ref) and backend.stats()["num_disk_encoded_blocks"] > 0
    backend.disable()
    assert [p.name for p in ckpt.parent.iterdir() if p.name.startswith(".")] == []


def test_a_disk_filling_up_while_encoding_names_the_file_and_leaves_nothing(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder's disk fills while the enable encodes into it (as a Wan2.1-14B folder's
    did on an H100): the enable fails naming the file and the reason, no file and no
    temporary file is left, nothing is held, and the model is as it was."""
    import errno

    import dlo.codec.spool as spool

    real = spool.EncodedSpool.add_entry
    calls: list[str] = []

    def full(self: Any, name: str, entry: Any, data: torch.Tensor) -> None:
        calls.append(name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, name, entry, data)

    monkeypatch.setattr(spool.EncodedSpool, "add_entry", full)
    before = set(ckpt.parent.iterdir())
    with pytest.raises(ValueError, match=r"dlo-encoded.safetensors.*No space left on device"):
        _load(ckpt, host_budget_gb=0.0)
    assert set(ckpt.parent.iterdir()) == before  # no file, no temporary file
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    monkeypatch.setattr(spool.EncodedSpool, "add_entry", real)
    _, backend, out = _load(ckpt, host_budget_gb=0.0)  # room again: written, bitwise
    assert torch.equal(out, _ref())
    backend.disable()


def _watch_syncs(monkeypatch: pytest.MonkeyPatch, path: Path) -> list[tuple[str, int, bool]]:
    """Record each ``fdatasync`` and each whole-file ``POSIX_FADV_DONTNEED`` as ``(call,
    inode of the descriptor, whether path existed then)``, in order; both still run."""
    calls: list[tuple[str, int, bool]] = []
    real_sync, real_advise = os.fdatasync, os.posix_fadvise

    def sync(fd: int) -> None:
        calls.append(("sync", os.fstat(fd).st_ino, path.exists()))
        real_sync(fd)

    def advise(fd: int, offset: int, nbytes: int, advice: int) -> None:
        if (offset, nbytes, advice) == (0, 0, os.POSIX_FADV_DONTNEED):
            calls.append(("drop", os.fstat(fd).st_ino, path.exists()))
        real_advise(fd, offset, nbytes, advice)

    monkeypatch.setattr(os, "fdatasync", sync)
    monkeypatch.setattr(os, "posix_fadvise", advise)
    return calls


@pytest.mark.parametrize("fits", [True, False], ids=["linked", "copied"])
def test_the_encoded_file_is_synced_and_dropped_before_it_is_in_place(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, fits: bool
) -> None:
    """The encoded file's bytes are synced to the disk, then dropped from the page cache,
    before it has its name (linked, or copied and renamed): the forwards that follow read it
    with O_DIRECT, which waits for a range's dirty pages to be written back (0.95 GB/s
    against the raw checkpoint's 1.34 GB/s on an H100 after the enable that wrote Wan2.1-14B's
    file unsynced), and a crash leaves no name over bytes not on the disk."""
    import dlo.backends.layer_codec_disk as layer_codec_disk

    if not fits:
        monkeypatch.setattr(layer_codec_disk, "spool_reserve", lambda layouts, old: 8)
    path = ckpt.parent / ENCODED_FILE
    calls = _watch_syncs(monkeypatch, path)
    _, backend, out = _load(ckpt, host_budget_gb=0.0)  # writes the file
    assert torch.equal(out, _ref()) and backend.stats()["num_disk_encoded_blocks"] > 0
    backend.disable()
    ino = path.stat().st_ino
    assert [c for c in calls if c[1] == ino] == [("sync", ino, False), ("drop", ino, False)]


@pytest.mark.parametrize("fits", [True, False], ids=["linked", "copied"])
def test_an_io_error_syncing_the_encoded_file_names_it_and_leaves_nothing(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, fits: bool
) -> None:
    """A sync that fails with EIO (the bytes may not be on the disk) fails the write as a
    full disk does: the enable fails naming the file and the reason, no file and no
    temporary file is left, nothing is held; the next enable writes it."""
    import errno

    import dlo.backends.layer_codec_disk as layer_codec_disk

    if not fits:
        monkeypatch.setattr(layer_codec_disk, "spool_reserve", lambda layouts, old: 8)

    def sync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", sync)
    before = set(ckpt.parent.iterdir())
    with pytest.raises(ValueError, match=r"dlo-encoded.safetensors.*Input/output error"):
        _load(ckpt, host_budget_gb=0.0)
    assert set(ckpt.parent.iterdir()) == before  # no file, no temporary file
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    monkeypatch.undo()
    _, backend, out = _load(ckpt, host_budget_gb=0.0)
    assert torch.equal(out, _ref())
    backend.disable()


def test_a_filesystem_that_cannot_sync_still_takes_the_encoded_file(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A filesystem whose ``fdatasync`` answers EINVAL (it does not sync) takes the file
    unsynced, logged at debug: it serves the forward bitwise."""
    import errno

    def sync(fd: int) -> None:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(os, "fdatasync", sync)
    with caplog.at_level("DEBUG", logger="dlo.io.files"):
        _, backend, out = _load(ckpt, host_budget_gb=0.0)
    assert torch.equal(out, _ref()) and backend.stats()["num_disk_encoded_blocks"] > 0
    backend.disable()
    assert f"{ckpt.parent / ENCODED_FILE} cannot be synced (Invalid argument)" in caplog.text
