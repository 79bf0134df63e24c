"""Attention Residuals aggregation over depth (SPEC §3.2).

Given n source vectors per token v_0..v_{n-1} (completed block representations and the running partial
sum), a pseudo-query w [D] and a key-norm weight gamma [D], computed in fp32:

    s_i = sum_c (v_i[c] / rms(v_i)) * gamma[c] * w[c],   rms(v) = sqrt(mean_c v[c]^2 + eps)
    alpha = softmax_i(s)
    out = sum_i alpha_i * v_i        (the mixture is over the RAW sources; cast back to the input dtype)

`attn_res_naive` is the plain per-source reference; `attn_res` the stacked fast path (one fused score
pass over all sources). Same signature; tests compare them forward and backward.
"""

import torch

ATTN_RES_EPS = 1e-5


def attn_res_naive(
    sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float = ATTN_RES_EPS
) -> torch.Tensor:
    """sources: n tensors [..., D] (same shape/dtype); query, norm_weight: [D] -> [..., D]."""
    if len(sources) == 1:
        return sources[0]
    qk = norm_weight.float() * query.float()
    scores = []
    for v in sources:
        vf = v.float()
        rms = torch.sqrt(vf.pow(2).mean(-1) + eps)
        scores.append((vf * qk).sum(-1) / rms)
    alpha = torch.softmax(torch.stack(scores, 0), dim=0)  # [n, ...]
    out = sum(a.unsqueeze(-1) * v.float() for a, v in zip(alpha, sources, strict=True))
    return out.to(sources[0].dtype)


def attn_res(
    sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float = ATTN_RES_EPS
) -> torch.Tensor:
    """Stacked fast path of `attn_res_naive` (same signature and result)."""
    if len(sources) == 1:
        return sources[0]
    v = torch.stack(sources, 0).float()  # [n, ..., D]
    qk = (norm_weight.float() * query.float()).reshape(-1)
    scores = (v @ qk) * torch.rsqrt(v.pow(2).mean(-1) + eps)  # [n, ...]
    alpha = torch.softmax(scores, dim=0).unsqueeze(-1)
    return (alpha * v).sum(0).to(sources[0].dtype)
