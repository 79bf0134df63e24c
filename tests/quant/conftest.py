"""Shared fixtures of the quantization tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # tiny ops: threads only contend
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
