import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(
        reason="needs two CUDA GPUs (on a GPU node: bash launch/gpu_suite.sh OUT tests)"
    )
    for item in items:
        if "tests/multigpu/" in str(item.fspath):
            item.add_marker(skip)
