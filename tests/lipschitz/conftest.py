import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    """Tiny float64 tensors: intra-op threads only add overhead on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
