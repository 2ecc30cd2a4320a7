"""Reads around the page cache ([Note: reads around the page cache]): O_DIRECT at any
offset and length, the buffered fallback, a file changed or truncated while it serves."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import torch

from dlo.io import direct
from dlo.io.direct import DIRECT_ALIGN, DirectFile, DirectReads, read_bandwidth
from dlo.io.header_checks import CheckpointError


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(3 * direct.SCRATCH_NBYTES + 12345)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    return path, data


def _takes_direct(path: Path) -> bool:
    """Whether ``path``'s filesystem opens files with O_DIRECT (tmpfs does not)."""
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return False
    return bool(getattr(os, "O_DIRECT", 0))


RANGES = [
    (0, 1),
    (1, 4095),
    (4095, 2),
    (DIRECT_ALIGN, DIRECT_ALIGN),
    (12345, direct.SCRATCH_NBYTES + 777),  # crosses a scratch piece
    (3 * direct.SCRATCH_NBYTES, 12345),  # up to the end of the file
]


@pytest.mark.parametrize("use_direct", [True, False])
@pytest.mark.parametrize(("offset", "n"), RANGES)
def test_any_range_reads_the_files_bytes(
    data_file: tuple[Path, bytes], use_direct: bool, offset: int, n: int
) -> None:
    path, data = data_file
    f = DirectFile(path, direct=use_direct)
    try:
        assert f.direct == (use_direct and _takes_direct(path))
        out = bytearray(n)
        f.read_into(offset, memoryview(out))
        assert bytes(out) == data[offset : offset + n]
        assert f.read_nbytes >= n
    finally:
        f.close()


def test_the_page_cache_is_dropped_behind_buffered_reads(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, n: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            calls.append((offset, n))
        real(fd, offset, n, advice)

    f = DirectFile(path, direct=False)
    os.posix_fadvise = spy  # type: ignore[assignment]
    try:
        f.read_into(100, memoryview(bytearray(5000)))
    finally:
        os.posix_fadvise = real  # type: ignore[assignment]
        f.close()
    assert calls == [(100, 5000)]


def test_a_filesystem_that_refuses_direct_reads_falls_back_to_buffered(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every thread that meets the refusal retries buffered: the fallback happens once, and
    no read fails or reads through a closed descriptor."""
    from concurrent.futures import ThreadPoolExecutor

    path, data = data_file
    f = DirectFile(path)
    assert f.direct == _takes_direct(path)  # where the open refused it, reads are buffered
    first = f._fds[0]
    real = os.preadv
    refused: list[int] = []

    def preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        if fd == first and f._fds and _takes_direct(path):
            refused.append(offset)
            time.sleep(0.01)  # the threads meet the refusal together
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    ranges = [(7 + 100_003 * k, 9000 + k) for k in range(8)]
    outs = [bytearray(n) for _, n in ranges]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: f.read_into(ranges[k][0], memoryview(outs[k])), range(8)))
    assert all(bytes(o) == data[a : a + n] for o, (a, n) in zip(outs, ranges))
    assert not f.direct and bool(refused) == _takes_direct(path)
    assert len(f._fds) == (2 if _takes_direct(path) else 1)  # one fallback, first fd kept
    f.close()


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_a_file_changed_while_serving_fails_the_read_naming_it(
    data_file: tuple[Path, bytes], change: str
) -> None:
    path, _ = data_file
    f = DirectFile(path)
    f.read_into(0, memoryview(bytearray(10)))
    if change == "truncated":
        os.truncate(path, 1000)
    else:
        st = os.stat(path)
        with open(path, "r+b") as w:
            w.write(b"x")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(CheckpointError, match=f"{path}: changed while dlo reads blocks"):
        f.read_into(0, memoryview(bytearray(10)))
    f.close()


def test_a_read_past_the_end_is_a_short_read(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    f = DirectFile(path)
    with pytest.raises(CheckpointError, match="short read"):
        f.read_into(len(data) - 5, memoryview(bytearray(10)))
    f.close()


def test_reads_open_each_file_once_and_close_them(tmp_path: Path) -> None:
    from dlo.io.buffers import bytes_of
    from dlo.io.checkpoint import Checkpoint
    from dlo.io.writer import save_checkpoint

    m = torch.nn.Linear(300, 70)
    save_checkpoint(m, tmp_path)
    ckpt = Checkpoint(tmp_path, verify_checksum=True)
    reads = DirectReads()
    out = torch.empty(70 * 300, dtype=torch.float32)
    reads.read_into(ckpt, "weight", 0, bytes_of(out))
    assert torch.equal(out.view(70, 300), m.weight.detach())
    reads.read_into(ckpt, "bias", 4, memoryview(bytearray(8)))
    assert len(reads.files) == 1 and reads.read_nbytes >= 70 * 300 * 4
    reads.close()
    assert reads.files == []


def test_the_bandwidth_probe_reads_the_file(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    bps, was_direct = read_bandwidth(path, nbytes=4 << 20, workers=2)
    assert bps > 0 and isinstance(was_direct, bool)
