"""safetensors headers, indexes, the writer, validation before mutation, shard range math."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dlo.host.region import LEDGER, HostRegion, PinReport
from dlo.host.shards import shard_copies
from dlo.io.checkpoint import Checkpoint, CheckpointError, read_header
from dlo.io.materialize import materialize, plan_load
from dlo.io.writer import save_checkpoint
from dlo.journal import Journal
from dlo.plan.layout import plan_block_layout
from dlo.platform.device import CpuPlatform


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.w": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "a.b": torch.randn(5, generator=g),
        "flag": torch.tensor([True, False, True]),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "q": torch.randint(-100, 100, (9,), dtype=torch.int8, generator=g),
        "scalar": torch.tensor(3.5, dtype=torch.float16),
        "empty": torch.empty(0, 4),
    }


def test_header_matches_the_safetensors_library(tmp_path: Path) -> None:
    tensors = _mixed()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    entries = read_header(tmp_path / "m.safetensors")
    assert set(entries) == set(tensors)
    ckpt = Checkpoint(tmp_path / "m.safetensors")
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        for name, t in tensors.items():
            e = entries[name]
            assert (e.dtype, e.shape) == (t.dtype, tuple(t.shape))
            assert torch.equal(ckpt.tensor(name), f.get_tensor(name))


def test_writer_is_read_by_the_library_and_shards_with_an_index(tmp_path: Path) -> None:
    m = nn.Module()
    for name, t in _mixed().items():
        m.register_buffer(name.replace(".", "_"), t)
    single = save_checkpoint(m, tmp_path / "one")
    sharded = save_checkpoint(m, tmp_path / "many", max_shard_nbytes=40)
    assert single.name == "model.safetensors" and sharded.name.endswith(".index.json")
    weight_map = json.loads(sharded.read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    for path in (single, sharded.parent, sharded):
        ckpt = Checkpoint(path)
        assert set(ckpt.entries) == set(m.state_dict())
        for name, t in m.state_dict().items():
            assert torch.equal(ckpt.tensor(name), t), name
            assert ckpt.tensor(name).data_ptr() % t.element_size() == 0
    with safe_open(str(single), "pt") as f:
        for name, t in m.state_dict().items():
            assert torch.equal(f.get_tensor(name), t)


def _raw(path: Path, header: dict, data: bytes, *, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length", "needle"),
    [
        ({}, b"", 1 << 40, "does not fit the file"),
        ({"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "Q9"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, None, "[0, 4]"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, "past"),
        ({"x": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, None, "malformed"),
        # issue 26 (5): what the safetensors library refuses, dlo refuses
        (
            {"x": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "malformed",
        ),
        (
            {"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "malformed",
        ),
        (
            {
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
            None,
            "'x' and 'y' overlap",
        ),
        (
            {
                "x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                "z": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            b"\0" * 16,
            None,
            "overlap",
        ),
    ],
)
def test_bad_headers_name_file_and_tensor(
    tmp_path: Path, header: dict, data: bytes, length: int | None, needle: str
) -> None:
    path = _raw(tmp_path / "bad.safetensors", header, data, length=length)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors") as e:
        Checkpoint(path)
    assert needle in str(e.value)


def test_duplicate_keys_and_non_regular_files_are_refused(tmp_path: Path) -> None:
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    raw = ('{"x": ' + entry + ', "x": ' + entry + "}").encode()
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"dup\.safetensors: duplicate key 'x'"):
        read_header(path)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)  # open() would block forever
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_header(fifo)


def test_truncated_and_non_json(tmp_path: Path) -> None:
    (tmp_path / "t.safetensors").write_bytes(b"\1\2")
    with pytest.raises(CheckpointError, match="too short"):
        read_header(tmp_path / "t.safetensors")
    (tmp_path / "j.safetensors").write_bytes(struct.pack("<Q", 3) + b"{x]")
    with pytest.raises(CheckpointError, match="not JSON"):
        read_header(tmp_path / "j.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nowhere")


def test_tensor_in_two_shards_and_index_disagreement(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2), "a": torch.ones(1)}, str(tmp_path / "p1.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "p2.safetensors"))
    with pytest.raises(CheckpointError, match=r"'w' is stored twice: in .*p1.* and in .*p2"):
        Checkpoint(tmp_path)
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"w": "p1.safetensors"}}))
    with pytest.raises(CheckpointError, match="not listed: a"):
        Checkpoint(tmp_path)
    idx.write_text(json.dumps({"weight_map": {"w": "p2.safetensors", "a": "p2.safetensors"}}))
    with pytest.raises(CheckpointError, match="not found where listed: a"):
        Checkpoint(idx)


# ----------------------------------------------------------------------------- validation
class Block(nn.Module):
    """Transposed weight, fp32 norm in a bf16 block, both kinds of buffers."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, dtype=torch.bfloat16)
        self.proj_t = nn.Parameter(torch.empty(2 * dim, dim, dtype=torch.bfloat16).t())
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("gain", torch.ones(1))
        self.register_buffer("rope", torch.empty(dim), persistent=False)
        if not self.rope.is_meta:
            self.init_buffers()

    def init_buffers(self) -> None:
        with torch.no_grad():
            self.rope.copy_(torch.arange(self.rope.numel()) * 0.01)


