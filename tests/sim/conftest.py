"""Simulator tests run torch on one thread: the model is tiny, and a second thread only waits on a shared host."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
