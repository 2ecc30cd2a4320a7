"""Pipeline folders on a GPU: ``dlo run --pipeline DIR --check`` bitwise against diffusers'
own ``from_pretrained`` on the device, with the copied weights read through page-locked
staging buffers (see [Note: staged device reads]) and the host shards pinned as they fill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlo.cli import main
from dlo.host.region import LEDGER
from tests.cpu.test_pipeline_folders import _call_flags, _folder, _reports

# every block streamed (a GPU's defaults would keep these tiny models whole: the last cases)
_BOTH = '{"mode": "layer", "components": ["dit", "encoder"], "resident_layers": 0}'
CASES = [
    ("tiny-flux", "float32", ["--resident-layers", "0"]),  # mapped, copies staged as stored
    ("tiny-flux", "bfloat16", ["--offload-config", _BOTH]),  # cast on the device
    ("tiny-wan2.2", "bfloat16", ["--offload-config", _BOTH]),  # two transformers, fp32 kept
    ("tiny-qwen-image", "bfloat16", ["--mode", "module"]),
    ("tiny-flux", "bfloat16", []),  # the defaults: the model fits, nothing streams
    ("tiny-wan2.2", "bfloat16", []),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpu-folders")


IDS = [f"{c[0]}-{c[1]}" + ("-defaults" if not c[2] else "") for c in CASES]


@pytest.mark.parametrize(("name", "dtype", "flags"), CASES, ids=IDS)
def test_run_pipeline_check_is_bitwise_on_the_gpu(
    root: Path, name: str, dtype: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(root, name)
    argv = ["run", "--pipeline", str(folder), "--steps", "2", "--check", "--json"]
    argv += ["--device", "cuda", "--dtype", dtype, *_call_flags(name), *flags]
    rc = main(argv)
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    (r,) = _reports(stdout)
    assert r["parity"] is True and r["output_finite"], r
    if not flags:  # automatic: every DiT block of a model that fits stays on the device
        # kept as pins (a re-plan may unpin them), none loading per forward
        assert r["num_resident_blocks"] == 0 and r["num_pinned_blocks"] > 0, r
        assert r["num_pinned_blocks"] == r["num_streamed_blocks"], r
        assert "resident_layers: " in r["policy"]["explanation"], r["policy"]
    elif "--mode" not in flags:
        assert r["host_pinned_nbytes"] == r["host_nbytes"] > 0  # every streamed block pinned
    assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    torch.cuda.synchronize()
