"""Draft-worker tests: `draft_testlib` (toy bigram proposer, batch builders) sits beside them."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Many tiny ops: on the shared 2-core machine intra-op threads only spin against each
    other. Restored afterwards for other test folders."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
