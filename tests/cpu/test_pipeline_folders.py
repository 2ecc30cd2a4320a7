"""Diffusers pipeline folders (issue 21): ``dlo save-pipeline`` writes them with
``save_pretrained``, ``dlo run --pipeline`` and ``dlo.load_pipeline(DIR, cfg)`` load them per
rank and run the pipeline's own ``__call__``, bit for bit against diffusers' own
``from_pretrained`` on the same folder. Tiny real classes: Flux, Wan 2.1, Wan 2.2 (two
transformers), SD3, Qwen-Image, HunyuanVideo; offline tokenizers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.cli import main
from dlo.commands.pipeline_calls import resident_reference
from dlo.host.region import LEDGER
from dlo.io.checkpoint import CheckpointError
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder
from tests.cpu.test_cli import _torchrun

_BUILT: dict[str, Path] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("folders")


def _folder(root: Path, name: str) -> Path:
    """``name`` saved once per module (small shards: the sharded layout with an index)."""
    path = root / name
    if not path.exists():
        save_folder(FOLDERS[name], path, max_shard_size=40_000)
    return path


def _call_flags(name: str) -> list[str]:
    names = {"guidance_scale": "--guidance", "num_frames": "--frames"}
    out: list[str] = []
    for k, v in FOLDERS[name].call.items():
        out += [names.get(k, "--" + k.replace("_", "-")), str(v)]
    return out


def _reports(stdout: str) -> list[dict[str, Any]]:
    return json.loads(stdout[stdout.index("[") :])  # type: ignore[no-any-return]


_BOTH = '{"mode": "layer", "components": ["dit", "encoder"]}'

CASES = [
    ("tiny-flux", "float32", []),  # blocks mapped from the file
    ("tiny-flux", "bfloat16", ["--offload-config", _BOTH]),  # cast on load, encoders stream
    ("tiny-wan2.1", "bfloat16", ["--mode", "module"]),
    ("tiny-wan2.1", "float32", ["--mode", "none"]),
    ("tiny-wan2.2", "float32", ["--offload-config", _BOTH]),
    ("tiny-sd3", "float32", ["--resident-layers", "1", "--num-slots", "3"]),
    ("tiny-qwen-image", "bfloat16", ["--offload-config", _BOTH]),
    ("tiny-hunyuan-video", "float32", ["--mode", "module"]),
    ("tiny-hunyuan-video", "bfloat16", []),
]


@pytest.mark.parametrize(("name", "dtype", "flags"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_run_pipeline_check_is_bitwise(
    root: Path, name: str, dtype: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(root, name)
    video = "num_frames" in FOLDERS[name].call
    out = root / f"out-{name}-{dtype}" / ("frames" if video else "image.png")
    argv = ["run", "--pipeline", str(folder), "--steps", "2", "--check", "--json"]
    argv += ["--device", "cpu", "--dtype", dtype, "--output", str(out), *_call_flags(name)]
    rc = main([*argv, *flags])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    (r,) = _reports(stdout)
    assert r["parity"] is True and r["output_finite"], r
    assert r["class"] == FOLDERS[name].pipeline
    assert r["step_ms_median"] > 0 and r["cold_start_s"] > 0
    files = [Path(p) for p in r["output"]]
    assert files and all(p.is_file() and p.stat().st_size > 0 for p in files)
    if video:
        assert len(files) == FOLDERS[name].call["num_frames"]
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_load_pipeline_folder_matches_diffusers_dtypes_and_bits(root: Path) -> None:
    """The Python face: ``dlo.load_pipeline(DIR, cfg)`` returns the ready pipeline; every
    tensor has the dtype diffusers' ``from_pretrained`` gives it with the same
    ``dtype`` (Wan keeps its fp32 modules), and the output is the same bits."""
    folder = _folder(root, "tiny-wan2.1")
    ref = resident_reference(str(folder), torch.bfloat16, torch.device("cpu"))
    pipe, backend = dlo.load_pipeline(
        folder, dlo.OffloadConfig(mode="layer"), device="cpu", dtype=torch.bfloat16
    )
    assert backend is not None
    try:
        for name in ("transformer", "text_encoder", "vae"):
            ours = {n: t.dtype for n, t in getattr(pipe, name).state_dict().items()}
            theirs = {n: t.dtype for n, t in getattr(ref, name).state_dict().items()}
            assert ours == theirs, name
        kept = ref.transformer.condition_embedder.time_embedder.linear_1.weight.dtype
        assert kept == torch.float32  # the class's keep-in-fp32 module
        call: dict[str, Any] = {**FOLDERS["tiny-wan2.1"].call, "output_type": "pt"}
        call.update(prompt="a red fox", num_inference_steps=2)
        pipe.set_progress_bar_config(disable=True)
        a = pipe(**call, generator=torch.Generator().manual_seed(3)).frames
        b = ref(**call, generator=torch.Generator().manual_seed(3)).frames
        assert torch.equal(a, b)
        assert backend.stats()["host_nbytes"] > 0
    finally:
        backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_load_pipeline_folder_argument_errors(root: Path) -> None:
    folder = _folder(root, "tiny-flux")
    with pytest.raises(TypeError, match="holds its own weights"):
        dlo.load_pipeline(folder, folder / "transformer")
    with pytest.raises(TypeError, match="config given twice"):
        dlo.load_pipeline(folder, dlo.OffloadConfig(), dlo.OffloadConfig())
    with pytest.raises(TypeError, match="dtype is for pipeline folders"):
        dlo.load_pipeline(torch.nn.Linear(2, 2), folder, dtype=torch.float16)


def _broken(root: Path, how: str) -> tuple[Path, str]:
    """A copy of the tiny Flux folder broken one way, and what the error must name."""
    dst = root / f"broken-{how}"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(_folder(root, "tiny-flux"), dst)
    index = dst / "model_index.json"
    shard = sorted((dst / "transformer").glob("*-00002-of-*.safetensors"))[0]
    if how == "no-index":
        index.unlink()
        return dst, "model_index.json"
    if how == "bad-json":
        index.write_text("{not json")
        return dst, "model_index.json"
    if how == "missing-component":
        shutil.rmtree(dst / "vae")
        return dst, str(dst / "vae")
    if how == "unknown-library":
        raw = json.loads(index.read_text())
        raw["vae"] = ["mylib", "MyVAE"]
        index.write_text(json.dumps(raw))
        return dst, "vae"
    if how == "no-weights":
        for f in (dst / "vae").glob("*.safetensors*"):
            f.unlink()
        return dst, "diffusion_pytorch_model.safetensors"
    if how == "truncated-shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        return dst, shard.name
    if how == "missing-shard":
        shard.unlink()
        return dst, shard.name
    if how == "unknown-class":
        raw = json.loads(index.read_text())
        raw["_class_name"] = "NoSuchPipeline"
        index.write_text(json.dumps(raw))
        return dst, "NoSuchPipeline"
    raise AssertionError(how)


BROKEN = [
    "no-index",
    "bad-json",
    "missing-component",
    "unknown-library",
    "no-weights",
    "truncated-shard",
    "missing-shard",
    "unknown-class",
]


@pytest.mark.parametrize("how", BROKEN)
def test_a_corrupt_or_incomplete_folder_is_one_clear_error(
    root: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, named = _broken(root, how)
    with pytest.raises(CheckpointError) as err:
        dlo.load_pipeline(folder, dlo.OffloadConfig(mode="layer"), device="cpu")
    assert named in str(err.value), str(err.value)
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    rc = main(["run", "--pipeline", str(folder), "--steps", "1", "--device", "cpu"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and lines[-1].startswith("dlo: error:") and named in lines[-1], lines[-3:]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--prompt", "x"], "--prompt needs --pipeline"),
        (["run", "--output", "x.png"], "--output needs --pipeline"),
        (["run", "--prompt", "x", "--output", "x.png"], "--prompt, --output need --pipeline"),
        (["run", "--pipeline", "DIR", "--hsdp-shard", "2"], "--hsdp-shard is for the demo"),
        (["run", "--pipeline", "DIR", "--preset", "small"], "--preset is for the demo"),
        (["run", "--pipeline", "DIR", "--output", "x.jpg"], "--output='x.jpg'"),
        (["run", "--pipeline", "DIR", "--height", "0"], "--height"),
        (["save-pipeline", "--like", "tiny-flux", "."], "exists and is not empty"),
    ],
)
def test_bad_pipeline_flags_are_one_clear_line(
    root: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(_folder(root, "tiny-flux")) if a == "DIR" else a for a in argv]
    capsys.readouterr()  # what writing the folder printed (the first test to need it writes it)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_save_pipeline_writes_a_folder_diffusers_loads(tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "wan22"
    assert main(["save-pipeline", "--like", "tiny-wan2.2", str(out), "--shard-gb", "0.0001"]) == 0
    assert (out / "transformer_2" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    pipe = DiffusionPipeline.from_pretrained(out)
    assert type(pipe).__name__ == "WanPipeline" and pipe.config.boundary_ratio == 0.875
    assert pipe.transformer_2 is not None


def test_torchrun_two_ranks_allgather_take_their_own_prompts(root: Path) -> None:
    """Under ``torchrun --nproc-per-node=2`` with AllGather: each rank holds half of every
    block, runs its own prompt and seed in lock step, writes its own output, and matches
    the resident pipeline bit for bit."""
    folder = _folder(root, "tiny-wan2.2")
    out = root / "dp" / "video"
    proc = _torchrun(
        "run", "--pipeline", str(folder), "--steps", "2", "--check", "--json",
        "--transfer", "allgather", "--dtype", "float32", "--prompt", "a red fox",
        "--prompt", "a blue bird", "--output", str(out), *_call_flags("tiny-wan2.2"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = _reports(proc.stdout)
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["prompt"] for r in reports] == ["a red fox", "a blue bird"]
    assert [r["seed"] for r in reports] == [0, 1]
    assert all(r["parity"] is True and r["transfer"] == "allgather" for r in reports)
    assert reports[0]["host_nbytes"] == reports[1]["host_nbytes"] > 0
    assert {Path(r["output"][0]).parent.name for r in reports} == {"video", "video.rank1"}


# ----------------------------------------------------------------------------- LoRA
@pytest.fixture(scope="module")
def lora(root: Path) -> Path:
    """A random LoRA (rank 4 on the attention projections) for the tiny Flux transformer,
    written with diffusers' ``save_lora_weights``."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    ref = resident_reference(str(_folder(root, "tiny-flux")), torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    config = LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False)
    ref.transformer.add_adapter(config)
    path = root / "lora"
    layers = get_peft_model_state_dict(ref.transformer)
    FluxPipeline.save_lora_weights(path, transformer_lora_layers=layers)
    return path


