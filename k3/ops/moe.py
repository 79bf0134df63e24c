"""Mixture-of-experts maths as pure functions: routing, expert compute, and the router-bias updates.

Letters: T tokens, E routed experts, k experts per token, Dl the width the experts work in (the latent
width 3584 in Stable LatentMoE, the model width D in plain MoE), I the expert intermediate (3072), m the
tokens of one optimizer step (all micro-batches).

* `route` — sigmoid scores, top-k *selection* on `score + bias`, combine weights from the *unbiased*
  scores (renormalized over the chosen k, times `routed_scaling_factor`) (docs/spec.md#latentmoe steps 1-3).
* `experts_reference` / `experts_grouped` — `u_t = Σ_i p_ti · E_i(z_t)` with
  `E_i(z) = w2_i·GLU(w1_i z, w3_i z)` on stacked weights w1 [E, I, Dl] (gate), w3 [E, I, Dl] (up),
  w2 [E, Dl, I] (down). The reference runs every expert on every token and masks; the grouped one
  sorts the T·k token-slots by expert and runs each expert once on its contiguous slice. Same
  signature; both accumulate in fp32.
  `experts_active` (one GLU call for all slots; decode skips the sort) is the inference fast path and
  `experts_auto` (the modules' default) picks it or grouped; `experts_native` is the same loop as one C
  call (fp32 CPU, no autograd: the CPU engine's path); `experts_padded` runs all experts as batched
  matmuls over a capacity-padded layout (for accelerators); `experts_gathered` copies the chosen
  experts' weights and needs no host read (what a compiled decode step traces).
* `quantile_balance_bias` — Quantile Balancing (docs/spec_training.md#quantile-balancing), exact
  single-process form; docs/architecture.md for the derivation and the rule for a non-integer target load q =
  m·k/E.
* `sign_update_bias` — DeepSeek-V3's auxiliary-loss-free sign update, the ablation alternative.
"""

import math
from functools import partial

import torch
import torch.nn.functional as F

from k3.ops import native
from k3.ops.glu import GLUFn, fused_activations_enabled, situ_glu, swiglu

RENORM_EPS = 1e-20  # as in the release: p_i = s_i / (Σ_topk s + 1e-20)


