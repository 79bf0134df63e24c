"""KDA recurrence vectorised over batch and heads: the decode path (T is usually 1).

Same maths and signature as `recurrent_kda_reference`; each step is a decay, two mat-vecs and a rank-1
update of the fp32 state. Large states use batched matmuls for the mat-vecs (one read of the state:
~1.6x faster than multiply + sum at B=4, H=96, K=V=128); small ones use multiply + sum, which stays on
one thread (a per-token parallel BLAS call costs more than the work, badly so on a busy machine).
Packed documents (`cu_seqlens`) are laid out one per row ([N, T_max], zero-padded at the end, which
leaves each final state exact) so all documents advance together.
"""

import torch

from k3.ops.kda import varlen
from k3.ops.kda.prep import check_inputs, doc_lengths, prepare

MATVEC_BMM_MIN = 1 << 16  # state elements (B H K V) from which the mat-vecs go through bmm


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] fp32
    (or [N, H, K, V] with cu_seqlens [N+1], B == 1).

    Returns o [B, T, H, V] in v's dtype and the final state (fp32 [B or N, H, K, V]) or None.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    dtype = v.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    if cu_seqlens is None:
        o, state = _recurrence(q, k, v, g, beta, initial_state)
    else:
        lengths = doc_lengths(cu_seqlens)
        n, t_max = len(lengths), max(lengths)
        index = varlen.token_index(lengths, [i * t_max for i in range(n)], q.device)
        rows = [varlen.scatter_tokens(x[0], index, n * t_max) for x in (q, k, v, g, beta)]
        o, state = _recurrence(*(x.unflatten(0, (n, t_max)) for x in rows), initial_state)
        o = varlen.gather_tokens(o.flatten(0, 1), index)[None]
    return o.to(dtype), state if output_final_state else None


def _recurrence(q, k, v, g, beta, initial_state):
    """fp32 q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] -> (o [B, T, H, V], S [B, H, K, V])."""
    B, _, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    rows = (q[..., None, :], k[..., None, :], v[..., None, :], g.exp()[..., None], beta[..., None, None])
    matvec = _matvec_bmm if S.numel() >= MATVEC_BMM_MIN else _matvec_sum
    outs = []
    for q_t, k_t, v_t, decay_t, b_t in zip(*(x.unbind(1) for x in rows), strict=True):  # q_t [B, H, 1, K]
        S = S * decay_t
        u = b_t * (v_t - matvec(k_t, S))  # [B, H, 1, V]
        S = S.addcmul(k_t.mT, u)
        outs.append(matvec(q_t, S))
    return torch.cat(outs, 2).transpose(1, 2), S


def _matvec_bmm(x, S):
    """x [B, H, 1, K], S [B, H, K, V] -> x S [B, H, 1, V]."""
    return x @ S


def _matvec_sum(x, S):
    return (x.mT * S).sum(-2, keepdim=True)
