"""Forward chunk-local maps of chunked KDA with the chunk cut in two halves (the fast forward case).

`intra.py` cuts a chunk into sub-chunks of <= 16 tokens so that every factor stays within e^+-40, and
pays for it with one column matrix per (chunk, row sub-chunk) and a 3/8-empty A product. When every
half-chunk decays by at most 140 per channel (C = 64 and the K3 safe gate -5 sigmoid(z) average ~80
per half), two blocks suffice. With h = C / 2, Γ the in-chunk cumulative log decay, gin the cumulative
log decay inside the token's half (<= 0), tot_a its value at the end of half a and mid_a = start_a +
tot_a / 2:

    diagonal blocks   exp(Γ_i - Γ_j) = exp(Γ_i - mid_a) * exp(mid_a - Γ_j)        both in e^+-70
    lower-left block  exp(Γ_i - Γ_j) = exp(gin_i) * exp(tot_0 - gin_j)            both <= 1

so A's three non-zero blocks are two batched matmuls with no per-block column copies. Every other
factor is a product of terms <= 1 (exp(Γ) Q = exp(gin) exp(start_a) Q, ...), so an underflow to zero
is always an underflow of the true value. The diagonal products above the causal diagonal can overflow;
they are dropped with `where` (never multiplied). q, k must be L2-normalised (|q|, |k| <= scale, 1), so
that q * e^70 stays finite.

This path only fills what the forward needs and the backward keeps (A_qk, A_kk, X = [U | W]) plus
exp(Γ) Q, exp(Γ_C - Γ) K and the chunk retention; the backward recomputes `intra.local_factors`.

`halves_local` runs the elementwise part (norms, in-half cumulative decay, the exponentials and all
the scaled rows and columns; then the causal copy of A_qk) as one C pass per group when a compiler is
available (`k3/ops/csrc/kda_halves.c`, built by `k3.ops.native`), else as torch ops:
`halves_local_reference` is that torch path, with the same signature (tests compare them).
"""

import ctypes
from functools import lru_cache

import torch

from k3.ops import native
from k3.ops.kda.prep import L2NORM_EPS
from k3.ops.kda.scratch import Workspace
from k3.ops.kda.solve import unit_lower_solve_blocks_

MAX_HALF_DECAY = 140.0  # factors >= e^-70 keep q, k components down to ~e^-17 of the largest normal
EXP_FLOOR = -87.0  # e^-87 ~ 1.6e-38 is still a normal fp32 number
MAX_SCALE = 64.0  # q * scale * e^70 must stay far below fp32's max (~e^88.7)