def _flux_call(pipe: Any) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    call: dict[str, Any] = {**FOLDERS["tiny-flux"].call, "output_type": "pt"}
    call.update(prompt="a red fox", num_inference_steps=2)
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["prepare", "prepare-fused", "enable_offload"])
def test_lora_applied_before_enable_gives_the_resident_bits(
    root: Path, lora: Path, how: str
) -> None:
    """The supported order: adapters loaded (and fused) before dlo enables, by
    ``load_pipeline(prepare=...)`` on the folder or on a diffusers-loaded pipeline before
    ``enable_offload``; ``set_adapters`` then works while enabled. Same bits as the
    resident pipeline with the same LoRA and the same calls."""
    folder = str(_folder(root, "tiny-flux"))
    fused = how.endswith("fused")
    ref = resident_reference(folder, torch.float32, torch.device("cpu"))
    base = _flux_call(ref)
    ref.load_lora_weights(lora, adapter_name="a")
    if fused:
        ref.fuse_lora()
    want = _flux_call(ref)
    assert not torch.equal(want, base)  # the LoRA changes the output

    def apply(p: Any) -> None:
        p.load_lora_weights(lora, adapter_name="a")
        if fused:
            p.fuse_lora()

    cfg = dlo.OffloadConfig(mode="layer")
    if how == "enable_offload":
        pipe = resident_reference(folder, torch.float32, torch.device("cpu"))
        apply(pipe)
        backend = dlo.enable_offload(pipe, cfg, device="cpu")
    else:
        pipe, backend = dlo.load_pipeline(folder, cfg, device="cpu", prepare=apply)
    assert backend is not None
    try:
        assert torch.equal(_flux_call(pipe), want)
        if not fused:  # scales only: allowed while enabled
            ref.set_adapters(["a"], [0.5])
            pipe.set_adapters(["a"], [0.5])
            assert torch.equal(_flux_call(pipe), _flux_call(ref))
    finally:
        backend.disable()
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


