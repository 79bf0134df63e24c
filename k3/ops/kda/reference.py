"""Token-by-token reference for Kimi Delta Attention (KDA), written for clarity, in fp32.

Per head, with state S [K, V] (Kimi Linear report Eq. 1; docs/spec.md#kda):

    S   <- diag(exp(g_t)) S                 decay along the key axis
    u    = beta_t (v_t - S^T k_t)           delta-rule correction
    S   <- S + k_t u^T
    o_t  = S^T q_t                          read after the update (q already scaled)

Every fast path (`chunk_kda`, `recurrent_kda`) is tested against this loop, forward and backward.
"""

import torch

from k3.ops.kda.prep import check_inputs, doc_lengths, prepare


def recurrent_kda_reference(
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
        o, state = _loop(q, k, v, g, beta, initial_state)
        return o.to(dtype), state if output_final_state else None
    outs, states, t0 = [], [], 0
    for n, length in enumerate(doc_lengths(cu_seqlens)):
        sl = slice(t0, t0 + length)
        h0 = None if initial_state is None else initial_state[n : n + 1]
        o, state = _loop(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], h0)
        outs.append(o)
        states.append(state)
        t0 += length
    return torch.cat(outs, 1).to(dtype), torch.cat(states, 0) if output_final_state else None


def _loop(q, k, v, g, beta, initial_state):
    """fp32 tensors as in `recurrent_kda_reference` -> (o [B, T, H, V], state [B, H, K, V])."""
    B, _, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    outs = []
    # unbind, not indexing: the backward then stacks once instead of scattering into zeros every step
    for q_t, k_t, v_t, g_t, b_t in zip(*(x.unbind(1) for x in (q, k, v, g, beta)), strict=True):
        S = S * g_t.exp()[..., None]  # mat-vecs as multiply + sum: no BLAS call per token
        u = b_t[..., None] * (v_t - (S * k_t[..., None]).sum(-2))
        S = S + k_t[..., None] * u[:, :, None, :]
        outs.append((S * q_t[..., None]).sum(-2))
    return torch.stack(outs, 1), S
