"""Checkpoint straight to per-rank shards, with real gloo groups (world sizes 1, 2, 4)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import dlo
from dlo.backends.layerwise import LayerwiseBackend
from dlo.host.region import LEDGER
from dlo.io.checkpoint import Checkpoint, CheckpointError
from dlo.io.writer import save_checkpoint
from dlo.models import Preset, build_pipeline, make_inputs
from dlo.pipelines.load import load_pipeline
from dlo.platform.device import CpuPlatform
from tests.harness import assert_all_ok, run_ranks

# DiT blocks of about 17 MB in float32: five 4 MiB chunks each, so slices are chunk-major
PRESET = Preset(
    name="loader-test",
    dim=512,
    num_heads=4,
    ffn_dim=2048,
    num_blocks=3,
    cross_attention=True,
    modulation="table",
    text_dim=64,
    text_layers=2,
    text_heads=2,
    text_ffn=128,
    vocab=64,
    text_len=8,
    latent_channels=8,
    grid=(4, 4),
    freq_dim=32,
    vae_channels=8,
    vae_upsamples=1,
)
DTYPE = torch.float32


def _cfg(world: int) -> dlo.OffloadConfig:
    return dlo.OffloadConfig(
        mode="layer",
        components=("dit", "encoder"),
        transfer="allgather" if world > 1 else "rank-local",
        chunk_mb=4,
        collective_timeout_s=20.0,
    )


def _skeleton() -> Any:
    return build_pipeline(PRESET, dtype=DTYPE, device="meta")


def _region_digests(backend: LayerwiseBackend) -> list[str]:
    region = backend._region
    assert region is not None
    return [
        hashlib.sha256(region.view(i).numpy().tobytes()).hexdigest()
        for i in range(len(region.block_nbytes))
    ]


def _manifest(backend: LayerwiseBackend) -> str:
    from dlo.plan.layout import build_manifest

    return build_manifest([b.layout for b in backend._blocks]).digest


def _mapped_rss(path: str) -> int:
    """Resident bytes of this process's mappings of files under ``path`` (from smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = len(head) >= 6 and head[5].startswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def _from_checkpoint_vs_loaded(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    par = dlo.ParallelConfig(data_parallel_size=world)
    ids, latents = make_inputs(PRESET, seed=rank, dtype=DTYPE)
    resident = build_pipeline(PRESET, dtype=DTYPE)
    ref = resident.generate(ids, latents, 2)
    del resident

    loaded = build_pipeline(PRESET, dtype=DTYPE)
    backend = LayerwiseBackend(_cfg(world), par, CpuPlatform())
    backend.enable(loaded)
    plain = (_region_digests(backend), _manifest(backend), backend.stats()["host_nbytes"])
    plain_out = loaded.generate(ids, latents, 2)
    backend.disable()

    import dlo.backends.layer_host as lw

    samples: list[tuple[int, int, int]] = []  # per packed block: shard, padded, mapped RSS
    pack = lw.pack_block
    ckpt_dir = str(Path(ckpt).parent) if ckpt.endswith(".safetensors") else ckpt

    def sampled(dst: torch.Tensor, layout: Any, r: int, sources: Any) -> None:
        pack(dst, layout, r, sources)
        samples.append((layout.shard_nbytes, layout.padded_nbytes, _mapped_rss(ckpt_dir)))

    lw.pack_block = sampled  # type: ignore[assignment]
    try:
        checkpoint = Checkpoint(ckpt)
        pipe, ck_backend = load_pipeline(_skeleton, checkpoint, _cfg(world), par, "cpu")
    finally:
        lw.pack_block = pack  # type: ignore[assignment]
    assert isinstance(ck_backend, LayerwiseBackend)
    mapped_rss = _mapped_rss(ckpt_dir)
    st = ck_backend.stats()
    from_ckpt = (_region_digests(ck_backend), _manifest(ck_backend), st["host_nbytes"])
    out = pipe.generate(ids, latents, 2)
    ck_backend.disable()
    return {
        "same_shards": plain == from_ckpt,
        "digest": from_ckpt[1],
        "num_blocks": len(from_ckpt[0]),
        "bitwise": torch.equal(out, ref) and torch.equal(plain_out, ref),
        "mapped_rss": mapped_rss,
        "samples": samples,
        "read_nbytes": checkpoint.read_nbytes,
        "entry_nbytes": {n: e.nbytes for n, e in checkpoint.entries.items()},
        "stats": {k: st[k] for k in ("group_size", "enable_time_s", "enable_peak_rss_nbytes")},
        "ledger": (LEDGER.host_nbytes, LEDGER.pinned_nbytes),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    pipe = build_pipeline(PRESET, dtype=DTYPE)
    single = save_checkpoint(pipe, root / "single")
    sharded = save_checkpoint(pipe, root / "sharded", max_shard_nbytes=12 << 20)
    return {"single": str(single), "sharded": str(sharded.parent)}


@pytest.mark.parametrize(
    ("world", "kind"), [(1, "single"), (2, "single"), (2, "sharded"), (4, "sharded")]
)
def test_shards_from_checkpoint_equal_shards_from_loaded_model(
    world: int, kind: str, checkpoints: dict[str, str]
) -> None:
    res = assert_all_ok(
        run_ranks(_from_checkpoint_vs_loaded, world, checkpoints[kind], timeout_s=180)
    )
    assert len({r["digest"] for r in res}) == 1
    for r in res:
        assert r["same_shards"] and r["num_blocks"] == PRESET.num_blocks + PRESET.text_layers
        assert r["bitwise"]
        # blocks are read from the file, not through the mapping: no page of the checkpoint
        # is ever resident in the process while (or after) its shards are packed
        assert [rss for _, _, rss in r["samples"]] == [0] * len(r["samples"])
        assert r["mapped_rss"] == 0
    # every byte of every block is read by exactly one rank; non-block weights by all
    sizes = res[0]["entry_nbytes"]
    block = sum(n for k, n in sizes.items() if ".blocks." in k or ".layers." in k)
    non_block = sum(sizes.values()) - block
    assert sum(r["read_nbytes"] for r in res) == world * non_block + block
    for r in res:
        assert r["read_nbytes"] - non_block <= sum(shard for shard, _, _ in r["samples"])
        assert r["stats"]["group_size"] == world
        assert r["stats"]["enable_time_s"] > 0 and r["stats"]["enable_peak_rss_nbytes"] > 0
        assert r["ledger"] == (0, 0)


# ----------------------------------------------------------------------------- bad checkpoints
def _bad_checkpoint(rank: int, world: int, path: str, needle: str) -> str:
    par = dlo.ParallelConfig(data_parallel_size=world)
    with torch.device("meta"):
        skeleton = _skeleton()
    before = [(n, id(t), t.is_meta) for n, t in skeleton.state_dict(keep_vars=True).items()]
    try:
        load_pipeline(skeleton, path, _cfg(world), par, "cpu")
    except CheckpointError as e:
        assert needle in str(e), str(e)
        after = [(n, id(t), t.is_meta) for n, t in skeleton.state_dict(keep_vars=True).items()]
        assert after == before, "the skeleton changed"
        assert all(t.is_meta for t in skeleton.parameters())
        assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
        return "refused"
    return "loaded"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ("missing", "missing from the checkpoint: transformer.blocks.1.attn.qkv.weight"),
        ("extra", "not in the model: transformer.blocks.9.attn.qkv.weight (m.safetensors)"),
        ("shape", "transformer.blocks.2.mlp.fc1.bias (checkpoint [1023]"),
        ("dtype", "text_encoder.embed.weight (checkpoint [64, 64] torch.bfloat16"),
    ],
)
@pytest.mark.parametrize("world", [1, 2])
def test_bad_checkpoint_fails_before_any_mutation(
    world: int, edit: str, needle: str, tmp_path: Path
) -> None:
    sd = {k: v.contiguous() for k, v in build_pipeline(PRESET, dtype=DTYPE).state_dict().items()}
    if edit == "missing":
        del sd["transformer.blocks.1.attn.qkv.weight"]
    elif edit == "extra":
        sd["transformer.blocks.9.attn.qkv.weight"] = torch.ones(3)
    elif edit == "shape":
        sd["transformer.blocks.2.mlp.fc1.bias"] = torch.ones(1023)
    else:
        sd["text_encoder.embed.weight"] = sd["text_encoder.embed.weight"].bfloat16()
    save_file(sd, str(tmp_path / "m.safetensors"))
    res = assert_all_ok(
        run_ranks(_bad_checkpoint, world, str(tmp_path / "m.safetensors"), needle, timeout_s=120)
    )
    assert res == ["refused"] * world