def test_lora_fusing_encoded_blocks_and_the_methods_go_back_at_disable(
    root: Path, lora: Path
) -> None:
    """Fusing rewrites the blocks' host copies (tests/cpu/test_adapters_streaming.py); an
    encoded one is encoded again: the resident pipeline's bits with the same fused LoRA,
    and after disable the pipeline's methods are its own again."""
    from tests.cpu.test_adapters_streaming import fused_encoded

    ref, pipe, backend = fused_encoded(_folder(root, "tiny-flux"), lora)
    try:
        assert torch.equal(_flux_call(pipe), _flux_call(ref))
    finally:
        backend.disable()
    assert "load_lora_weights" not in vars(pipe) and "fuse_lora" not in vars(pipe.transformer)


def test_a_write_through_data_before_enable_is_packed_not_read_from_the_file(root: Path) -> None:
    """A block tensor still aliasing the checkpoint is packed from the file, unless it was
    written: a write through ``.data`` leaves the version counter as it was (PEFT's merge
    does this), so dlo reads the mapping's copy-on-write pages instead."""
    folder = str(_folder(root, "tiny-flux"))

    def write(p: Any) -> None:
        p.transformer.transformer_blocks[0].attn.to_q.weight.data.mul_(3.0)

    ref = resident_reference(folder, torch.float32, torch.device("cpu"))
    write(ref)
    pipe, backend = dlo.load_pipeline(folder, dlo.OffloadConfig(), device="cpu", prepare=write)
    assert backend is not None
    try:
        assert torch.equal(_flux_call(pipe), _flux_call(ref))
    finally:
        backend.disable()


