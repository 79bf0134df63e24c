"""Per-channel decay factors of chunked KDA with bounded exponents, and their backward.

Inside a chunk, A[i, j] = sum_d x_i[d] k_j[d] exp(Γ_i[d] - Γ_j[d]) (Γ the in-chunk cumulative log decay)
becomes a matmul once exp(Γ_i - Γ_j) is split as exp(Γ_i - r) exp(r - Γ_j). A single reference per
64-token chunk overflows: gates near -5 per token put Γ 320 below the chunk start, far past fp32's e^88.
So the chunk is cut into n sub-chunks of s tokens (16, as fla's safe-gate kernels). For token i in
sub-chunk a and token j in sub-chunk b, with end_b the cumulative decay at the end of sub-chunk b,
D_a = -(sum of g over sub-chunk a) >= 0 and mid_a = end_a + D_a / 2 (the midpoint):

    exp(Γ_i - Γ_j) = exp(Γ_i - mid_a) * exp(mid_a - end_b) * exp(end_b - Γ_j)
                           rc_i             P[a, b]              c_j

c lies in [e^-D_b, 1], rc in [e^-D_a/2, e^D_a/2], P[a, a] = e^(D_a/2) and P[a, b] <= 1 for b < a. The
sub-chunk size is the largest (<= 16) with every D <= 80, so all of these are normal fp32 numbers within
e^+-80. The chunk-level factors (P, exp(Γ) via e_mid, exp(Γ_C - Γ) via e_tail, the chunk retention) are
clamped at e^-80: clamping only changes products that are below e^-40 either way, and keeps exp() off
its (very slow) underflow path. Sums over sub-chunks use masked matmuls of the sub-chunk
totals, not differences of a running cumsum, so their rounding is relative to the decay actually spanned.

Every factor is exp(phi) with phi linear in g, so the backward takes d(phi) = d(factor) * factor.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

from k3.ops.kda.scratch import Workspace

SUB_CHUNK = 16
MAX_SUB_DECAY = 80.0
EXP_FLOOR = -80.0  # e^-80 ~ 1.8e-35 is still a normal fp32 number


@dataclass
class DecayFactors:
    """Factors for M chunks in sub-chunk layout (n sub-chunks of s tokens).

    c, rc [M, n, s, K]: exp(end_a - Γ_i), exp(Γ_i - mid_a).  P [M, n, n, K]: exp(mid_a - end_b) for
    b <= a (e^-80 above).  e_mid, e_tail [M, n, K]: exp(mid_a), exp(Γ_C - end_a).  decay [M, K]: exp(Γ_C).
    The *_exp fields are the unclamped exponents, kept for the clamp masks of the backward.
    """

    sub: int
    c: torch.Tensor
    rc: torch.Tensor
    P: torch.Tensor
    e_mid: torch.Tensor
    e_tail: torch.Tensor
    decay: torch.Tensor
    P_exp: torch.Tensor
    mid_exp: torch.Tensor
    tail_exp: torch.Tensor
    decay_exp: torch.Tensor


def pick_sub_chunk(g: torch.Tensor) -> int:
    """g [..., C, K] -> largest power-of-two sub-chunk (<= 16) over which no channel decays by > 80."""
    C, g = g.shape[-2], g.detach()
    sub = min(SUB_CHUNK, C)
    while sub > 1 and -float(g.unflatten(-2, (C // sub, sub)).sum(-2).min()) > MAX_SUB_DECAY:
        sub //= 2
    return sub


def decay_factors(g: torch.Tensor, sub: int, ws: Workspace) -> DecayFactors:
    """g: per-token log decay [M, C, K] (<= 0) -> DecayFactors for sub-chunks of `sub` tokens."""
    M, C, K = g.shape
    n = C // sub
    buf = lambda name: ws.get(name, g, M, n, sub, K)
    gin = torch.cumsum(g.view(M, n, sub, K), -2, out=buf("gin"))  # in-sub-chunk inclusive cumsum
    tot = gin[:, :, -1, :]  # [M, n, K] = -D
    c = torch.sub(tot[:, :, None, :], gin, out=buf("c")).exp_()
    rc = torch.reciprocal(c, out=buf("rc")).mul_(torch.mul(tot, 0.5).exp_()[:, :, None, :])
    m = _block_masks(n, g.device)
    P_exp = (m.between @ tot).view(M, n, n, K) + m.coef[:, :, None] * tot[:, :, None, :] + m.above[:, :, None]
    mid_exp = m.before @ tot + 0.5 * tot
    tail_exp = m.after @ tot
    decay_exp = tot.sum(1)
    exps = (_exp(P_exp), _exp(mid_exp), _exp(tail_exp), _exp(decay_exp))
    return DecayFactors(sub, c, rc, *exps, P_exp, mid_exp, tail_exp, decay_exp)


def decay_factors_backward(f: DecayFactors, dc_exp, drc_exp, dP_exp, dmid_exp, dtail_exp, ddecay_exp):
    """Gradients w.r.t. the exponents of c, rc [M, n, s, K], P [M, n, n, K], e_mid, e_tail [M, n, K],
    decay [M, K] -> dg [M, C, K]. Gradients through clamped exponents are zero."""
    M, n, s, K = f.c.shape
    m = _block_masks(n, f.c.device)
    dP_exp = dP_exp * (f.P_exp > EXP_FLOOR)
    dmid_exp = dmid_exp * (f.mid_exp > EXP_FLOOR)
    dtail_exp = dtail_exp * (f.tail_exp > EXP_FLOOR)
    ddecay_exp = ddecay_exp * (f.decay_exp > EXP_FLOOR)
    # tot feeds c, rc (per token), P, mid, tail and the chunk decay (per sub-chunk)
    dtot = (dc_exp - 0.5 * drc_exp).sum(2)
    dtot += m.between.T @ dP_exp.reshape(M, n * n, K) + (m.coef[:, :, None] * dP_exp).sum(2)
    dtot += m.before.T @ dmid_exp + 0.5 * dmid_exp + m.after.T @ dtail_exp + ddecay_exp[:, None, :]
    dgin = drc_exp - dc_exp
    dgin[:, :, -1, :] += dtot  # tot is the last entry of the in-sub-chunk cumsum
    # reverse cumsum over the sub-chunk: dg_i = sum_{t >= i} dgin_t
    dg = dgin.sum(2, keepdim=True) - dgin.cumsum(2) + dgin
    return dg.view(M, n * s, K)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(min=EXP_FLOOR).exp()


@dataclass
class _Masks:
    before: torch.Tensor  # [n, n]: c < a
    after: torch.Tensor  # [n, n]: c > a
    between: torch.Tensor  # [n * n, n]: b < c < a, rows indexed (a, b)
    coef: torch.Tensor  # [n, n]: +1/2 below the diagonal, -1/2 on it (the mid_a - end_b offset)
    above: torch.Tensor  # [n, n]: a large negative exponent above the diagonal (P there is unused)


@lru_cache(maxsize=32)
def _block_masks(n: int, device: torch.device) -> _Masks:
    i = torch.arange(n, device=device)
    a, b, c = i[:, None, None], i[None, :, None], i[None, None, :]
    before = (i[None, :] < i[:, None]).float()
    between = ((b < c) & (c < a)).float().view(n * n, n)
    coef = before * 0.5 - torch.eye(n, device=device) * 0.5
    above = before.T * (2 * EXP_FLOOR)
    return _Masks(before, before.T.contiguous(), between, coef, above)
