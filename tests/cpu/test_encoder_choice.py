"""Found encoders kept whole or streamed by the policy ([Note: encoders kept or streamed] in
dlo.plan.encoder_choice), on tiny pipeline folders loaded with a device budget and nothing
else set: every budget gives the resident pipeline's bits, a roomy one keeps the encoders
whole, a tight one streams them, and nothing is left behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dlo
from dlo.commands.pipeline_calls import resident_reference
from dlo.config.fields import GIB
from dlo.host.region import LEDGER
from dlo.pipelines.layouts import FOLDERS
from dlo.pipelines.synth import save_folder
from dlo.plan.policy_model import FREE_MEMORY_HEADROOM


def _call(pipe: Any, name: str) -> torch.Tensor:
    call: dict[str, Any] = {**FOLDERS[name].call, "output_type": "pt", "prompt": "a red fox"}
    out = pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    return out.frames if "num_frames" in call else out.images  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan2.1"])
def test_budgets_keep_or_stream_the_encoders_bitwise(tmp_path: Path, name: str) -> None:
    check_budgets(tmp_path, name, torch.device("cpu"))


def check_budgets(tmp_path: Path, name: str, device: torch.device) -> None:
    """Budgets from below the whole pipeline's device weights to above them: every one
    bitwise, the encoders streamed under the tighter ones and whole under the roomier."""
    folder = tmp_path / name
    save_folder(FOLDERS[name], folder, max_shard_size=40_000)
    ref = resident_reference(str(folder), torch.float32, device)
    ref.set_progress_bar_config(disable=True)
    expect = _call(ref, name)
    # the whole pipeline's device weights and what is held at enable, from a roomy budget
    pipe, backend = dlo.load_pipeline(
        folder, dlo.OffloadConfig(device_budget_gb=1.0), device=device, dtype=torch.float32
    )
    assert backend is not None
    policy = backend.stats()["policy"]
    # held at enable: every non-block weight on a CPU device (the encoders' counted as to
    # place), what the allocator holds on a GPU
    weights = policy["device_weight_nbytes"]
    held = policy["measured"]["held_device_nbytes"]
    if held is None:
        held = policy["per_rank"][0]["non_block_nbytes"]
    backend.disable()
    outcomes: dict[str, list[float]] = {"whole": [], "streamed": []}
    for fraction in (0.5, 0.8, 0.9, 0.95, 0.97, 1.0, 1.3):
        budget = (held + fraction * (weights - held) / (1 - FREE_MEMORY_HEADROOM)) / GIB
        cfg = dlo.OffloadConfig(device_budget_gb=budget)
        try:
            pipe, backend = dlo.load_pipeline(folder, cfg, device=device, dtype=torch.float32)
        except ValueError as e:  # too small a budget: refused by name, nothing held
            assert "device_budget_gb" in str(e)
            assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
            continue
        assert backend is not None
        try:
            policy = backend.stats()["policy"]
            encoders = [s for s in backend.plan.stacks if s.component == "encoder"]
            if policy["kept_whole"]:
                assert not encoders  # kept whole: the encoder streams no block
                assert "kept whole on the device" in policy["explanation"]
                outcomes["whole"].append(fraction)
            else:
                assert encoders and all(s.optional for s in encoders)
                assert "encoders " in policy["explanation"]
                outcomes["streamed"].append(fraction)
            pipe.set_progress_bar_config(disable=True)
            assert torch.equal(_call(pipe, name), expect), fraction
        finally:
            backend.disable()
        assert (LEDGER.host_nbytes, LEDGER.pinned_nbytes) == (0, 0)
    assert outcomes["whole"] and outcomes["streamed"], outcomes
    # more room never streams what less room kept whole
    assert max(outcomes["streamed"]) < min(outcomes["whole"]), outcomes