def test_load_pipeline_takes_dtype_as_diffusers_does(root: Path) -> None:
    """``dtype=`` (diffusers 0.42's name): a ``torch.dtype`` or its name, ``"auto"`` the
    stored dtypes; ``torch_dtype`` is its deprecated alias (a FutureWarning)."""
    folder = _folder(root, "tiny-flux")
    none = dlo.OffloadConfig(mode="none")
    for value in (torch.bfloat16, "bfloat16", "torch.bfloat16"):
        pipe, _ = dlo.load_pipeline(folder, none, device="cpu", dtype=value)
        assert pipe.transformer.proj_out.weight.dtype == torch.bfloat16, value
    pipe, _ = dlo.load_pipeline(folder, none, device="cpu", dtype="auto")
    assert pipe.transformer.proj_out.weight.dtype == FOLDERS["tiny-flux"].dtype
    with pytest.warns(
        FutureWarning, match=r"torch_dtype=\.\.\.\) is deprecated: pass dtype"
    ) as seen:
        pipe, _ = dlo.load_pipeline(folder, none, device="cpu", torch_dtype="bfloat16")
    assert pipe.transformer.proj_out.weight.dtype == torch.bfloat16
    assert [Path(w.filename).name for w in seen] == [Path(__file__).name]  # the caller's line


@pytest.mark.filterwarnings("ignore:load_pipeline\\(torch_dtype:FutureWarning")
@pytest.mark.parametrize(
    ("kwargs", "kind", "message"),
    [
        ({"dtype": "bf16"}, ValueError, "dtype='bf16' is not a torch dtype"),
        ({"dtype": "Size"}, ValueError, "dtype='Size' is not a torch dtype"),
        ({"torch_dtype": "bfloat17"}, ValueError, "torch_dtype='bfloat17' is not a torch dtype"),
        ({"dtype": 16}, TypeError, "dtype must be a torch.dtype, its name or None, got 16"),
        ({"dtype": torch.int8}, ValueError, "dtype=torch.int8: components are built in"),
        ({"dtype": "bfloat16", "torch_dtype": torch.float16}, TypeError, "pass dtype only"),
    ],
)
def test_a_bad_dtype_is_an_error_naming_the_argument(
    root: Path, kwargs: dict[str, Any], kind: type[Exception], message: str
) -> None:
    folder = _folder(root, "tiny-flux")
    with pytest.raises(kind, match=re.escape(message)):
        dlo.load_pipeline(folder, dlo.OffloadConfig(mode="none"), device="cpu", **kwargs)


