"""Chunk-parallel (WY / UT) Kimi Delta Attention in batched PyTorch: the training and prefill path.

The sequence is cut into chunks of C tokens. With S the state entering a chunk and the chunk-local
A_qk, U, W, exp(Γ) Q, exp(Γ_C - Γ) K of `intra.py` (Kimi Linear report Eqs. 2-9):

    V'     = U - W S                                   (pseudo-values)
    O      = (exp(Γ) Q) S + A_qk V'
    S_next = diag(exp(Γ_C)) S + (exp(Γ_C - Γ) K)^T V'

The chunk-local work runs as batched matmuls over groups of chunks (all heads at once, a few MB of
reused scratch per group); only the state pass is a Python loop over chunks, two small matmuls each.
The backward is hand-written (`_ChunkKDA`): it keeps the inputs, the state entering every chunk, V' and
the chunk-local matmul results (A_qk, A_kk, [U | W]), recomputes the elementwise factors group by group,
runs the state pass in reverse and applies `intra.local_backward`. Everything runs with denormals
flushed (`scratch.py`). Packed documents (`cu_seqlens`) are each padded to a chunk boundary and
concatenated; the state pass restarts at every document's first chunk.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from k3.ops import native
from k3.ops.kda import varlen
from k3.ops.kda.decay import pick_sub_chunk
from k3.ops.kda.fused import fused_fits, fused_forward
from k3.ops.kda.halves import halves_fit, halves_local
from k3.ops.kda.intra import local_backward, local_factors, local_solve
from k3.ops.kda.prep import check_inputs, doc_lengths
from k3.ops.kda.scratch import Workspace, denormals_flushed

MIN_LOG_DECAY = -60.0  # per-token gates below this (retention < 1e-26) are clamped
GROUP_MATRICES = 32  # chunk x head matrices per batched chunk-local step


def chunk_kda(
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
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] fp32
    (or [N, H, K, V] with cu_seqlens [N+1], B == 1); chunk_size C in {16, 32, 64, 128}.

    Returns o [B, T, H, V] in v's dtype and the final state (fp32 [B or N, H, K, V]) or None.
    Any T works: the tail is zero-padded (k = g = beta = 0 leaves the state unchanged).
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    dtype, C = v.dtype, chunk_size
    B, T, H, K = q.shape
    x = [t.float() for t in (q, k, v, g, beta)]  # the L2 norm and scale run inside, per group of chunks
    if float(x[3].detach().min()) < MIN_LOG_DECAY:
        x[3] = x[3].clamp(min=MIN_LOG_DECAY)
    h0 = h0_heads = None if initial_state is None else initial_state.float()  # [B or N, H, K, V]
    if cu_seqlens is None:
        total = -(-T // C) * C
        if total != T:
            x = [F.pad(t, (0, 0) * (t.dim() - 2) + (0, total - T)) for t in x]
        segments = ((0, total // C),)
        h0 = None if h0 is None else h0.reshape(1, B * H, *h0.shape[2:])
    else:
        lengths = doc_lengths(cu_seqlens)
        starts, total = varlen.padded_starts(lengths, C)
        index = varlen.token_index(lengths, starts, q.device)
        x = [varlen.scatter_tokens(t[0], index, total)[None] for t in x]
        segments = tuple((s // C, -(-(s + n) // C)) for s, n in zip(starts, lengths, strict=True))
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in [*x, h0] if t is not None)
    scale = K**-0.5 if scale is None else float(scale)
    g_chunks = _to_chunks(x[3], C)  # (the other inputs are chunked only for the torch path: copies at B > 1)
    halves = halves_fit(g_chunks, use_qk_l2norm, scale)
    fused = None
    if halves and not keep and fused_fits(*x, C):  # (batch row, first token, chunks) per sequence
        rows = (
            [(b, 0, total // C) for b in range(B)]
            if cu_seqlens is None
            else [(0, a * C, e - a) for a, e in segments]
        )
        fused = fused_forward(*x, h0_heads, rows, C, scale)
    if fused is not None:  # o [B, total, H, V]
        o, finals = fused
    else:
        chunks = [g_chunks if i == 3 else _to_chunks(t, C) for i, t in enumerate(x)]
        group = max(1, GROUP_MATRICES // (B * H))
        plan = _Plan(segments, pick_sub_chunk(g_chunks), group, keep, scale, use_qk_l2norm, halves)
        o, finals = _ChunkKDA.apply(*chunks, h0, plan)
        o = o.unflatten(1, (-1, H)).permute(1, 0, 3, 2, 4).reshape(-1, total, H, o.shape[-1])
    if cu_seqlens is None:
        o, final = o[:, :T], finals.view(B, H, *finals.shape[2:])
    else:
        o, final = varlen.gather_tokens(o[0], index)[None], finals
    return o.to(dtype), final if output_final_state else None


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, *] -> [T/C, B*H, C, *], chunk-major: a view of x when B == 1, else a copy. The chunk-local
    maps read the views directly; the paths that need dense [M, C, *] slices copy group by group."""
    x = x.unflatten(1, (-1, C)).movedim(3, 2).movedim(1, 0)  # [NC, B, H, C, *]
    return x.flatten(1, 2)