class Model(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, num_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            h = b.norm(x + b.rope) * b.gain
            x = x + (b.lin(h.bfloat16()) @ b.proj_t).float()[..., :8]
        return self.head(x)


def filled(seed: int = 0) -> Model:
    m = Model()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def skeleton() -> Model:
    with torch.device("meta"):
        return Model()


def _meta_state(m: nn.Module) -> list[tuple[str, int, bool]]:
    named = list(m.named_parameters()) + list(m.named_buffers())
    return [(n, id(t), t.is_meta) for n, t in named]


def _edit(tmp_path: Path, edit: str) -> Path:
    sd = {k: v.contiguous() for k, v in filled().state_dict().items()}
    if edit == "missing":
        del sd["blocks.1.lin.weight"]
    elif edit == "extra":
        sd["blocks.1.surprise"] = torch.ones(2)
    elif edit == "shape":
        sd["blocks.2.norm.weight"] = torch.ones(9)
    elif edit == "dtype":
        sd["head.bias"] = sd["head.bias"].double()
    save_file(sd, str(tmp_path / "m.safetensors"))
    return tmp_path / "m.safetensors"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ("missing", "missing from the checkpoint: blocks.1.lin.weight"),
        ("extra", "not in the model: blocks.1.surprise (m.safetensors)"),
        ("shape", "blocks.2.norm.weight (checkpoint [9] torch.float32 in m.safetensors"),
        ("dtype", "head.bias (checkpoint [8] torch.float64 in m.safetensors, model [8] torch.fl"),
    ],
)
def test_bad_checkpoint_refused_before_any_change(tmp_path: Path, edit: str, needle: str) -> None:
    sk = skeleton()
    before = _meta_state(sk)
    with pytest.raises(CheckpointError) as e:
        plan_load(sk, Checkpoint(_edit(tmp_path, edit)))
    assert needle in str(e.value)
    assert _meta_state(sk) == before


def test_uncomputable_non_persistent_buffer_is_refused(tmp_path: Path) -> None:
    sk = skeleton()
    sk.blocks[0].init_buffers = None  # type: ignore[assignment]
    with pytest.raises(CheckpointError, match=r"no init_buffers\(\): blocks.0.rope"):
        plan_load(sk, Checkpoint(_edit(tmp_path, "none")))


def test_tied_tensor_needs_one_source(tmp_path: Path) -> None:
    m = filled()
    m.head.weight = m.embed.weight
    save_checkpoint(m, tmp_path / "ok")  # writes the tied tensor once
    sk = skeleton()
    sk.head.weight = sk.embed.weight
    plan = plan_load(sk, Checkpoint(tmp_path / "ok"))
    journal = Journal()
    materialize(plan, journal)
    assert sk.head.weight is sk.embed.weight and torch.equal(sk.head.weight, m.embed.weight)
    sd = {k: v.contiguous().clone() for k, v in m.state_dict().items()}
    save_file(sd, str(tmp_path / "both.safetensors"))
    with pytest.raises(CheckpointError, match=r"two names of one tied tensor: embed\.weight and"):
        plan_load(skeleton_tied(), Checkpoint(tmp_path / "both.safetensors"))


def skeleton_tied() -> Model:
    sk = skeleton()
    sk.head.weight = sk.embed.weight
    return sk


def test_materialize_then_rollback_restores_the_skeleton(tmp_path: Path) -> None:
    m = filled()
    path = save_checkpoint(m, tmp_path)
    sk = skeleton()
    before = _meta_state(sk)
    journal = Journal()
    report = materialize(plan_load(sk, Checkpoint(path)), journal, mapped=lambda n: True)
    # the transposed weights cannot alias the row-major file: copied, with a reason
    assert set(report.copy_reasons) == {f"blocks.{i}.proj_t" for i in range(3)}
    assert all("not contiguous" in r for r in report.copy_reasons.values())
    for (n, t), (n2, t2) in zip(sk.state_dict().items(), m.state_dict().items()):
        assert n == n2 and torch.equal(t, t2) and t.stride() == t2.stride()
    assert torch.equal(sk.blocks[1].rope, m.blocks[1].rope)
    x = torch.randn(2, 8)
    assert torch.equal(sk(x), m(x))
    journal.rollback()
    assert _meta_state(sk) == before


