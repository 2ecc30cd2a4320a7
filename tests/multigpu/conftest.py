import pytest
import torch

from dlo.platform.env import share_gpu


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Two GPUs, or one under ``DLO_SHARE_GPU=1`` (the one-GPU multi-rank lane: every rank on
    that GPU, gloo between them; see [Note: ranks sharing a GPU] in dlo/platform/sharing.py)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2 or (count >= 1 and share_gpu()):
        return
    skip = pytest.mark.skip(
        reason="needs two CUDA GPUs, or one with DLO_SHARE_GPU=1 "
        "(on a GPU node: bash launch/gpu_suite.sh OUT tests, or OUT lane on one GPU)"
    )
    for item in items:
        if "tests/multigpu/" in str(item.fspath):
            item.add_marker(skip)
