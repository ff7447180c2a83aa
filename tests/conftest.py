import os

import pytest
import torch

# The models in tests are tiny: one thread avoids OpenMP barrier stalls when other processes (peers,
# other tests) share the machine's cores. TEST_TORCH_THREADS overrides it.
torch.set_num_threads(int(os.environ.get("TEST_TORCH_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
