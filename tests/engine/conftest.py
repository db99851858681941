import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    """The engine tests use tiny float64 tensors: intra-op threads only add overhead (and stall badly
    when the machine is shared), so run them single-threaded and restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