def halves_fit(g: torch.Tensor, l2norm: bool, scale: float) -> bool:
    """g [..., C, K] (log decay, <= 0) -> whether the two-half forward applies: q, k normalised, a
    moderate scale and no half-chunk decaying by more than MAX_HALF_DECAY in any channel."""
    if not l2norm or abs(scale) > MAX_SCALE or g.shape[-2] < 2:
        return False
    C = g.shape[-2]
    return -float(g.detach().unflatten(-2, (2, C // 2)).sum(-2).min()) <= MAX_HALF_DECAY


def halves_local(q, k, v, g, beta, scale: float, A_qk, A_kk, X, ws: Workspace):
    """`halves_local_reference` with its elementwise part in one native pass when the kernel is built."""
    prep = native.function("kda_halves", "k3_kda_halves_prep", _PREP_ARGS)
    causal_rows = native.function("kda_halves", "k3_kda_causal_rows", _CAUSAL_ROWS_ARGS)
    if prep is None or not _native_fits(q, k, v, g, beta, A_qk, X):
        return halves_local_reference(q, k, v, g, beta, scale, A_qk, A_kk, X, ws)
    G, BH, C, K = q.shape
    M, V, h = G * BH, v.shape[-1], C // 2
    rows, cols = ws.get("rows", q, G, BH, 2, 2, h, K), ws.get("cols", q, G, BH, 2, 2, h, K)
    qg, k_dec, decay = ws.get("qg", q, M, C, K), ws.get("k_dec", q, M, C, K), ws.get("decay", q, M, K)
    prep(
        *(arg for t in (q, k, v, g, beta) for arg in (t.data_ptr(), _Strides3(*t.stride()[:3]))),
        G, BH, C, K, V, float(scale), L2NORM_EPS,
        *(t.data_ptr() for t in (rows, cols, qg, X, k_dec, decay)),
    )  # fmt: skip
    A = torch.bmm(rows.view(2 * M, 2 * h, K), cols.view(2 * M, C, K).mT, out=ws.get("A", q, 2 * M, 2 * h, C))
    causal_rows(A.data_ptr(), A_qk.data_ptr(), M, C)
    A_k = A.view(M, 2, 2, h, C)[:, :, 1]
    if A_kk is not None:
        A_kk.view(M, 2, h, C).copy_(A_k)
    unit_lower_solve_blocks_(A_k[:, 0, :, :h], A_k[:, 1, :, :h], A_k[:, 1, :, h:], X)
    return qg, k_dec, decay


def halves_local_reference(q, k, v, g, beta, scale: float, A_qk, A_kk, X, ws: Workspace):
    """Raw fp32 q, k, g [G, BH, C, K], v [G, BH, C, V], beta [G, BH, C] (any strides: the chunked views
    of the caller's tensors) -> fills A_qk and X = [U | W] [M, C, V + K] (M = G BH), and A_kk [M, C, C]
    unless it is None (only its strictly lower triangle is meaningful: what the backward's solve reads);
    returns qg = exp(Γ) q, k_dec = exp(Γ_C - Γ) k [M, C, K] and the chunk retention exp(Γ_C) [M, K]."""
    G, BH, C, K = q.shape
    M, V, h = G * BH, v.shape[-1], C // 2
    half = lambda t: t.unflatten(-2, (2, h))  # noqa: E731  [G, BH, 2, h, *]
    buf = lambda name, *shape: ws.get(name, q, G, BH, *shape)  # noqa: E731
    gin = torch.cumsum(half(g), -2, out=buf("gin", 2, h, K))
    tot = gin[..., -1:, :]  # [G, BH, 2, 1, K]
    rc = torch.sub(gin, tot, alpha=0.5, out=buf("rc", 2, h, K)).exp_()  # exp(Γ_i - mid_a)
    cd = torch.reciprocal(rc, out=buf("cd", 2, h, K))  # exp(mid_a - Γ_j)
    iq, ik = half(_inv_norm(q).mul_(scale)), half(_inv_norm(k))
    rows = buf("rows", 2, 2, h, K)  # [G, BH, half, (q | beta k), h, K]: one taller matmul for both A's
    rows_q = torch.mul(half(q), rc, out=rows[:, :, :, 0]).mul_(iq)
    rows_k = torch.mul(half(k), rc, out=rows[:, :, :, 1]).mul_(ik * half(beta[..., None]))
    # cols[a] [C, K]: k_j exp(mid_a - Γ_j) for the columns row half a needs (j < (a + 1) h), else 0
    cols = buf("cols", 2, 2, h, K)
    for a in range(2):
        torch.mul(half(k)[:, :, a], cd[:, :, a], out=cols[:, :, a, a]).mul_(ik[:, :, a])
    # exp(mid_1 - Γ_j) = exp(mid_0 - Γ_j) exp(tot_0 / 2) exp(tot_1 / 2), every step a normal number or
    # a true value below e^-87 (their product exp(mid_1 - mid_0) alone could underflow)
    e_half = torch.mul(tot, 0.5).exp_()
    torch.mul(cols[:, :, 0, 0], e_half[:, :, 0], out=cols[:, :, 1, 0]).mul_(e_half[:, :, 1])
    cols[:, :, 0, 1] = 0
    A = torch.bmm(rows.view(2 * M, 2 * h, K), cols.view(2 * M, C, K).mT, out=ws.get("A", q, 2 * M, 2 * h, C))
    A = A.view(M, 2, 2, h, C)
    # A_qk's products above the diagonal can overflow: `where` drops them
    torch.where(_causal_mask(h, q.device), A[:, :, 0], A.new_zeros(()), out=A_qk.view(M, 2, h, C))
    A_k = A[:, :, 1]  # [M, 2, h, C]: the solve reads only below the diagonal, so no mask is needed there
    if A_kk is not None:
        A_kk.view(M, 2, h, C).copy_(A_k)
    # exp(Γ_i) = exp(Γ_i - mid_a) exp(mid_a), exp(Γ_C - Γ_j) = exp(mid_a - Γ_j) exp(Γ_C - mid_a): the
    # second factors are <= 1; where they underflow the true product is below e^(70 - 87)
    e_mid = _exp(torch.cat([tot[:, :, :1] * 0.5, tot[:, :, :1] + 0.5 * tot[:, :, 1:]], 2))
    decay = tot.sum(2, keepdim=True)  # Γ_C [G, BH, 1, 1, K]
    e_tail = _exp(torch.cat([decay - 0.5 * tot[:, :, :1], 0.5 * tot[:, :, 1:]], 2))
    qg = torch.mul(rows_q, e_mid, out=buf("qg", 2, h, K)).view(M, C, K)
    torch.mul(rows_k, e_mid, out=half(X[..., V:].view(G, BH, C, K)))
    torch.mul(v, beta[..., None], out=X[..., :V].view(G, BH, C, V))
    k_dec = buf("k_dec", 2, h, K)
    for a in range(2):
        torch.mul(cols[:, :, a, a], e_tail[:, :, a], out=k_dec[:, :, a])
    unit_lower_solve_blocks_(A_k[:, 0, :, :h], A_k[:, 1, :, :h], A_k[:, 1, :, h:], X)  # X = (I + A_kk)^-1 R
    return qg, k_dec.view(M, C, K), _exp(decay.view(M, K))


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp with the exponent clamped at EXP_FLOOR (in place): keeps exp off its very slow underflow path;
    the factors it is used for multiply terms <= e^70, so the change is below e^-17 of the largest."""
    return x.clamp_(min=EXP_FLOOR).exp_()


def _inv_norm(x: torch.Tensor) -> torch.Tensor:
    """(|x|^2 + eps)^-1/2 over the last dim -> [..., 1] (the fla in-kernel L2 norm)."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().add_(L2NORM_EPS).rsqrt_()


@lru_cache(maxsize=16)
def _causal_mask(h: int, device: torch.device) -> torch.Tensor:
    """[2, h, 2h] mask j <= i in row-half layout (row i = a h + r, column j)."""
    return torch.ones(2 * h, 2 * h, dtype=torch.bool, device=device).tril().view(2, h, 2 * h)


class _Strides3(ctypes.Structure):
    """(chunk, head, token) strides of a chunked input, in elements (the kernel's `strides3`)."""

    _fields_ = [("g", ctypes.c_int64), ("bh", ctypes.c_int64), ("t", ctypes.c_int64)]


def _native_fits(q, k, v, g, beta, A_qk, X) -> bool:
    """The native kernel's layout: fp32 CPU tensors, unit channel strides, A_qk and X contiguous."""
    if not native.fp32_cpu(q, k, v, g, beta, A_qk, X):
        return False
    return all(t.stride(-1) == 1 for t in (q, k, v, g)) and A_qk.is_contiguous() and X.is_contiguous()


# k3_kda_halves_prep(q, sq, k, sk, v, sv, g, sg, beta, sb, G, BH, C, K, V, scale, eps, rows, cols, qg, X,
# kdec, decay) and k3_kda_causal_rows(A, A_qk, M, C)
_PREP_ARGS = [native.PTR, _Strides3] * 5 + [native.I64] * 5 + [native.F32] * 2 + [native.PTR] * 6
_CAUSAL_ROWS_ARGS = [native.PTR, native.PTR, native.I64, native.I64]
