"""Shared fixtures for the engine tests: a random-init k3-nano model in fp32 (one CPU thread: tiny ops)."""

import pytest
import torch

from k3.config import preset
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # restored after each module, so other test directories keep their thread count
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def nano():
    config = preset("k3-nano").replace(dtype="float32")
    model = K3ForCausalLM(config)
    init_weights(model, 0.5, config.num_hidden_layers, seed=0)  # large init: peaked, input-dependent logits
    return model.eval()


def make_prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="session")
def prompt():
    """prompt(n, seed) -> n random token ids in [0, 256)."""
    return make_prompt
