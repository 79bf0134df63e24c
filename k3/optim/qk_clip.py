"""QK-Clip (Kimi K2, arXiv 2507.20534; docs/spec_training.md#qk-clip): cap each MLA head's attention logits by
rescaling its query/key weights after the optimizer step.

For head h with largest pre-softmax logit S_max^h seen in the step, gamma_h = min(1, tau / S_max^h).
An MLA logit is q_nope . k_nope + q_pe . k_pe, where q_nope, q_pe come from q_b_proj rows, k_nope from
kv_b_proj rows and k_pe from kv_a_proj_with_mqa (one vector shared by every head). Scaling q_nope and
k_nope rows by sqrt(gamma_h) and q_pe rows by gamma_h multiplies both terms, hence every logit of head h,
by exactly gamma_h, without touching the shared k_pe (which would affect all heads) or v. In K3 the
"pe" dims are un-rotated (NoPE MLA) but partitioned the same way. KDA layers have no softmax logits.

Weight layouts (per head, rows are contiguous; H heads):
  q_b_proj.weight  [H * (dn + dr), q_lora_rank]   rows of head h: [q_nope (dn) | q_pe (dr)]
  kv_b_proj.weight [H * (dn + dv), kv_lora_rank]  rows of head h: [k_nope (dn) | v (dv)]
with dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim.
"""

import torch
from torch import Tensor


def clip_factors(s_max: Tensor, tau: float = 100.0) -> Tensor:
    """gamma [H] fp32 = min(1, tau / S_max); heads with S_max <= tau (or NaN) get exactly 1."""
    s_max = s_max.float()
    return torch.where(s_max > tau, tau / s_max, torch.ones_like(s_max))


@torch.no_grad()
def qk_clip_(
    q_b_weight: Tensor,
    kv_b_weight: Tensor,
    s_max: Tensor,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    tau: float = 100.0,
) -> Tensor:
    """Rescale one MLA layer's q_b_proj / kv_b_proj weights in place; return gamma [H] fp32 for logging.

    s_max [H] is each head's max pre-softmax logit in the step (after the 1/sqrt(d) scale if that is how
    tau is meant). Heads with gamma = 1 are left bit-exact (multiplying by 1.0 is exact).
    """
    if tau <= 0:
        raise ValueError(f"tau: must be > 0, got {tau}")
    if s_max.ndim != 1:
        raise ValueError(f"s_max: expected shape [H], got {tuple(s_max.shape)}")
    num_heads, dn, dr, dv = s_max.shape[0], qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    for name, w, per_head in (("q_b_weight", q_b_weight, dn + dr), ("kv_b_weight", kv_b_weight, dn + dv)):
        if w.ndim != 2 or w.shape[0] != num_heads * per_head:
            raise ValueError(f"{name}: expected [{num_heads} * {per_head}, rank], got {tuple(w.shape)}")
        if not w.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (it is edited in place through a view)")
    gamma = clip_factors(s_max, tau)
    q = q_b_weight.view(num_heads, dn + dr, -1)  # views share storage: edits land in the weights
    kv = kv_b_weight.view(num_heads, dn + dv, -1)
    q[:, :dn].mul_(gamma.sqrt()[:, None, None].to(q.dtype))
    q[:, dn:].mul_(gamma[:, None, None].to(q.dtype))
    kv[:, :dn].mul_(gamma.sqrt()[:, None, None].to(kv.dtype))
    return gamma
