"""Multi-head latent attention (MLA) references as pure functions (SPEC §3.5).

Letters: B batch, T queries, S keys (cache + new tokens), H heads, Dn = qk_nope_head_dim,
Dr = qk_rope_head_dim, Dv = v_head_dim, R = kv_lora_rank.

Every key/value is a function of one per-token latent: the normed `c_kv` [R] plus a head-shared `k_pe` [Dr].
`kv_b_proj.weight` [H*(Dn+Dv), R] viewed as [H, Dn+Dv, R] splits into W_UK [H, Dn, R] and W_UV [H, Dv, R]:

    k_nope[s, h] = W_UK[h] c_kv[s]          v[s, h] = W_UV[h] c_kv[s]
    score[t, s, h] = scale * (q_nope[t, h] . k_nope[s, h] + q_pe[t, h] . k_pe[s])

Three equal ways to compute the same attention:

* `mla_attention_naive`    materializes k_nope/v per head (training, prefill);
* `mla_attention_absorbed` folds W_UK into the query (q_lat = W_UK^T q_nope, [H, R]) and W_UV into the
  output, so it attends over the [S, R+Dr] latent directly: MQA with one shared 576-dim key (decode);
* `mla_attention_blockwise` is the absorbed form with an online softmax over key blocks, so [T, S] is
  never materialized (long-context prefill).

Masks: `causal_mask` builds the boolean [B|1, T, S] mask (True = may attend) for queries that are the
last T of the S keys (the cache convention), optionally block-diagonal by document ids. Scores and the
softmax are computed in fp32; the output has v's (or c_kv's) dtype. A query row with no visible key is
undefined (NaN in the dense references); causal masks never produce one.
"""

import torch


def causal_mask(
    T: int,
    S: int,
    device: torch.device | None = None,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query t (key position S-T+t) sees keys s <= S-T+t, and with doc ids [B, T] / [B, S] only its own
    document -> bool [1 or B, T, S]."""
    if S < T:
        raise ValueError(f"need at least as many keys as queries, got T={T}, S={S}")
    q_pos = torch.arange(S - T, S, device=device)
    mask = (torch.arange(S, device=device)[None, :] <= q_pos[:, None])[None]
    if (q_doc_ids is None) != (k_doc_ids is None):
        raise ValueError("q_doc_ids and k_doc_ids must be given together")
    if q_doc_ids is not None:
        mask = mask & (q_doc_ids[:, :, None] == k_doc_ids[:, None, :])
    return mask


def _softmax_fp32(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """scores [B, H, T, S] fp32, mask broadcastable to [B, T, S] -> probabilities [B, H, T, S] fp32."""
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None] if mask.dim() == 3 else ~mask, float("-inf"))
    return scores.softmax(dim=-1)


def mla_attention_naive(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Materialized per-head attention.

    q_nope [B, T, H, Dn], q_pe [B, T, H, Dr], k_nope [B, S, H, Dn], k_pe [B, S, Dr] (shared by heads),
    v [B, S, H, Dv], mask bool broadcastable to [B, T, S] (True = attend) or None -> o [B, T, H, Dv].
    """
    scores = torch.einsum("bthd,bshd->bhts", q_nope.float(), k_nope.float())
    scores = scores + torch.einsum("bthd,bsd->bhts", q_pe.float(), k_pe.float())
    p = _softmax_fp32(scores * scale, mask)
    return torch.einsum("bhts,bshd->bthd", p, v.float()).to(v.dtype)


def split_kv_b(kv_b_weight: torch.Tensor, H: int, Dn: int, Dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H*(Dn+Dv), R] -> (W_UK [H, Dn, R], W_UV [H, Dv, R]) as views."""
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] != H * (Dn + Dv):
        raise ValueError(
            f"kv_b_weight must be [H*(Dn+Dv)={H * (Dn + Dv)}, R], got {tuple(kv_b_weight.shape)}"
        )
    w = kv_b_weight.view(H, Dn + Dv, -1)
    return w[:, :Dn], w[:, Dn:]


def mla_attention_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the latent (W_UK absorbed into q, W_UV applied after).

    q_nope [B, T, H, Dn], q_pe [B, T, H, Dr], c_kv [B, S, R] (already RMS-normed), k_pe [B, S, Dr],
    w_uk [H, Dn, R], w_uv [H, Dv, R], mask bool broadcastable to [B, T, S] or None -> o [B, T, H, Dv].
    """
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_uk.float())  # [B, T, H, R]
    c = c_kv.float()
    scores = torch.einsum("bthr,bsr->bhts", q_lat, c)
    scores = scores + torch.einsum("bthd,bsd->bhts", q_pe.float(), k_pe.float())
    p = _softmax_fp32(scores * scale, mask)
    o_lat = torch.einsum("bhts,bsr->bthr", p, c)  # [B, T, H, R]
    return torch.einsum("bthr,hvr->bthv", o_lat, w_uv.float()).to(c_kv.dtype)


def mla_attention_blockwise(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    causal: bool = True,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
    block_size: int = 512,
) -> torch.Tensor:
    """`mla_attention_absorbed` with an online softmax over key blocks of `block_size` (memory O(T*block)).

    Shapes as in `mla_attention_absorbed`; the mask is given structurally instead of as a [T, S] tensor:
    `causal` (queries are the last T of the S keys) and/or doc ids q_doc_ids [B, T], k_doc_ids [B, S].
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if (q_doc_ids is None) != (k_doc_ids is None):
        raise ValueError("q_doc_ids and k_doc_ids must be given together")
    B, T, H, _ = q_nope.shape
    S = c_kv.shape[1]
    if causal and S < T:
        raise ValueError(f"causal attention needs S >= T, got T={T}, S={S}")
    q_lat = torch.einsum("bthd,hdr->bhtr", q_nope.float(), w_uk.float()) * scale  # [B, H, T, R]
    q_rope = q_pe.float().transpose(1, 2) * scale  # [B, H, T, Dr]
    q_pos = torch.arange(S - T, S, device=c_kv.device)
    m = torch.full((B, H, T, 1), float("-inf"), device=c_kv.device)  # running max
    l = torch.zeros(B, H, T, 1, device=c_kv.device)  # running softmax denominator
    acc = torch.zeros(B, H, T, c_kv.shape[-1], device=c_kv.device)  # running numerator, latent space
    for s0 in range(0, S, block_size):
        c = c_kv[:, s0 : s0 + block_size].float()  # [B, s, R]
        scores = (
            q_lat @ c[:, None].transpose(-1, -2) + q_rope @ k_pe[:, None, s0 : s0 + block_size].float().mT
        )
        keep = torch.ones(1, 1, T, c.shape[1], dtype=torch.bool, device=c.device)
        if causal:
            keep = keep & (torch.arange(s0, s0 + c.shape[1], device=c.device)[None, :] <= q_pos[:, None])
        if q_doc_ids is not None:
            keep = keep & (q_doc_ids[:, None, :, None] == k_doc_ids[:, None, None, s0 : s0 + block_size])
        scores = scores.masked_fill(~keep, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with nothing seen yet
        p = torch.exp(scores - m_safe)
        corr = torch.exp(m - m_safe)
        l = l * corr + p.sum(-1, keepdim=True)
        acc = acc * corr + p @ c[:, None]
        m = m_new
    o_lat = acc / l  # [B, H, T, R]
    return torch.einsum("bhtr,hvr->bthv", o_lat, w_uv.float()).to(c_kv.dtype)