# ---- routing ----------------------------------------------------------------------------------------
def _group_limited_mask(biased_TE: torch.Tensor, num_expert_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3 group-limited selection: keep the `topk_group` groups whose two best biased scores sum
    highest, send the other experts to -inf. [T, E] -> [T, E]."""
    T, E = biased_TE.shape
    grouped = biased_TE.view(T, num_expert_group, E // num_expert_group)
    group_score = grouped.topk(min(2, E // num_expert_group), dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)


def route(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    scaling: float = 1.0,
    num_expert_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid router with bias-corrected selection (docs/spec.md#latentmoe steps 1-3).

    logits_TE [T, E] (fp32; upcast otherwise), bias_E [E] (`e_score_correction_bias`) ->
    weights_Tk [T, k] fp32, indices_Tk [T, k] int64, scores_TE [T, E] fp32 (= sigmoid(logits)).

    The bias only changes *which* experts are chosen; the weights are the unbiased scores of the chosen
    experts, divided by their sum (+1e-20) if `renormalize`, times `scaling`. `num_expert_group > 1`
    adds DeepSeek-V3 group-limited selection (1 = off, as in K3).
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must be [T, E], got shape {tuple(logits_TE.shape)}")
    E = logits_TE.shape[1]
    if bias_E.shape != (E,):
        raise ValueError(f"bias_E must be [{E}], got shape {tuple(bias_E.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}], got {top_k}")
    scores = torch.sigmoid(logits_TE.float())
    biased = scores.detach() + bias_E.float()
    if num_expert_group > 1:
        if E % num_expert_group or not 1 <= topk_group <= num_expert_group:
            raise ValueError(
                f"num_expert_group={num_expert_group} must divide E={E} and topk_group="
                f"{topk_group} must be in [1, num_expert_group]"
            )
        if top_k > topk_group * (E // num_expert_group):
            raise ValueError(f"top_k={top_k} exceeds the experts in topk_group={topk_group} groups")
        biased = _group_limited_mask(biased, num_expert_group, topk_group)
    indices = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
    return (weights if scaling == 1.0 else weights * scaling), indices, scores


def expert_load(indices_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert: indices_Tk [T, k] -> counts [E] int64."""
    return torch.bincount(indices_Tk.reshape(-1), minlength=num_experts)


# ---- expert compute ---------------------------------------------------------------------------------
def _check_experts(z, weights, indices, w1, w2, w3) -> None:
    if z.dim() != 2:
        raise ValueError(f"z must be [T, Dl], got shape {tuple(z.shape)}")
    if weights.shape != indices.shape or weights.dim() != 2 or weights.shape[0] != z.shape[0]:
        raise ValueError(
            f"weights {tuple(weights.shape)} and indices {tuple(indices.shape)} must both be "
            f"[T={z.shape[0]}, k]"
        )
    E, I, Dl = w1.shape
    if Dl != z.shape[1] or w3.shape != w1.shape or w2.shape != (E, Dl, I):
        raise ValueError(
            f"expected w1, w3 [E, I, {z.shape[1]}] and w2 [E, Dl, I]; got w1 {tuple(w1.shape)}, "
            f"w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}"
        )


def expert_mlp(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, act: GLUFn
) -> torch.Tensor:
    """One expert: x [n, Dl], w1/w3 [I, Dl], w2 [Dl, I] -> w2·act(w1 x, w3 x) [n, Dl] in x's dtype."""
    return F.linear(act(F.linear(x, w1), F.linear(x, w3)), w2)


def experts_reference(z, weights, indices, w1, w2, w3, act: GLUFn) -> torch.Tensor:
    """Reference: every expert on every token, weighted by p (0 where not chosen).

    z [T, Dl], weights [T, k] fp32, indices [T, k], w1/w3 [E, I, Dl], w2 [E, Dl, I] -> u [T, Dl] in z's
    dtype; u_t = Σ_i p_ti E_i(z_t), accumulated in fp32.
    """
    _check_experts(z, weights, indices, w1, w2, w3)
    out = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    for e in range(w1.shape[0]):
        p_T = (weights.float() * (indices == e)).sum(-1)  # [T]
        out = out + p_T[:, None] * expert_mlp(z, w1[e], w2[e], w3[e], act).float()
    return out.to(z.dtype)


def experts_grouped(z, weights, indices, w1, w2, w3, act: GLUFn) -> torch.Tensor:
    """Fast path, same signature and result as `experts_reference`.

    Sort the T·k token-slots by expert, gather their inputs once, run each expert that received tokens
    on its contiguous slice, then scatter-add `p · E_i(z)` back to the tokens in fp32. Reading the
    per-expert counts syncs with the device once per call.
    """
    _check_experts(z, weights, indices, w1, w2, w3)
    T, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slot ids grouped by expert
    token_of_slot = order // k
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    x_sorted = z.index_select(0, token_of_slot)  # [T*k, Dl]; its backward is an index_add, not an index_put
    outs = [
        expert_mlp(x, w1[e], w2[e], w3[e], act)
        for e, x in enumerate(torch.split(x_sorted, counts))
        if counts[e] > 0
    ]
    if not outs:
        return torch.zeros_like(z)
    y = torch.cat(outs).float() * weights.reshape(-1).index_select(0, order).float()[:, None]
    out = torch.zeros(z.shape, dtype=torch.float32, device=z.device).index_add_(0, token_of_slot, y)
    return out.to(z.dtype)


GATHER_MAX_SLOTS = 64  # `experts_auto` under torch.compile: copies chosen weights for this many slots at most
ACTIVE_MAX_ELEMENTS = 1 << 18  # `experts_auto`: one GLU over all slots while [T·k, I] stays this small


def experts_active(z, weights, indices, w1, w2, w3, act: GLUFn) -> torch.Tensor:
    """Inference fast path, same signature and result as `experts_reference`.

    `experts_grouped` with one GLU call over all token-slots instead of one per expert: per active expert
    only its two input mat-muls and its down mat-mul. A single token (decode) skips the sort, since its
    k slots are already one per expert. One host read of the indices (T == 1) or the expert counts.
    """
    _check_experts(z, weights, indices, w1, w2, w3)
    T, k = indices.shape
    if T == 1:  # one slot per expert, in slot order
        experts = indices[0].tolist()
        gate = torch.cat([F.linear(z, w1[e]) for e in experts])  # [k, I]
        up = torch.cat([F.linear(z, w3[e]) for e in experts])
        h = act(gate, up)
        y = torch.stack([F.linear(h[s], w2[e]) for s, e in enumerate(experts)])  # [k, Dl]
        return (y.float() * weights[0, :, None].float()).sum(0, keepdim=True).to(z.dtype)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_slot = order // k
    per_expert = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    experts = [e for e, n in enumerate(per_expert) if n]
    counts = [per_expert[e] for e in experts]
    xs = z[token_of_slot].split(counts)
    gate = torch.cat([F.linear(xe, w1[e]) for xe, e in zip(xs, experts, strict=True)])  # [T*k, I]
    up = torch.cat([F.linear(xe, w3[e]) for xe, e in zip(xs, experts, strict=True)])
    hs = act(gate, up).split(counts)
    y = torch.cat([F.linear(he, w2[e]) for he, e in zip(hs, experts, strict=True)])  # [T*k, Dl]
    y = y.float() * weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros(z.shape, dtype=torch.float32, device=z.device).index_add_(0, token_of_slot, y)
    return out.to(z.dtype)


# k3_experts_situ(sgemm, z, token_of_slot, weight, counts, E, Dl, I, w1, w3, w2, scratch, out, act, b1, b2)
_EXPERTS_ARGS = [native.PTR] * 5 + [native.I64] * 3 + [native.PTR] * 5 + [native.I64, native.F32, native.F32]
_EXPERTS_ARGS += [native.I64] * 3  # T, threads, scratch floats per thread


def _native_act(act: GLUFn) -> tuple[int, float, float] | None:
    """The native kernel's code for `act`: (0, β₁, β₂) for SiTU-GLU, (1, 0, 0) for SwiGLU, else None."""
    if isinstance(act, partial) and act.func is situ_glu and not act.args:
        return 0, float(act.keywords.get("beta1", 4.0)), float(act.keywords.get("beta2", 25.0))
    if act is situ_glu:
        return 0, 4.0, 25.0
    return (1, 0.0, 0.0) if act is swiglu else None


def _experts_kernel(z, weights, w1, w2, w3, act: GLUFn):
    """(kernel, sgemm address, act code) when `experts_native` can run these inputs, else None: fp32 CPU,
    contiguous stacked weights, no autograd, a built kernel, torch's BLAS found, a known activation."""
    code = _native_act(act)
    if code is None or not all(w.is_contiguous() for w in (w1, w2, w3)):
        return None
    fn = native.kernel_function("moe_experts", "k3_experts_situ", _EXPERTS_ARGS, z, weights, w1, w2, w3)
    sgemm = native.blas_sgemm() if fn is not None else None
    return None if sgemm is None else (fn, sgemm, code)


def experts_native(z, weights, indices, w1, w2, w3, act: GLUFn) -> torch.Tensor | None:
    """Inference fast path, same signature and result as `experts_reference` (to fp32 rounding), or None when
    the inputs do not fit the kernel (see `_experts_kernel`; the caller then takes a torch path).

    The slots are sorted by expert as in `experts_grouped`; then one C call (`k3/ops/csrc/moe_experts.c`)
    runs every active expert from gather to weighted scatter-add: its rows gathered, gate and up products
    (torch's own BLAS `sgemm_`), the GLU in place, the down product and the fp32 accumulation. Saves the
    per-expert torch dispatch and the [T·k, I] round trips through memory."""
    _check_experts(z, weights, indices, w1, w2, w3)
    found = _experts_kernel(z, weights, w1, w2, w3, act)
    if found is None:
        return None
    fn, sgemm, (code, beta1, beta2) = found
    T, k = indices.shape
    E, I, Dl = w1.shape
    flat = indices.reshape(-1)
    counts = torch.bincount(flat, minlength=E)  # raises for a negative index
    if counts.numel() != E:  # the kernel would read past the weight stacks
        raise ValueError(f"indices must lie in [0, {E}), got a maximum of {int(flat.max())}")
    order = torch.argsort(flat, stable=True)
    token_of_slot = (order // k).contiguous()
    slot_weight = weights.reshape(-1)[order].float().contiguous()
    zc = z.contiguous()
    # the kernel's scratch contract: per thread max(c) * (Dl + 2 I), then a [T, Dl] partial sum per thread
    # but the first; one thread per 16 slots at most (fewer slots: a thread would idle)
    threads = max(1, min(torch.get_num_threads(), T * k // 16))
    per_thread = int(counts.max()) * (Dl + 2 * I)
    scratch = z.new_empty(threads * per_thread + (threads - 1) * T * Dl)
    out = torch.zeros(T, Dl, dtype=torch.float32)
    ptrs = [t.data_ptr() for t in (zc, token_of_slot, slot_weight, counts)]
    weights_ptrs = [t.data_ptr() for t in (w1, w3, w2)]
    fn(sgemm, *ptrs, E, Dl, I, *weights_ptrs, scratch.data_ptr(), out.data_ptr(), code, beta1, beta2,
       T, threads, per_thread)  # fmt: skip
    return out


def experts_gathered(z, weights, indices, w1, w2, w3, act: GLUFn) -> torch.Tensor:
    """Fast path without host reads, same signature and result as `experts_reference`: copies the chosen
    experts' weights ([T·k, I, Dl] each of w1, w3, w2) and runs three batched matmuls, one row per
    token-slot. Static shapes and no data-dependent Python, so `torch.compile` traces it whole (the
    compiled decode step, k3.infer.decode.torch_step); the copies make it a path for a few slots only."""
    _check_experts(z, weights, indices, w1, w2, w3)
    T, k = indices.shape
    flat = indices.reshape(-1)
    x = z[:, None, None, :].expand(T, k, 1, z.shape[1]).reshape(T * k, 1, z.shape[1])  # [T*k, 1, Dl]
    h = act(torch.bmm(x, w1[flat].mT), torch.bmm(x, w3[flat].mT))  # [T*k, 1, I]
    y = torch.bmm(h, w2[flat].mT).view(T, k, -1)  # [T, k, Dl]
    return (y.float() * weights.float()[..., None]).sum(1).to(z.dtype)


def _slot_layout(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """indices [T, k] -> (order [T·k] slot ids grouped by expert, dest [T·k] row of each sorted slot in
    the padded [E·C] layout, C the largest expert load). One host read (C)."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    cap = int(counts.max())
    expert = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[expert]
    return order, expert * cap + rank, cap


def experts_padded(z, weights, indices, w1, w2, w3, act: GLUFn) -> torch.Tensor:
    """Fast path for many token-slots, same signature and result as `experts_reference`.

    Scatters the slots into a capacity-padded [E, C, Dl] batch (C = the largest expert load) and runs all
    experts at once as three batched matmuls on the stacked weights (no per-expert loop); padding rows
    are zeros and are never read back. Costs E·C/(T·k) x the useful FLOPs. Meant for accelerators: on
    one CPU thread the per-expert paths measured faster (k3-tiny, T = 32..512), so `experts_auto` does
    not pick it.
    """
    _check_experts(z, weights, indices, w1, w2, w3)
    order, dest, cap = _slot_layout(indices, w1.shape[0])
    k = indices.shape[1]
    E, _, Dl = w1.shape
    token_of_slot = order // k
    x = z.new_zeros(E * cap, Dl).index_copy(0, dest, z[token_of_slot]).view(E, cap, Dl)
    h = act(torch.bmm(x, w1.mT), torch.bmm(x, w3.mT))  # [E, C, I]
    y = torch.bmm(h, w2.mT).view(E * cap, Dl)[dest]  # [T*k, Dl], sorted slot order
    y = y.float() * weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros(z.shape, dtype=torch.float32, device=z.device).index_add_(0, token_of_slot, y)
    return out.to(z.dtype)


def experts_auto(z, weights, indices, w1, w2, w3, act: GLUFn) -> torch.Tensor:
    """The fastest exact path by size and mode (same signature and result as `experts_reference`): with
    autograd, or when the slots' [T·k, I] activations outgrow ACTIVE_MAX_ELEMENTS, `experts_grouped`
    (its per-expert GLU stays in cache); without autograd `experts_native` where it runs (fp32 CPU,
    the kernel built), else `experts_active` (decode, short prefill chunks), or `experts_gathered` while
    torch.compile traces a few slots (no host reads: the compiled decode step)."""
    _check_experts(z, weights, indices, w1, w2, w3)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (z, weights, w1, w2, w3))
    if torch.compiler.is_compiling() and not needs_grad and indices.numel() <= GATHER_MAX_SLOTS:
        return experts_gathered(z, weights, indices, w1, w2, w3, act)
    out = experts_native(z, weights, indices, w1, w2, w3, act)  # None with autograd or while tracing
    if out is not None:
        return out
    limit = ACTIVE_MAX_ELEMENTS * (4 if fused_activations_enabled() else 1)  # one fused GLU call pays more
    if needs_grad or indices.numel() * w1.shape[1] > limit:
        return experts_grouped(z, weights, indices, w1, w2, w3, act)
    return experts_active(z, weights, indices, w1, w2, w3, act)


EXPERT_IMPLS = {
    "reference": experts_reference,
    "grouped": experts_grouped,
    "active": experts_active,
    "padded": experts_padded,
    "gathered": experts_gathered,
    "auto": experts_auto,
}


# ---- router-bias updates (no gradient; once per optimizer step) -------------------------------------
def _rank_value(desc_nE: torch.Tensor, rank: float) -> torch.Tensor:
    """The value at fractional 0-indexed rank `rank` of columns sorted descending, linearly interpolated."""
    lo = min(math.floor(rank), desc_nE.shape[0] - 1)
    hi = min(math.ceil(rank), desc_nE.shape[0] - 1)
    frac = rank - math.floor(rank)
    return desc_nE[lo] + frac * (desc_nE[hi] - desc_nE[lo])


@torch.no_grad()
def quantile_balance_bias(scores_mE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Quantile Balancing (docs/spec_training.md#quantile-balancing), exact form: scores_mE [m, E] (unbiased
    sigmoid scores of the step), bias_E [E] (the bias they were routed with), top_k -> new bias [E] fp32 (mean
    zero).

    c_t = (k+1)-th largest of s_t + b; μ_tj = s_tj - c_t; q = m·k/E; τ_j = the margin of expert j at
    0-indexed descending rank q, linearly interpolated between ranks ⌊q⌋ and ⌈q⌉ (for integer q: the
    (q+1)-th largest, so at most q margins exceed it, exactly q unless margins tie there); b̂_j = -τ_j;
    return b̂ - mean(b̂). Ties are common: a token whose (k+1)-th choice is j has μ_tj = -b_j exactly.
    """
    if scores_mE.dim() != 2 or bias_E.shape != (scores_mE.shape[1],):
        raise ValueError(
            f"scores_mE must be [m, E] and bias_E [E]; got {tuple(scores_mE.shape)}, {tuple(bias_E.shape)}"
        )
    m, E = scores_mE.shape
    if not 1 <= top_k <= E or m == 0:
        raise ValueError(f"need m > 0 tokens and top_k in [1, {E}]; got m={m}, top_k={top_k}")
    if top_k == E:  # every token takes every expert: the bias cannot change anything
        return torch.zeros(E, dtype=torch.float32, device=scores_mE.device)
    s = scores_mE.float()
    cutoff_m = (s + bias_E.float()).topk(top_k + 1, dim=-1).values[:, top_k]
    margins = s - cutoff_m[:, None]  # [m, E]
    q = m * top_k / E
    n = min(math.floor(q) + 2, m)  # the descending ranks 0..⌈q⌉ are enough
    tau_E = _rank_value(margins.topk(n, dim=0).values, q)
    b_hat = -tau_E
    return b_hat - b_hat.mean()


@torch.no_grad()
def sign_update_bias(load_E: torch.Tensor, bias_E: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3 auxiliary-loss-free update: b + rate·sign(mean(load) - load). [E], [E] -> [E] fp32."""
    if load_E.shape != bias_E.shape:
        raise ValueError(f"load_E {tuple(load_E.shape)} and bias_E {tuple(bias_E.shape)} must match")
    load = load_E.float()
    return bias_E.float() + rate * torch.sign(load.mean() - load)
