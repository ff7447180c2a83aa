import os

import pytest
import torch

# Tests share 2 cores with each other; keep torch from oversubscribing them.
torch.set_num_threads(int(os.environ.get("TEST_TORCH_THREADS", "2")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
