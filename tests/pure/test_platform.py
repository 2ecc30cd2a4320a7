"""Pure tests of dlo.platform: torchrun's environment, the CPU platform's no-ops, platform
selection, host-memory helpers, and that a CPU ring never initializes CUDA."""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dlo
from dlo.platform import device as plat_device
from dlo.platform import env as plat_env
from dlo.platform import timing as plat_timing
from dlo.platform.device import CpuPlatform, NullEvent, NullStream, default_device, get_platform
from dlo.platform.env import (
    TorchrunEnv,
    env_str,
    page_size,
    process_peak_rss_bytes,
    process_rss_bytes,
    set_env_default,
    torchrun_env,
)
from dlo.platform.timing import StreamTimer

TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@contextlib.contextmanager
def _raises(exc: type[Exception], *needles: str) -> Iterator[None]:
    with pytest.raises(exc) as info:
        yield
    for n in needles:
        assert n in str(info.value), f"{n!r} not in {str(info.value)!r}"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ----------------------------------------------------------------------------- torchrun_env
def test_torchrun_env_defaults(clean_env: pytest.MonkeyPatch) -> None:
    env = torchrun_env()
    assert env == TorchrunEnv(
        rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None
    )
    assert not env.is_distributed


def test_torchrun_env_empty_strings_are_defaults(clean_env: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARS:
        clean_env.setenv(name, "")
    env = torchrun_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert env.master_port is None


def test_torchrun_env_full(clean_env: pytest.MonkeyPatch) -> None:
    values = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node-0",
        "MASTER_PORT": "29500",
    }
    for k, v in values.items():
        clean_env.setenv(k, v)
    env = torchrun_env()
    assert env == TorchrunEnv(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        master_addr="node-0",
        master_port=29500,
    )
    assert env.is_distributed


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"])
@pytest.mark.parametrize("raw", ["abc", "1.5", "two", "0x2"])
def test_torchrun_env_bad_int_names_variable(
    clean_env: pytest.MonkeyPatch, name: str, raw: str
) -> None:
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv(name, raw)
    with _raises(ValueError, name, repr(raw)):
        torchrun_env()


def test_torchrun_env_bad_master_port_names_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MASTER_PORT", "http")
    with _raises(ValueError, "MASTER_PORT", "'http'"):
        torchrun_env()


@pytest.mark.parametrize("rank, world", [(-1, 1), (1, 1), (4, 4), (7, 2), (-3, 8)])
def test_torchrun_env_rank_out_of_range(
    clean_env: pytest.MonkeyPatch, rank: int, world: int
) -> None:
    clean_env.setenv("RANK", str(rank))
    clean_env.setenv("WORLD_SIZE", str(world))
    with _raises(ValueError, f"RANK={rank}", f"WORLD_SIZE={world}"):
        torchrun_env()


@pytest.mark.parametrize("world", [0, -2])
def test_torchrun_env_world_size_below_one(clean_env: pytest.MonkeyPatch, world: int) -> None:
    clean_env.setenv("WORLD_SIZE", str(world))
    with _raises(ValueError, f"WORLD_SIZE={world}"):
        torchrun_env()


@pytest.mark.parametrize("rank, world", [(0, 1), (0, 2), (1, 2), (7, 8)])
def test_torchrun_env_rank_in_range(clean_env: pytest.MonkeyPatch, rank: int, world: int) -> None:
    clean_env.setenv("RANK", str(rank))
    clean_env.setenv("WORLD_SIZE", str(world))
    env = torchrun_env()
    assert (env.rank, env.world_size, env.is_distributed) == (rank, world, world > 1)


