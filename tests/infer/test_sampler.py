"""Greedy selection: the same token as torch's argmax, ties and NaN included."""

import torch

from k3.infer.sampler import sample
from k3.infer.sequence import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_greedy_is_torch_argmax():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randn(1000, generator=g)
        assert sample(x, GREEDY) == int(x.argmax())


def test_greedy_ties_take_the_first_and_nan_counts_as_the_maximum():
    x = torch.zeros(64)
    x[[7, 30]] = 3.0
    assert sample(x, GREEDY) == int(x.argmax()) == 7
    x[12] = float("nan")
    assert sample(x, GREEDY) == int(x.argmax()) == 12


def test_greedy_reads_a_row_of_a_batch():
    x = torch.randn(4, 3, 50)
    x[2, -1, 41] = 100.0
    assert sample(x[2][-1], GREEDY) == 41
