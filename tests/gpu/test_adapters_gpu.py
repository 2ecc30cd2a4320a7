"""LoRA adapters loaded, switched and unloaded while dlo streams a pipeline on a GPU: the
adapters of streamed blocks are created on the device (PEFT follows the stubs' device, see
[Note: adapters while streaming]), and 10 requests over 3 adapters give the resident
pipeline's bits, with and without the codec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dlo
from tests.cpu.test_adapters_streaming import folder, fuse_and_compare, loras, switch_and_compare

__all__ = ["folder", "loras"]  # fixtures


@pytest.mark.parametrize("codec", ["none", "ans"])
def test_ten_requests_over_three_adapters_bitwise_on_the_gpu(
    folder: Path, loras: list[Path], codec: str
) -> None:
    cfg = dlo.OffloadConfig(mode="layer", resident_layers=0, num_slots=2, codec=codec)
    stats = switch_and_compare(folder, loras, "cuda", cfg)
    assert stats["num_streamed_blocks"] > 0 and stats["h2d_nbytes"] > 0
    assert stats["codec"] == codec
    torch.cuda.synchronize()


@pytest.mark.parametrize("when", ["after", "before"])
def test_fuse_and_unfuse_while_enabled_bitwise_on_the_gpu(
    folder: Path, loras: list[Path], when: str
) -> None:
    cfg = dlo.OffloadConfig(mode="layer", resident_layers=1, num_slots=2)
    stats = fuse_and_compare(folder, loras, "cuda", cfg, when)
    assert stats["num_streamed_blocks"] > 0 and stats["num_resident_blocks"] == 1
    torch.cuda.synchronize()


def test_fusing_encoded_blocks_encodes_them_again_on_the_gpu(
    folder: Path, loras: list[Path]
) -> None:
    """nvCOMP encodes each rewritten block again; the decoders are fitted to it (piece
    sizes prepared, staging grown where it grew) before the next forward."""
    pytest.importorskip("nvidia.nvcomp", reason="codec='ans' on CUDA needs nvidia-nvcomp-cu13")
    cfg = dlo.OffloadConfig(mode="layer", resident_layers=1, num_slots=2, codec="ans")
    stats = fuse_and_compare(folder, loras, "cuda", cfg, "after")
    assert stats["codec_bitstream"] == "nvcomp-ans-f2" and stats["host_encoded_nbytes"] > 0
    torch.cuda.synchronize()
