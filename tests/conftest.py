import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); run on the H200, see bench/README.md")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
