"""Session fixtures: one tiny random checkpoint per supported family."""

from __future__ import annotations

import pytest
import torch
from target_runner_testlib import FAMILIES, save_random_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (checkpoint folder, transformers reference model in fp32)."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, save_random_checkpoint(path, family))
    return out


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core machine OpenMP's
    thread hand-offs cost more than the work; restored afterwards for other test folders."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
