import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny CPU problems: one thread is faster and does not stall on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
