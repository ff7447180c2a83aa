import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models: one thread avoids OpenMP barrier stalls when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
