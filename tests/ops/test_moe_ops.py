"""MoE pure functions: route(), experts_grouped vs experts_reference (forward + backward), bias updates."""

import math

import pytest
import torch

from k3.ops.glu import situ_glu, swiglu
from k3.ops.moe import (
    expert_load,
    experts_grouped,
    experts_reference,
    quantile_balance_bias,
    route,
    sign_update_bias,
)


def assert_close(name, got, want, rtol):
    """Relative error max|got - want| / max|want|, reported with the tensor's name."""
    err = (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)
    assert err <= rtol, f"{name}: rel err {err:.3e} > {rtol:.0e}"


def _logits(T=256, E=16, seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 2.0


# ---- route ------------------------------------------------------------------------------------------
def test_route_weights_renormalized_and_scaled():
    logits = _logits()
    bias = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.3
    w, idx, s = route(logits, bias, top_k=4, renormalize=True, scaling=2.5)
    assert w.shape == idx.shape == (256, 4) and w.dtype == torch.float32 and s.shape == (256, 16)
    torch.testing.assert_close(s, torch.sigmoid(logits))
    torch.testing.assert_close(w.sum(-1), torch.full((256,), 2.5))
    torch.testing.assert_close(idx, (s + bias).topk(4, dim=-1).indices)  # selection on s + b
    g = s.gather(1, idx)
    torch.testing.assert_close(w, 2.5 * g / g.sum(-1, keepdim=True))  # weights from the unbiased s
    w_raw, _, _ = route(logits, bias, top_k=4, renormalize=False, scaling=2.5)
    torch.testing.assert_close(w_raw, 2.5 * g)


def test_route_bias_changes_selection_not_weights():
    logits = _logits(T=512)
    bias = torch.zeros(16)
    bias[3] = 0.4
    bias[7] = -0.4
    w0, i0, _ = route(logits, torch.zeros(16), 4)
    w1, i1, _ = route(logits, bias, 4)
    same = (i0.sort(-1).values == i1.sort(-1).values).all(-1)
    assert 0 < same.sum() < 512  # the bias moved some selections and left others
    # for the same chosen set, identical weights (compare per expert id)
    d0 = torch.zeros(512, 16).scatter_(1, i0, w0)
    d1 = torch.zeros(512, 16).scatter_(1, i1, w1)
    torch.testing.assert_close(d0[same], d1[same], rtol=1e-6, atol=0)  # up to the sum's order
    # a huge bias forces expert 5 into every token, with weight s_5 / Σ_topk s
    force = torch.zeros(16)
    force[5] = 10.0
    w, idx, s = route(logits, force, 4)
    assert (idx == 5).any(-1).all()
    torch.testing.assert_close((w * (idx == 5)).sum(-1), s[:, 5] / s.gather(1, idx).sum(-1))


def test_route_gradient_reaches_logits_only_through_weights():
    logits = _logits().requires_grad_(True)
    bias = torch.zeros(16, requires_grad=True)
    w, _, _ = route(logits, bias, 4, renormalize=False)
    (w * torch.arange(4.0)).sum().backward()
    assert logits.grad.abs().sum() > 0 and torch.isfinite(logits.grad).all()
    assert bias.grad is None  # selection is not differentiable


def test_route_group_limited():
    logits = _logits(T=128, E=16)
    w, idx, s = route(logits, torch.zeros(16), 4, num_expert_group=4, topk_group=2)
    group_score = s.view(128, 4, 4).topk(2, dim=-1).values.sum(-1)
    allowed = group_score.topk(2, dim=-1).indices  # [T, 2]
    assert ((idx // 4)[..., None] == allowed[:, None, :]).any(-1).all()
    masked = s.view(128, 4, 4).clone()
    keep = torch.zeros(128, 4, dtype=torch.bool).scatter_(1, allowed, True)
    masked[~keep] = float("-inf")
    torch.testing.assert_close(idx, masked.view(128, 16).topk(4, dim=-1).indices)
    w1, i1, _ = route(logits, torch.zeros(16), 4, num_expert_group=1, topk_group=1)
    torch.testing.assert_close(i1, route(logits, torch.zeros(16), 4)[1])


def test_route_bad_inputs():
    logits = _logits()
    with pytest.raises(ValueError, match="top_k"):
        route(logits, torch.zeros(16), 17)
    with pytest.raises(ValueError, match="bias_E"):
        route(logits, torch.zeros(15), 4)
    with pytest.raises(ValueError, match="logits_TE"):
        route(logits[0], torch.zeros(16), 4)
    with pytest.raises(ValueError, match="num_expert_group"):
        route(logits, torch.zeros(16), 4, num_expert_group=3)


def test_expert_load():
    idx = torch.tensor([[0, 2], [2, 3], [0, 2]])
    assert expert_load(idx, 5).tolist() == [2, 0, 3, 1, 0]


# ---- expert compute ---------------------------------------------------------------------------------
CASES = [(64, 8, 2, 16, 24), (37, 16, 4, 32, 16), (5, 32, 3, 8, 12)]  # the last leaves experts empty


@pytest.mark.parametrize(
    "T,E,k,Dl,I", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}-Dl{c[3]}-I{c[4]}" for c in CASES]
)
@pytest.mark.parametrize("act", [situ_glu, swiglu], ids=["situ", "silu"])
def test_grouped_matches_naive_fwd_bwd(T, E, k, Dl, I, act):
    g = torch.Generator().manual_seed(T * E)
    z = torch.randn(T, Dl, generator=g)
    w1, w3 = torch.randn(E, I, Dl, generator=g) * 0.3, torch.randn(E, I, Dl, generator=g) * 0.3
    w2 = torch.randn(E, Dl, I, generator=g) * 0.3
    weights, indices, _ = route(torch.randn(T, E, generator=g), torch.zeros(E), k)
    leaves = [t.clone().requires_grad_(True) for t in (z, weights, w1, w2, w3)]
    du = torch.randn(T, Dl, generator=g)
    grads = {}
    for name, fn in (("reference", experts_reference), ("grouped", experts_grouped)):
        xs = [t.detach().clone().requires_grad_(True) for t in leaves]
        u = fn(xs[0], xs[1], indices, xs[2], xs[3], xs[4], act)
        (u * du).sum().backward()
        grads[name] = [u.detach()] + [x.grad for x in xs]
    for tname, a, b in zip(
        ("u", "dz", "dweights", "dw1", "dw2", "dw3"), grads["grouped"], grads["reference"], strict=True
    ):
        assert_close(tname, a, b, 1e-5)
    if T * k < E:  # an expert that received no token has zero gradient
        unused = expert_load(indices, E) == 0
        assert unused.any() and grads["grouped"][3][unused].abs().max() == 0


def test_grouped_bf16_and_shapes():
    g = torch.Generator().manual_seed(0)
    T, E, k, Dl, I = 48, 8, 2, 16, 32
    z = torch.randn(T, Dl, generator=g).bfloat16()
    w = [(torch.randn(*s, generator=g) * 0.3).bfloat16() for s in ((E, I, Dl), (E, Dl, I), (E, I, Dl))]
    weights, indices, _ = route(torch.randn(T, E, generator=g), torch.zeros(E), k)
    a = experts_grouped(z, weights, indices, *w, situ_glu)
    b = experts_reference(z, weights, indices, *w, situ_glu)
    assert a.dtype == torch.bfloat16 and a.shape == (T, Dl)
    assert_close("u_bf16", a.float(), b.float(), 1e-2)
    with pytest.raises(ValueError, match="w1"):
        experts_grouped(z, weights, indices, w[0], w[0], w[2], situ_glu)
    with pytest.raises(ValueError, match="indices"):
        experts_grouped(z, weights, indices[:-1], *w, situ_glu)


# ---- bias updates -----------------------------------------------------------------------------------
def _margins(scores, bias, k):
    cutoff = (scores + bias).topk(k + 1, dim=-1).values[:, k]
    return scores - cutoff[:, None]


def test_quantile_balance_integer_q_exact():
    m, E, k = 1024, 16, 4  # q = 256
    g = torch.Generator().manual_seed(0)
    scores = torch.sigmoid(torch.randn(m, E, generator=g) + torch.linspace(-2, 2, E))
    bias = torch.randn(E, generator=g) * 0.1
    new = quantile_balance_bias(scores, bias, k)
    mu = _margins(scores, bias, k)
    tau = mu.sort(0, descending=True).values[256]  # the (q+1)-th largest margin per expert
    torch.testing.assert_close(new, -tau + tau.mean())
    assert abs(new.mean().item()) < 1e-6
    # at most q margins exceed -b̂_j, exactly q unless margins tie at the (q+1)-th (see docs/architecture.md)
    above, at_or_above = (mu > tau).sum(0), (mu >= tau).sum(0)
    assert (above <= 256).all() and (at_or_above >= 257).all() and (above == 256).sum() >= 8


def test_quantile_balance_fractional_q_interpolates():
    m, E, k = 1000, 16, 3  # q = 187.5
    g = torch.Generator().manual_seed(1)
    scores = torch.sigmoid(torch.randn(m, E, generator=g))
    bias = torch.zeros(E)
    mu = _margins(scores, bias, k)
    q = m * k / E
    # the documented rule = torch.quantile (linear) at ascending position m-1-q, i.e. level (m-1-q)/(m-1)
    tau = torch.quantile(mu.double(), (m - 1 - q) / (m - 1), dim=0).float()
    new = quantile_balance_bias(scores, bias, k)
    torch.testing.assert_close(new, -tau + tau.mean(), atol=1e-6, rtol=0)
    above, at_or_above = (mu > tau).sum(0), (mu >= tau).sum(0)
    assert (above <= math.ceil(q)).all() and (at_or_above >= math.floor(q) + 1).all()
    assert quantile_balance_bias(scores, bias, E).abs().max() == 0  # k = E: nothing to balance


def test_sign_update():
    load = torch.tensor([10, 30, 20, 20])
    bias = torch.tensor([0.0, 0.5, -0.5, 1.0])
    torch.testing.assert_close(sign_update_bias(load, bias, 0.1), torch.tensor([0.1, 0.4, -0.5, 1.0]))
    with pytest.raises(ValueError, match="load_E"):
        sign_update_bias(load[:3], bias, 0.1)
