"""Chunk-local part of chunked KDA (everything but the state pass), forward and hand-written backward.

For each chunk (M of them at once, [M, C, *]), with q, k already L2-normalised (q scaled) and Γ the
in-chunk cumulative log decay:

    A_kk[i, j] = beta_i sum_d k_i[d] k_j[d] exp(Γ_i[d] - Γ_j[d])    j < i
    A_qk[i, j] =        sum_d q_i[d] k_j[d] exp(Γ_i[d] - Γ_j[d])    j <= i
    X = [U | W] = (I + A_kk)^-1 [beta V | beta exp(Γ) K]            (UT transform: one triangular solve)
    qg = exp(Γ) Q,  k_dec = exp(Γ_C - Γ) K

Both A's come from one batched matmul per sub-chunk row block: rows [q; beta k] * rc against columns
k * c * P (see `decay.py` for the factors and why they stay finite). Above the diagonal the products are
meaningless (and can be huge): the causal masks are applied with `where`, so they never reach the output,
and the backward only ever multiplies masked gradients.
Temporaries live in a `Workspace` so that successive groups of chunks reuse the same memory.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

from k3.ops.kda.decay import DecayFactors, decay_factors, decay_factors_backward
from k3.ops.kda.prep import L2NORM_EPS
from k3.ops.kda.scratch import Workspace
from k3.ops.kda.solve import unit_lower_solve_


@dataclass
class ChunkLocal:
    """Chunk-local tensors of M chunks, n sub-chunks of s tokens each."""

    f: DecayFactors
    l2norm: bool
    scale: float
    qn: torch.Tensor  # [M, C, K] normalised, scaled q
    kn: torch.Tensor  # [M, C, K] normalised k
    rows: torch.Tensor  # [M, n, 2, s, K]: q * rc over beta * k * rc
    kc: torch.Tensor  # [M, n, s, K]: k * c
    cols: torch.Tensor  # [M, n (a), C, K]: k_j * c_j * P[a, b(j)]
    qg: torch.Tensor  # [M, C, K]
    k_dec: torch.Tensor  # [M, C, K]


def local_factors(q, k, g, beta, sub: int, scale: float, l2norm: bool, ws: Workspace) -> ChunkLocal:
    """Raw fp32 q, k, g [M, C, K], beta [M, C] -> ChunkLocal (everything the A's, the state pass and the
    backward need, without matmuls)."""
    M, C, K = q.shape
    n = C // sub
    qn = _normalise(q, l2norm, scale, ws.get("qn", q, M, C, K))
    kn = _normalise(k, l2norm, 1.0, ws.get("kn", q, M, C, K))
    f = decay_factors(g, sub, ws)
    rows = ws.get("rows", q, M, n, 2, sub, K)
    torch.mul(qn.view(M, n, sub, K), f.rc, out=rows[:, :, 0])
    torch.mul(kn.view(M, n, sub, K), beta.view(M, n, sub, 1), out=rows[:, :, 1]).mul_(f.rc)
    kc = torch.mul(kn.view(M, n, sub, K), f.c, out=ws.get("kc", q, M, n, sub, K))
    cols = torch.mul(kc[:, None], f.P[:, :, :, None], out=ws.get("cols", q, M, n, n, sub, K))
    qg = torch.mul(rows[:, :, 0], f.e_mid[:, :, None], out=ws.get("qg", q, M, n, sub, K))
    k_dec = torch.mul(kc, f.e_tail[:, :, None], out=ws.get("k_dec", q, M, n, sub, K))
    cols, qg, k_dec = cols.view(M, n, C, K), qg.view(M, C, K), k_dec.view(M, C, K)
    return ChunkLocal(f, l2norm, scale, qn, kn, rows, kc, cols, qg, k_dec)


def local_solve(loc: ChunkLocal, v, beta, A_qk, A_kk, X, ws: Workspace) -> None:
    """v [M, C, V], beta [M, C] -> fills A_qk, A_kk [M, C, C] and X = [U | W] [M, C, V + K]."""
    M, n, _, s, K = loc.rows.shape
    C, V = n * s, v.shape[-1]
    A = ws.get("A", v, M * n, 2 * s, C)
    A = torch.bmm(loc.rows.view(M * n, 2 * s, K), loc.cols.view(M * n, C, K).mT, out=A).view(M, n, 2, s, C)
    lower, strict, _, _ = _causal_masks(C, s, v.device)
    zero = v.new_zeros(())
    torch.where(lower, A[:, :, 0], zero, out=A_qk.view(M, n, s, C))
    torch.where(strict, A[:, :, 1], zero, out=A_kk.view(M, n, s, C))
    torch.mul(v, beta[..., None], out=X[..., :V])
    torch.mul(loc.rows[:, :, 1], loc.f.e_mid[:, :, None], out=X[..., V:].unflatten(1, (n, s)))
    unit_lower_solve_(A_kk, X)  # X = (I + A_kk)^-1 R, in place


def local_backward(loc: ChunkLocal, q, k, v, beta, A_kk, X, S, dS_next, v_new, dv_new, do, ws: Workspace):
    """Gradients of the chunk-local maps given the state-pass results.

    q, k [M, C, K] raw; v [M, C, V]; beta [M, C]; A_kk, X as from `local_solve`; S, dS_next
    [M, K, V] (state entering the chunk, gradient of the state leaving it); v_new, dv_new, do [M, C, V]
    -> (dq, dk [M, C, K] w.r.t. the raw inputs, dv [M, C, V], dg [M, C, K], dbeta [M, C]).
    """
    f, (M, C, K), V = loc.f, q.shape, v.shape[-1]
    n, s = f.c.shape[1:3]
    _, _, lower_f, strict_neg = _causal_masks(C, s, q.device)
    dX = ws.get("dX", q, M, C, V + K)
    dX[..., :V] = dv_new
    dW = torch.bmm(dv_new, S.mT, out=ws.get("dW", q, M, C, K))
    torch.neg(dW, out=dX[..., V:])
    dA = ws.get("dA", q, M, n, 2, s, C)
    torch.mul(torch.bmm(do, v_new.mT).view(M, n, s, C), lower_f, out=dA[:, :, 0])
    unit_lower_solve_(A_kk, dX, transpose=True)  # dR = (I + A_kk)^-T dX
    torch.mul(torch.bmm(dX, X.mT).view(M, n, s, C), strict_neg, out=dA[:, :, 1])
    dR_v, dkbg = dX[..., :V], dX[..., V:].unflatten(1, (n, s))
    dA3 = dA.view(M * n, 2 * s, C)
    drows = torch.bmm(dA3, loc.cols.view(M * n, C, K), out=ws.get("drows", q, M * n, 2 * s, K))
    drows = drows.view(M, n, 2, s, K)
    dcols = torch.bmm(dA3.mT, loc.rows.view(M * n, 2 * s, K), out=ws.get("dcols", q, M * n, C, K))
    dcols = dcols.view(M, n, n, s, K)
    # qg = rows_q * e_mid and beta exp(Γ) k = rows_k * e_mid
    dqg = torch.bmm(do, S.mT, out=ws.get("dqg", q, M, C, K)).view(M, n, s, K)
    e_mid = f.e_mid[:, :, None]
    dmid_exp = (loc.rows[:, :, 0] * dqg).add_(loc.rows[:, :, 1] * dkbg).sum(2).mul_(f.e_mid)
    drows[:, :, 0].addcmul_(dqg, e_mid)
    drows[:, :, 1].addcmul_(dkbg, e_mid)
    drc_exp = (loc.rows * drows).sum(2)
    drows *= f.rc[:, :, None]  # -> (dq_n, d(beta k_n))
    # cols = (k c) * P
    prod = ws.get("prod", q, M, n, n, s, K)
    dP_exp = torch.mul(dcols, loc.cols.view(M, n, n, s, K), out=prod).sum(3)
    dkc = torch.mul(dcols, f.P[:, :, :, None], out=prod).sum(1)
    dk_dec = torch.bmm(v_new, dS_next.mT, out=ws.get("dk_dec", q, M, C, K)).view(M, n, s, K)
    dtail_exp = (dk_dec * loc.k_dec.view(M, n, s, K)).sum(2)
    dkc.addcmul_(dk_dec, f.e_tail[:, :, None])
    dkb = drows[:, :, 1]
    dk_n = (dkc * f.c).addcmul_(dkb, beta.view(M, n, s, 1)).view(M, C, K)
    dbeta = (dR_v * v).sum(-1) + (dkb * loc.kn.view(M, n, s, K)).sum(-1).view(M, C)
    ddecay_exp = (S * dS_next).sum(-1) * f.decay
    dg = decay_factors_backward(f, dkc * loc.kc, drc_exp, dP_exp, dmid_exp, dtail_exp, ddecay_exp)
    dq = _normalise_backward(q, loc.qn, drows[:, :, 0].reshape(M, C, K), loc.l2norm, loc.scale)
    dk = _normalise_backward(k, loc.kn, dk_n, loc.l2norm, 1.0)
    return dq, dk, dR_v * beta[..., None], dg, dbeta


def _normalise(x: torch.Tensor, l2norm: bool, scale: float, out: torch.Tensor) -> torch.Tensor:
    """scale * x / sqrt(sum_K x^2 + 1e-6) (or just scale * x)."""
    return torch.mul(x, _inv_norm(x).mul_(scale) if l2norm else scale, out=out)


def _normalise_backward(x, y, dy, l2norm: bool, scale: float) -> torch.Tensor:
    """y = scale * x * r with r = (|x|^2 + eps)^-1/2:  dx = r (scale dy - (y / scale) (y . dy))."""
    if not l2norm:
        return dy * scale
    r = _inv_norm(x)
    yy = (y * dy).sum(-1, keepdim=True).mul_(r).mul_(-1 / scale)
    return torch.mul(dy, r.mul_(scale)).addcmul_(y, yy)


def _inv_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().add_(L2NORM_EPS).rsqrt_()


@lru_cache(maxsize=32)
def _causal_masks(C: int, sub: int, device: torch.device):
    """[n, s, C] masks in sub-chunk row layout: j <= i and j < i (bool), j <= i (1.0) and j < i (-1.0)."""
    ones = torch.ones(C, C, dtype=torch.bool, device=device)
    lower, strict = ones.tril().view(C // sub, sub, C), ones.tril(-1).view(C // sub, sub, C)
    return lower, strict, lower.float(), -strict.float()
