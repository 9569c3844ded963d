"""Suite-wide test settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Run torch on one thread: tiny ops are faster and timings stabler on small CI machines.

    (Small ``eigh``/GEMM calls on two contended threads are up to 100x slower.)
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
