"""QK-Clip on a small synthetic MLA layer: logits capped at tau, untouched heads and v rows bit-exact."""

import pytest
import torch

from k3.optim.qk_clip import clip_factors, qk_clip_

H, DN, DR, DV, Q_LORA, KV_LORA, T = 4, 8, 4, 6, 16, 12, 10


def _layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    w_qb = torch.randn(H * (DN + DR), Q_LORA, generator=g)
    w_kvb = torch.randn(H * (DN + DV), KV_LORA, generator=g)
    c_q, c_kv = torch.randn(T, Q_LORA, generator=g), torch.randn(T, KV_LORA, generator=g)
    k_pe = torch.randn(T, DR, generator=g)  # shared by all heads, not touched by the clip
    return w_qb, w_kvb, c_q, c_kv, k_pe


def _max_logits(w_qb, w_kvb, c_q, c_kv, k_pe):
    """Per-head max of q_nope . k_nope + q_pe . k_pe over all (query, key) pairs: [H]."""
    q = (c_q @ w_qb.T).view(T, H, DN + DR)
    kv = (c_kv @ w_kvb.T).view(T, H, DN + DV)
    q_nope, q_pe, k_nope = q[..., :DN], q[..., DN:], kv[..., :DN]
    scores = torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_pe, k_pe)
    return scores.flatten(1).amax(dim=1)


def test_clip_caps_logits_at_tau():
    w_qb, w_kvb, c_q, c_kv, k_pe = _layer()
    s_max = _max_logits(w_qb, w_kvb, c_q, c_kv, k_pe)
    tau = s_max.median().item()  # clip about half of the heads
    clipped = s_max > tau
    assert 0 < clipped.sum() < H
    w_qb0, w_kvb0 = w_qb.clone(), w_kvb.clone()
    gamma = qk_clip_(w_qb, w_kvb, s_max, DN, DR, DV, tau=tau)
    after = _max_logits(w_qb, w_kvb, c_q, c_kv, k_pe)
    assert (after <= tau * (1 + 1e-5)).all()
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, gamma * s_max, rtol=1e-5, atol=1e-5)
    qv, qv0 = w_qb.view(H, DN + DR, -1), w_qb0.view(H, DN + DR, -1)
    kvv, kvv0 = w_kvb.view(H, DN + DV, -1), w_kvb0.view(H, DN + DV, -1)
    assert torch.equal(qv[~clipped], qv0[~clipped])  # heads below tau: bit-exact
    assert torch.equal(kvv[~clipped], kvv0[~clipped])
    assert torch.equal(kvv[:, DN:], kvv0[:, DN:])  # v rows never touched
    h = int(clipped.nonzero()[0])
    torch.testing.assert_close(qv[h, DN:], gamma[h] * qv0[h, DN:])  # q_pe by gamma
    torch.testing.assert_close(qv[h, :DN], gamma[h].sqrt() * qv0[h, :DN])  # q_nope by sqrt(gamma)


def test_clip_factors():
    gamma = clip_factors(torch.tensor([50.0, 100.0, 200.0, -300.0, float("nan")]), tau=100.0)
    assert gamma.tolist()[:4] == [1.0, 1.0, 0.5, 1.0] and gamma[4] == 1.0


def test_no_clip_below_tau_is_bit_exact_bf16():
    w_qb, w_kvb, *_ = _layer(1)
    w_qb, w_kvb = w_qb.bfloat16(), w_kvb.bfloat16()
    w_qb0, w_kvb0 = w_qb.clone(), w_kvb.clone()
    gamma = qk_clip_(w_qb, w_kvb, torch.full((H,), 99.0), DN, DR, DV)
    assert torch.equal(gamma, torch.ones(H)) and torch.equal(w_qb, w_qb0) and torch.equal(w_kvb, w_kvb0)


def test_bad_shapes():
    w_qb, w_kvb, *_ = _layer()
    with pytest.raises(ValueError, match="q_b_weight"):
        qk_clip_(w_qb[:-1], w_kvb, torch.ones(H), DN, DR, DV)
    with pytest.raises(ValueError, match="kv_b_weight"):
        qk_clip_(w_qb, w_kvb, torch.ones(H), DN, DR, DV + 1)
    with pytest.raises(ValueError, match="s_max"):
        qk_clip_(w_qb, w_kvb, torch.ones(H, 1), DN, DR, DV)