# ----------------------------------------------------------------------------- range math
@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
    group=st.integers(1, 5),
    chunk=st.integers(256, 6000),
)
def test_every_tensor_byte_is_read_by_exactly_one_rank(
    sizes: list[int], group: int, chunk: int
) -> None:
    lay = plan_block_layout(
        "b",
        [(f"t{i}", "param", (n,), (1,), torch.uint8) for i, n in enumerate(sizes)],
        group_size=group,
        chunk_nbytes=chunk,
    )
    seen = [[0] * n for n in sizes]
    for rank in range(group):
        shard_bytes = set()
        for i, lo, n, dst in shard_copies(lay, rank):
            for k in range(n):
                seen[i][lo + k] += 1
                shard_bytes.add(dst + k)
            assert dst + n <= lay.shard_nbytes
        assert len(shard_bytes) == sum(n for _, _, n, _ in shard_copies(lay, rank))
    assert all(c == 1 for counts in seen for c in counts)


# ----------------------------------------------------------------------------- pinning
class _Pins(CpuPlatform):
    can_pin = True

    def __init__(self, fail: set[int], sizes: list[int]) -> None:
        super().__init__()
        self.fail = fail
        self.sizes = sizes

    def register_host(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() not in self.fail

    def unregister_host(self, tensor: torch.Tensor) -> None:
        pass


def _sequential(sizes: list[int], fail: set[int], budget: int | None) -> PinReport:
    """The budget rule, one block at a time (what parallel pinning must reproduce)."""
    r = PinReport(requested_blocks=len(sizes))
    used = 0
    for i, n in enumerate(sizes):
        if budget is not None and used + n > budget:
            r.over_budget_blocks.append(i)
        elif n in fail:
            r.failed_blocks.append(i)
        else:
            r.pinned_blocks.append(i)
            used += n
    return r


@pytest.mark.parametrize("budget", [None, 9000, 12000, 3000])
@pytest.mark.parametrize("workers", [1, 4])
def test_parallel_pinning_keeps_the_budget(budget: int | None, workers: int) -> None:
    sizes = [4096, 8192, 4096, 12288, 4096]
    region = HostRegion(sizes)
    report = region.pin(_Pins(set(), sizes), budget_nbytes=budget, num_workers=workers)
    ref = _sequential(sizes, set(), budget)
    assert (report.pinned_blocks, report.over_budget_blocks, report.failed_blocks) == (
        ref.pinned_blocks,
        ref.over_budget_blocks,
        ref.failed_blocks,
    )
    assert budget is None or region.pinned_nbytes <= budget
    assert LEDGER.pinned_nbytes == region.pinned_nbytes
    region.close()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_failed_registration_frees_budget_for_skipped_blocks() -> None:
    sizes = [4096, 8192, 4096]
    region = HostRegion(sizes)
    report = region.pin(_Pins({4096 * 2}, sizes), budget_nbytes=8192, num_workers=4)
    # block 1 did not fit; block 2 did. Nothing failed, so nothing moves.
    assert report.pinned_blocks == [0, 2] and report.over_budget_blocks == [1]
    region.close()
    sizes = [8192, 4096, 4096]
    region = HostRegion(sizes)
    report = region.pin(_Pins({8192}, sizes), budget_nbytes=8192, num_workers=4)
    assert report.failed_blocks == [0] and report.pinned_blocks == [1, 2]
    assert region.pinned_nbytes <= 8192
    region.close()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


class _Watching(_Pins):
    """Records the first byte of each block when it is registered."""

    def __init__(self, fail: set[int], sizes: list[int]) -> None:
        super().__init__(fail, sizes)
        self.seen: dict[int, int] = {}

    def register_host(self, tensor: torch.Tensor) -> bool:
        self.seen[tensor.numel()] = int(tensor[0])
        return super().register_host(tensor)


@pytest.mark.parametrize("workers", [1, 4])
def test_pinning_as_filled_registers_each_block_after_its_fill(workers: int) -> None:
    sizes = [4096, 8192, 12288, 16384]
    region = HostRegion(sizes)
    platform = _Watching(set(), sizes)
    pins = region.pin_as_filled(platform, budget_nbytes=4096 + 8192 + 12288, num_workers=workers)
    assert pins.chosen == [0, 1, 2]  # block 3 does not fit the budget
    for i in range(len(sizes)):
        assert sizes[i] not in platform.seen  # nothing registered before its fill
        region.view(i).fill_(i + 1)
        pins.filled(i)
    report = pins.finish()
    assert report.pinned_blocks == [0, 1, 2] and report.over_budget_blocks == [3]
    assert platform.seen == {4096: 1, 8192: 2, 12288: 3}  # each saw its own bytes
    assert LEDGER.pinned_nbytes == region.pinned_nbytes == 4096 + 8192 + 12288
    pins.cancel()  # a no-op after finish (the journal's undo may still run it)
    assert region.pinned_nbytes == 4096 + 8192 + 12288
    region.close()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_cancelled_pinning_records_what_was_registered() -> None:
    sizes = [4096, 8192, 12288]
    region = HostRegion(sizes)
    pins = region.pin_as_filled(_Pins(set(), sizes), num_workers=4)
    pins.filled(1)  # the fill of block 2 failed: the rollback cancels
    pins.cancel()
    assert region.pinned_nbytes == 8192 and LEDGER.pinned_nbytes == 8192
    with pytest.raises(AssertionError, match="already finished"):
        pins.finish()
    region.close()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_a_registration_error_is_raised_at_finish_with_the_successes_recorded() -> None:
    sizes = [4096, 8192, 12288]

    class Raising(_Pins):
        def register_host(self, tensor: torch.Tensor) -> bool:
            if tensor.numel() == 8192:
                raise RuntimeError("driver gone")
            return True

    region = HostRegion(sizes)
    pins = region.pin_as_filled(Raising(set(), sizes), num_workers=4)
    for i in range(3):
        pins.filled(i)
    with pytest.raises(RuntimeError, match="driver gone"):
        pins.finish()
    assert region.pinned_nbytes == 4096 + 12288
    region.close()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


class _Counting(_Pins):
    def __init__(self, sizes: list[int]) -> None:
        super().__init__(set(), sizes)
        self.live = 0

    def register_host(self, tensor: torch.Tensor) -> bool:
        self.live += 1
        return True

    def unregister_host(self, tensor: torch.Tensor) -> None:
        self.live -= 1


@pytest.mark.parametrize("workers", [1, 4])
def test_an_interrupt_while_pinning_finishes_leaves_no_registration(workers: int) -> None:
    """A KeyboardInterrupt at any line of finish (outside dlo.journal.atomic, where a real
    SIGINT waits): the journal's cancel and close() still unregister every block."""
    import sys

    from dlo.host import region as region_module
    from dlo.journal import masked

    sizes = [4096] * 4
    path = region_module.__file__
    for target in range(1, 500):
        seen = [0]

        def local(
            frame: object, event: str, arg: object, seen: list[int] = seen, target: int = target
        ) -> object:
            if event == "line" and not masked():
                seen[0] += 1
                if seen[0] == target:
                    raise KeyboardInterrupt
            return local

        platform = _Counting(sizes)
        region = HostRegion(sizes)
        pins = region.pin_as_filled(platform, num_workers=workers)
        for i in range(4):
            pins.filled(i)
        sys.settrace(lambda f, e, a: local if f.f_code.co_filename == path else None)
        try:
            pins.finish()
            hit = False
        except KeyboardInterrupt:
            hit = True
        finally:
            sys.settrace(None)
        pins.cancel()
        region.close()
        assert platform.live == 0, (target, platform.live)
        assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0), target
        if not hit:
            break
    assert target > 5  # the interrupts landed inside finish


def test_the_bounce_buffer_is_pinned_grown_and_released() -> None:
    from dlo.host.bounce import Bounce
    from dlo.host.region import LEDGER

    before = (LEDGER.host_nbytes, LEDGER.pinned_nbytes)
    registered: list[int] = []

    class Counting(_Pins):
        def register_host(self, tensor: torch.Tensor) -> bool:
            registered.append(tensor.numel())
            return True

    b = Bounce(Counting(set(), []))
    v = b.view(5000)
    assert v.numel() == 5000 and b.pinned and registered == [5000]
    v[:] = 7
    assert b.view(100).data_ptr() == v.data_ptr() and registered == [5000]  # reused
    assert LEDGER.pinned_nbytes == before[1] + 5000
    w = b.view(9000)  # grown: a new buffer, the old one released
    assert w.numel() == 9000 and registered == [5000, 9000]
    assert LEDGER.pinned_nbytes == before[1] + 9000
    assert b.view(0).numel() == 0
    b.close()
    b.close()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == before and not b.pinned
    c = Bounce(_Pins({64}, []))  # a failed registration: ordinary memory, same bytes
    assert c.view(64).numel() == 64 and not c.pinned
    c.close()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == before