def test_the_encoder_hint_names_the_flag_and_the_flag_streams_them(
    root: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hint to stream an encoder found from its ``_no_split_modules`` names the API
    argument and ``--components``; with ``--components dit,encoder`` the encoders stream
    (more host bytes) and the hint is not given."""
    import dlo.plan.discovery

    folder = _folder(root, "tiny-flux")
    # --check: the run disables its backend (without, the process keeps the host memory)
    argv = ["run", "--pipeline", str(folder), "--steps", "1", "--check", "--json"]
    argv += ["--device", "cpu", *_call_flags("tiny-flux")]
    capsys.readouterr()
    hosts = {}
    for components in ([], ["--components", "dit,encoder"]):
        monkeypatch.setattr(dlo.plan.discovery, "_logged_messages", set())  # warned once each
        caplog.clear()
        assert main([*argv, *components]) == 0
        out = capsys.readouterr().out
        hint = "pass components=('dit', 'encoder') (dlo run: --components dit,encoder) to stream"
        assert (hint in caplog.text) == (not components), caplog.text
        (report,) = _reports(out)
        assert report["parity"] is True, report
        hosts[bool(components)] = report["host_nbytes"]
    assert hosts[True] > hosts[False] > 0
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)


_NOTICES = (
    "Failed to load",  # torchao's compiled kernels
    "Detected no triton",
    "is an Enum subclass",  # torch's pytree, for torchao's enums
    "Unable to import `torchao` Tensor objects",
    "requires torchvision (not installed)",
)
"""What importing diffusers' and transformers' classes logs on a CPU machine without
torchvision, triton or torchao's kernels (dlo's import: never shown)."""

_USER_SCRIPT = """
import logging, sys, warnings
from dlo.cli import main
rc = main(sys.argv[1:])
# the user's own code after dlo's command: its records and warnings show as ever
logging.getLogger("transformers.utils.import_utils").warning(
    "`MyProcessor` requires torchvision (not installed): the user's own")
warnings.warn("the user's own warning", UserWarning)
sys.exit(rc)
"""


def test_diffusers_commands_print_no_import_notices_and_user_warnings_show(
    tmp_path: Path,
) -> None:
    """``dlo save-pipeline`` and ``dlo run --pipeline`` (fresh processes: the notices come
    with the first import) print none of the third-party import notices dlo's own imports
    trigger; the same notice from the user's code, and the user's warnings, still show."""
    from tests.cpu.test_cli import _env

    folder = tmp_path / "flux"
    commands = [
        ["save-pipeline", "--like", "tiny-flux", str(folder)],
        [
            "run",
            "--pipeline",
            str(folder),
            "--steps",
            "1",
            "--device",
            "cpu",
            *_call_flags("tiny-flux"),
        ],
    ]
    for argv in commands:
        proc = subprocess.run(
            [sys.executable, "-c", _USER_SCRIPT, *argv],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        dlo_lines = [line for line in proc.stderr.splitlines() if "the user's own" not in line]
        shown = [n for n in _NOTICES if any(n in line for line in dlo_lines)]
        assert not shown, (argv[0], shown, proc.stderr[-3000:])
        assert "`MyProcessor` requires torchvision (not installed): the user's own" in proc.stderr
        assert "UserWarning: the user's own warning" in proc.stderr


def test_quiet_imports_drops_those_notices_only_and_only_inside(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from dlo.pipelines.classes import quiet_imports

    caplog.set_level(logging.WARNING)
    torchao = logging.getLogger("torchao")
    so = "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library"
    with quiet_imports():
        torchao.warning(so)
        torchao.warning("Failed to load the user's own file")  # same logger, other text
        logging.getLogger("user").warning("Detected no triton")  # other logger
    torchao.warning(so)  # outside: the user's
    assert [r.getMessage() for r in caplog.records] == [
        "Failed to load the user's own file",
        "Detected no triton",
        so,
    ]