@dataclass(frozen=True)
class _Plan:
    """segments: (first, end) chunk of each independent sequence; sub: sub-chunk size; group: chunks per
    batched chunk-local step; keep: save what the backward needs; scale, l2norm: the q/k normalisation;
    halves: the forward's chunk-local maps take the two-half path (`halves.py`)."""

    segments: tuple[tuple[int, int], ...]
    sub: int
    group: int
    keep: bool
    scale: float
    l2norm: bool
    halves: bool
    first: dict = field(init=False)
    last: dict = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "first", {a: i for i, (a, _) in enumerate(self.segments)})
        object.__setattr__(self, "last", {b - 1: i for i, (_, b) in enumerate(self.segments)})

    def groups(self, n_chunks: int) -> list[tuple[int, int]]:
        return [(c, min(c + self.group, n_chunks)) for c in range(0, n_chunks, self.group)]


class _ChunkKDA(torch.autograd.Function):
    """Raw fp32 q, k, g [NC, BH, C, K]; v [NC, BH, C, V]; beta [NC, BH, C]; h0 [N, BH, K, V] or None
    -> (o [NC, BH, C, V], final states [N, BH, K, V]), N = number of segments."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, plan):
        with denormals_flushed():
            o, saved, finals = _forward(q, k, v, g, beta, h0, plan)
        if plan.keep:
            ctx.save_for_backward(q, k, v, g, beta, *saved)
            ctx.plan, ctx.has_h0 = plan, h0 is not None
        return o, finals

    @staticmethod
    def backward(ctx, do, dfinals):
        with denormals_flushed():
            return (*_backward(*ctx.saved_tensors, do, dfinals, ctx.plan, ctx.has_h0), None)


def _forward(q, k, v, g, beta, h0, plan):
    """State pass over chunk groups -> (o, saved for the backward or (), finals)."""
    NC, BH, C, K = q.shape
    V = v.shape[-1]
    o, finals = v.new_empty(NC, BH, C, V), q.new_empty(len(plan.segments), BH, K, V)
    if plan.keep:  # the state entering each chunk (and the last one leaving), V', A_qk, A_kk, [U | W]
        saved = [q.new_empty(NC + 1, BH, K, V), v.new_empty(NC, BH, C, V), q.new_empty(NC, BH, C, C)]
        saved += [q.new_empty(NC, BH, C, C), q.new_empty(NC, BH, C, V + K)]
    ws, S = Workspace(), None
    fn = _state_kernel("k3_kda_state_forward", q, V)
    h0c = None if h0 is None else h0.contiguous()  # (held: the kernel reads it through a raw pointer)
    h0_ptr = None if h0c is None else h0c.data_ptr()
    for c0, c1 in plan.groups(NC):
        G, M = c1 - c0, (c1 - c0) * BH
        x = [t[c0:c1] for t in (q, k, v, g, beta)]
        if plan.keep:
            states, v_new = saved[0][c0 : c1 + 1], saved[1][c0:c1]
            A_qk, A_kk, X = (t[c0:c1].flatten(0, 1) for t in saved[2:])
        else:
            states, v_new = ws.get("states", q, G + 1, BH, K, V), ws.get("v_new", q, G, BH, C, V)
            A_qk, A_kk = ws.get("A_qk", q, M, C, C), None if plan.halves else ws.get("A_kk", q, M, C, C)
            X = ws.get("X", q, M, C, V + K)
        qg, k_dec, decay = _local(x, plan, A_qk, A_kk, X, ws)
        if fn is not None:  # the state pass in one native call (the loop below is its reference)
            if S is None:
                S = q.new_zeros(BH, K, V)
            marks = _segment_marks(plan, c0, c1)
            kd, dc = k_dec.contiguous(), decay.contiguous()
            ptrs = (t.data_ptr() for t in (X, kd, dc, states, v_new, S, *marks))
            fn(G, BH, C, K, V, *ptrs, h0_ptr, finals.data_ptr())
        else:
            S = _state_pass_torch(X, k_dec, decay, states, v_new, S, h0, finals, plan, c0, c1)
        o_g = torch.bmm(qg, states[:G].flatten(0, 1), out=o[c0:c1].flatten(0, 1))
        o_g.baddbmm_(A_qk, v_new.flatten(0, 1))
    if plan.keep:
        saved[0] = saved[0][:NC]
    return o, saved if plan.keep else (), finals


def _state_pass_torch(X, k_dec, decay, states, v_new, S, h0, finals, plan, c0, c1):
    """The forward state pass of chunks [c0, c1) in torch (the reference of `k3_kda_state_forward`,
    csrc/kda_state.c): fills states [G + 1, BH, K, V], v_new and the finals of segments ending here;
    returns the state leaving the group."""
    G, BH, K, V = c1 - c0, states.shape[1], states.shape[2], states.shape[3]
    # per-chunk [BH, ...] views, made once per group (the loop is dispatch-bound)
    per_chunk = (X[..., :V], X[..., V:], k_dec.mT, decay[..., None])
    U, W, k_decT, dec = (t.unflatten(0, (G, BH)).unbind(0) for t in per_chunk)
    S_ins, v_news = states.unbind(0), v_new.unbind(0)
    for j, c in enumerate(range(c0, c1)):
        if c in plan.first:
            S = states.new_zeros(BH, K, V) if h0 is None else h0[plan.first[c]]
        S_in = S_ins[j]
        if S.data_ptr() != S_in.data_ptr():  # a segment's first chunk, or a new group without keep
            S_in.copy_(S)
        torch.baddbmm(U[j], W[j], S_in, alpha=-1, out=v_news[j])  # V' = U - W S
        S = torch.mul(S_in, dec[j], out=S_ins[j + 1]).baddbmm_(k_decT[j], v_news[j])
        if c in plan.last:
            finals[plan.last[c]] = S
    return S


# k3_kda_state_forward(G, R, C, K, V, X, k_dec, decay, states, v_new, carry, first, last, h0, finals)
# k3_kda_state_backward(G, R, C, K, V, X, k_dec, decay, dS_out, dv_new, dS_next, carry, first, last, dfinals,
#                       dh0)
_STATE_ARGS = {
    "k3_kda_state_forward": [native.I64] * 5 + [native.PTR] * 10,
    "k3_kda_state_backward": [native.I64] * 5 + [native.PTR] * 11,
}
NATIVE_STATE_PASS = True  # False: the torch loops (tests compare the two)


def _state_kernel(symbol: str, like: torch.Tensor, V: int):
    """The native state pass `symbol` for fp32 CPU chunks with V a multiple of 16, else None."""
    if not NATIVE_STATE_PASS or V % 16 or not native.fp32_cpu(like) or torch.compiler.is_compiling():
        return None
    return native.function("kda_state", symbol, _STATE_ARGS[symbol])


def _segment_marks(plan, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment starting / ending at each chunk of [c0, c1), or -1: two int64 tensors [c1 - c0]."""
    first = torch.tensor([plan.first.get(c, -1) for c in range(c0, c1)], dtype=torch.int64)
    last = torch.tensor([plan.last.get(c, -1) for c in range(c0, c1)], dtype=torch.int64)
    return first, last