def _enable_fails_after_mapping(rank: int, world: int, path: str) -> str:
    from dlo import faults

    with torch.device("meta"):
        skeleton = _skeleton()
    before = [(n, id(t)) for n, t in skeleton.state_dict(keep_vars=True).items()]
    try:
        with faults.inject("hook_install"):
            load_pipeline(skeleton, path, _cfg(world), None, "cpu")
    except Exception as e:
        after = [(n, id(t)) for n, t in skeleton.state_dict(keep_vars=True).items()]
        assert after == before and all(t.is_meta for t in skeleton.state_dict().values())
        assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
        return type(e).__name__
    return "loaded"


def test_failed_enable_puts_the_skeleton_back(checkpoints: dict[str, str]) -> None:
    res = assert_all_ok(run_ranks(_enable_fails_after_mapping, 1, checkpoints["single"]))
    assert res != ["loaded"]


def test_factory_and_copy_path_single_process(checkpoints: dict[str, str]) -> None:
    ids, latents = make_inputs(PRESET, seed=0, dtype=DTYPE)
    ref = build_pipeline(PRESET, dtype=DTYPE).generate(ids, latents, 2)
    for copy in (False, True):
        pipe, backend = load_pipeline(
            functools.partial(build_pipeline, PRESET, dtype=DTYPE, device="meta"),
            checkpoints["sharded"],
            _cfg(1),
            None,
            "cpu",
            copy=copy,
        )
        assert backend is not None
        assert torch.equal(pipe.generate(ids, latents, 2), ref)
        backend.disable()
        # group size 1: disable gives back a real model (from the host shards)
        assert torch.equal(pipe.generate(ids, latents, 2), ref)
    pipe, backend = load_pipeline(_skeleton, checkpoints["single"], None, None, "cpu")
    assert backend is None and torch.equal(pipe.generate(ids, latents, 2), ref)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def _hsdp_from_checkpoint(rank: int, world: int, path: str) -> dict[str, Any]:
    from dlo.backends.hsdp import shard_non_block

    par = dlo.ParallelConfig(data_parallel_size=world, hsdp_shard_size=world)
    cfg = dlo.OffloadConfig(
        mode="layer", transfer="allgather", chunk_mb=4, collective_timeout_s=20.0
    )
    ids, latents = make_inputs(PRESET, seed=rank, dtype=DTYPE)
    ref = build_pipeline(PRESET, dtype=DTYPE).generate(ids, latents, 2)
    pipe, backend = load_pipeline(
        _skeleton,
        path,
        cfg,
        par,
        "cpu",
        prepare=lambda p: shard_non_block(p, cfg, par, device_type="cpu"),
    )
    assert backend is not None
    dtensors = sum(type(p).__name__ == "DTensor" for p in pipe.transformer.parameters())
    out = pipe.generate(ids, latents, 2)
    st = backend.stats()
    backend.disable()
    return {"bitwise": torch.equal(out, ref), "dtensors": dtensors, "group": st["group_size"]}


def test_hsdp_composes_with_a_checkpoint_load(checkpoints: dict[str, str]) -> None:
    # FSDP2 shards the non-block weights the loader placed; dlo gathers the blocks it read
    res = assert_all_ok(run_ranks(_hsdp_from_checkpoint, 2, checkpoints["single"], timeout_s=180))
    for r in res:
        assert r["bitwise"] and r["dtensors"] > 0 and r["group"] == 2