def test_env_str_and_set_env_default(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "DLO_TEST_PLATFORM_VARIABLE"
    monkeypatch.setenv(name, "user")  # records the original state for teardown
    set_env_default(name, "dlo")
    assert env_str(name) == "user"
    monkeypatch.delenv(name)
    assert env_str(name) is None
    assert env_str(name, "fallback") == "fallback"
    set_env_default(name, "dlo")
    assert env_str(name) == "dlo"


# ----------------------------------------------------------------------------- CPU platform
def test_cpu_platform_is_a_no_op_device() -> None:
    p = CpuPlatform()
    assert p.device == torch.device("cpu")
    assert p.can_pin is False and p.has_streams is False
    assert p.dist_backend == "gloo"
    assert p.synchronize() is None
    assert (p.memory_allocated(), p.max_memory_allocated(), p.num_allocs()) == (0, 0, 0)
    assert p.reset_peak_memory_stats() is None and p.empty_cache() is None


def test_cpu_platform_streams_and_events() -> None:
    p = CpuPlatform()
    copy_stream, current = p.new_stream(), p.current_stream()
    assert isinstance(copy_stream, NullStream) and isinstance(current, NullStream)
    ready = p.new_event()
    timed = p.new_event(timing=True)
    assert isinstance(ready, NullEvent) and isinstance(timed, NullEvent)
    assert ready.record(copy_stream) is None and ready.record() is None
    assert current.wait_event(ready) is None
    assert current.wait_stream(copy_stream) is None
    assert copy_stream.synchronize() is None
    assert ready.wait(current) is None and ready.wait() is None
    assert ready.query() is True
    assert ready.synchronize() is None
    assert ready.elapsed_time(timed) == 0.0
    with p.stream(copy_stream) as entered:
        assert entered is copy_stream
        assert torch.ones(2).add(1).sum().item() == 4.0


def test_cpu_platform_never_pins() -> None:
    p = CpuPlatform()
    t = torch.zeros(1024, dtype=torch.uint8)
    assert p.register_host(t) is False
    assert p.unregister_host(t) is None
    assert not t.is_pinned()


def test_stream_timer_reads_zero_on_cpu() -> None:
    p = CpuPlatform()
    timer = StreamTimer(p)
    s = p.current_stream()
    for _ in range(3):
        timer.begin(s)
        torch.ones(8).mul_(2)
        timer.end(s)
    timer.harvest()
    timer.harvest(block_host=True)
    assert (timer.total_ms, timer.count, timer.dropped) == (0.0, 0, 0)


# ----------------------------------------------------------------------------- selection
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_get_platform_cpu(device: str | torch.device) -> None:
    p = get_platform(device)
    assert isinstance(p, CpuPlatform) and p.device == torch.device("cpu")


@pytest.mark.parametrize("device", ["mps", "xla", "meta", torch.device("mps")])
def test_get_platform_unsupported_device(device: str | torch.device) -> None:
    name = torch.device(device).type
    with _raises(ValueError, f"device={name}", "cuda", "cpu"):
        get_platform(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without usable CUDA")
def test_get_platform_cuda_without_cuda() -> None:
    with _raises(ValueError, "device=cuda", "CUDA"):
        get_platform("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machines only")
def test_default_device_is_cpu_here() -> None:
    assert plat_device.accelerator_available() is False
    assert default_device() == torch.device("cpu")
    assert default_device(local_rank=3) == torch.device("cpu")
    assert isinstance(get_platform(), CpuPlatform)


def test_default_device_without_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plat_device, "accelerator_available", lambda: False)
    assert default_device() == torch.device("cpu")
    assert isinstance(get_platform(None), CpuPlatform)


# ----------------------------------------------------------------------------- host memory
def test_page_size_is_a_positive_power_of_two() -> None:
    n = page_size()
    assert isinstance(n, int) and n > 0 and n & (n - 1) == 0


def test_process_rss() -> None:
    rss = process_rss_bytes()
    assert isinstance(rss, int) and rss > 0
    if sys.platform.startswith("linux"):
        assert process_peak_rss_bytes() > 0


def test_trim_host_heap_and_nvtx_range_are_safe() -> None:
    plat_env.trim_host_heap()
    with plat_timing.nvtx_range("dlo::test"):
        assert torch.ones(1).item() == 1.0


# ----------------------------------------------------------------------------- no CUDA init
_NO_CUDA_INIT = textwrap.dedent(
    """
    import torch

    import dlo
    from dlo.models import build_pipeline, make_inputs

    assert not torch.cuda.is_initialized(), "import dlo initialized CUDA"
    pipe = build_pipeline("tiny", dtype=torch.float32, device="cpu")
    ids, latents = make_inputs("tiny", dtype=torch.float32, device="cpu")
    with torch.no_grad():
        ref = pipe.denoise(latents, pipe.encode(ids), steps=2)
    backend = dlo.enable_offload(pipe, dlo.OffloadConfig(mode="layer"), device="cpu")
    assert backend is not None and backend.is_enabled()
    with torch.no_grad():
        out = pipe.denoise(latents, pipe.encode(ids), steps=2)
    assert torch.equal(out, ref), "CPU ring changed the result"
    stats = backend.stats()
    assert stats["num_streamed_blocks"] > 0 and stats["h2d_nbytes"] > 0, stats
    backend.disable()
    assert not torch.cuda.is_initialized(), "the CPU ring initialized CUDA"
    print("NO_CUDA_INIT_OK")
    """
)


@pytest.mark.timeout(120)
def test_cpu_ring_never_initializes_cuda() -> None:
    # A fresh interpreter: other tests in this process may have touched CUDA on a GPU host.
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    proc = subprocess.run(
        [sys.executable, "-c", _NO_CUDA_INIT],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "NO_CUDA_INIT_OK" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="CUDA was initialized before this test")
def test_cpu_ring_never_initializes_cuda_in_process(clean_env: pytest.MonkeyPatch) -> None:
    from dlo.models import build_pipeline, make_inputs

    pipe = build_pipeline("tiny", dtype=torch.float32, device="cpu")
    ids, latents = make_inputs("tiny", dtype=torch.float32, device="cpu")
    backend = dlo.enable_offload(pipe, dlo.OffloadConfig(mode="layer"), device="cpu")
    assert backend is not None
    try:
        with torch.no_grad():
            pipe.denoise(latents, pipe.encode(ids), steps=1)
        assert not torch.cuda.is_initialized()
    finally:
        backend.disable()
    assert not torch.cuda.is_initialized()


def test_cpu_share_divides_the_cpus_among_the_ranks_of_a_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dlo.platform.env import cpu_share

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert cpu_share() == 16
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_share() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert cpu_share() == 1  # never zero


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux page table only")
def test_copied_on_write_sees_exactly_the_written_pages(tmp_path: Path) -> None:
    from dlo.platform.env import copied_on_write, page_size

    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x01" * (64 << 20))
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 64 << 20, flags=mmap.MAP_PRIVATE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    assert int(t[:: page_size()].sum()) == (64 << 20) // page_size()  # every page read
    base, page = t.data_ptr(), page_size()
    assert copied_on_write(base, t.numel()) is False
    t[40 << 20] = 3  # one page copied
    assert copied_on_write(base, t.numel()) is True
    assert copied_on_write(base, 40 << 20) is False
    assert copied_on_write(base + (40 << 20), page) is True
    assert copied_on_write(base + (40 << 20) + page, 8 << 20) is False
    assert copied_on_write(base, 0) is False
    del t
    m.close()