def _local(x, plan, A_qk, A_kk, X, ws):
    """Chunk-local maps of one group (x: q, k, v, g, beta [G, BH, C, *] views): fills A_qk, A_kk, X;
    returns (qg, k_dec, decay)."""
    if plan.halves:
        return halves_local(*x, plan.scale, A_qk, A_kk, X, ws)
    q, k, v, g, beta = (t.flatten(0, 1) for t in x)
    loc = local_factors(q, k, g, beta, plan.sub, plan.scale, plan.l2norm, ws)
    local_solve(loc, v, beta, A_qk, A_kk, X, ws)
    return loc.qg, loc.k_dec, loc.f.decay


def _backward(q, k, v, g, beta, states, v_new, A_qk, A_kk, X, do, dfinals, plan, has_h0):
    NC, BH, C, K = q.shape
    V = v.shape[-1]
    do = v.new_zeros(NC, BH, C, V) if do is None else do.contiguous()
    grads = [torch.empty_like(t) for t in (q, k, v, g, beta)]
    dh0 = q.new_zeros(len(plan.segments), BH, K, V) if has_h0 else None
    ws, dS = Workspace(), None
    fn = _state_kernel("k3_kda_state_backward", q, V)
    dfinals = None if dfinals is None else dfinals.contiguous()
    for c0, c1 in reversed(plan.groups(NC)):
        group = (q, k, v, g, beta, states, v_new, A_qk, A_kk, X, do)
        q_, k_, v_, g_, beta_, S_, vn_, A_qk_, A_kk_, X_, do_ = (t[c0:c1].flatten(0, 1) for t in group)
        loc = local_factors(q_, k_, g_, beta_, plan.sub, plan.scale, plan.l2norm, ws)
        dv_new = torch.bmm(A_qk_.mT, do_)  # A_qk^T dO; the state term is added below
        dS_out = torch.bmm(loc.qg.mT, do_)  # (exp(Γ) Q)^T dO, the output's pull on the entering state
        dS_next = q.new_empty(dv_new.shape[0], K, V)
        if fn is not None:  # the reverse state pass in one native call (the loop is its reference)
            if dS is None:
                dS = q.new_zeros(BH, K, V)
            first, last = _segment_marks(plan, c0, c1)
            Xc, kd, dc = X_.contiguous(), loc.k_dec.contiguous(), loc.f.decay.contiguous()
            ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
            fn(c1 - c0, BH, C, K, V, *(ptr(t) for t in (Xc, kd, dc, dS_out, dv_new, dS_next, dS, first, last,
                                                         dfinals, dh0)))  # fmt: skip
        else:
            dS = _state_backward_torch(X_, loc, dS_out, dv_new, dS_next, dS, dfinals, dh0, plan, c0, c1)
        local = local_backward(loc, q_, k_, v_, beta_, A_kk_, X_, S_, dS_next, vn_, dv_new, do_, ws)
        for dst, src in zip(grads, local, strict=True):
            dst[c0:c1] = src.view(c1 - c0, BH, *src.shape[1:])
    return (*grads, dh0)


def _state_backward_torch(X_, loc, dS_out, dv_new, dS_next, dS, dfinals, dh0, plan, c0, c1):
    """The reverse state pass of chunks [c0, c1) in torch (the reference of `k3_kda_state_backward`):
    adds the state's pull to dv_new, fills dS_next and dh0 of segments starting here; returns the
    gradient of the state entering the group."""
    BH, (K, V) = dS_out.shape[0] // (c1 - c0), dS_out.shape[1:]
    W = X_[..., V:]
    for c in reversed(range(c0, c1)):
        if c in plan.last:
            dS = dS_out.new_zeros(BH, K, V) if dfinals is None else dfinals[plan.last[c]]
        i = slice((c - c0) * BH, (c - c0 + 1) * BH)
        dS_next[i] = dS
        dv_new[i].baddbmm_(loc.k_dec[i], dS)
        dS = (dS * loc.f.decay[i, :, None]).add_(dS_out[i]).baddbmm_(W[i].mT, dv_new[i], alpha=-1)
        if dh0 is not None and c in plan.first:
            dh0[plan.first[c]] = dS
    return dS
