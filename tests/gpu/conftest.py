import pytest
import torch

collect_ignore_glob: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (on a GPU node: bash launch/gpu_suite.sh OUT tests)"
    )
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
