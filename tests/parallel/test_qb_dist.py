"""Histogram Quantile Balancing vs the exact single-process form (k3.ops.moe.quantile_balance_bias)."""

import pytest
import torch

from k3.config import preset
from k3.ops.moe import quantile_balance_bias
from k3.parallel.qb_dist import (
    HistogramRouter,
    histogram_balance_bias,
    histogram_quantile,
    margin_histogram,
    margins,
    update_all_router_biases,
)

BINS, LO, HI = 512, -1.0, 1.0
WIDTH = (HI - LO) / BINS


def test_quantile_by_hand():
    hist = torch.zeros(1, 4, dtype=torch.long)  # bins [-1,-.5) [-.5,0) [0,.5) [.5,1]
    hist[0] = torch.tensor([4, 4, 2, 2])
    # 3 counts above: all 2 of the top bin + 1 of the 2 in bin [0, .5) -> .5 - (1/2)*.5 = .25
    assert histogram_quantile(hist, 3.0, -1.0, 1.0).item() == pytest.approx(0.25)
    assert histogram_quantile(hist, 0.0, -1.0, 1.0).item() == pytest.approx(1.0)


@pytest.mark.parametrize("m,E,k", [(4096, 16, 2), (3000, 32, 4), (777, 8, 1)])
def test_equals_exact_within_one_bin(m, E, k):
    g = torch.Generator().manual_seed(m)
    scores = torch.sigmoid(torch.randn(m, E, generator=g) * 1.5 + torch.linspace(-1, 1, E))
    bias = torch.randn(E, generator=g) * 0.05
    exact = quantile_balance_bias(scores, bias, k)
    # two "ranks" with micro-batches: counts add exactly
    parts = scores.split([m // 3, m // 3, m - 2 * (m // 3)])
    hist = sum(margin_histogram(margins(p, bias, k), BINS, LO, HI) for p in parts)
    tau = histogram_quantile(hist, m * k / E, LO, HI)
    b_hat_exact = exact - exact.mean()  # exact is already centred; compare b_hat up to the centring
    new = histogram_balance_bias(hist, k, LO, HI)
    assert (new - b_hat_exact).abs().max() <= 2 * WIDTH  # centring can add at most one more bin
    # the un-centred threshold: within one bin of the exact (q+1)-th largest margin
    mu = margins(scores, bias, k)
    q = m * k / E
    lo_rank, frac = int(q), q - int(q)
    desc = mu.sort(0, descending=True).values
    tau_exact = desc[lo_rank] + frac * (desc[min(lo_rank + 1, m - 1)] - desc[lo_rank])
    assert (tau - tau_exact).abs().max() <= WIDTH + 1e-6


def test_router_update_one_all_reduce(monkeypatch):
    config = preset("k3-nano")
    router = HistogramRouter(config).train()
    x = torch.randn(300, config.hidden_size)
    router(x[:100]), router(x[100:])  # two micro-batches
    calls = []
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append(t.numel()))
    model = torch.nn.ModuleList([router, HistogramRouter(config).train()])
    model[1](x)
    stats = update_all_router_biases(model)
    assert len(calls) == 1 and calls[0] == 2 * (8 + 8 * 512)
    assert stats["0"]["tokens"] == 300 and stats["1"]["tokens"] == 300
    scores = torch.sigmoid(x @ router.weight.T)
    exact = quantile_balance_bias(scores, torch.zeros(8), config.num_experts_per_token)
    assert (router.e_score_correction_bias - exact).abs().max() <= 2 * WIDTH
    assert router._hist is None and router._load is None  # cleared
    assert set(router.state_dict()) == {"weight", "e_score_correction_bias"}
