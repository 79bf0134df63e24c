"""Depthwise causal short convolution + SiLU, the token-shift in front of KDA's q, k, v (docs/spec.md#kda).

Shapes: B batch, T tokens, C channels (= H*K or H*V), W kernel width (4), N documents.

    y[t, c] = SiLU( sum_{j=0..W-1} weight[c, 0, j] * u[t - W + 1 + j, c] )

Index W-1 multiplies the current token, there is no bias, and positions before the start of the sequence
(or of the document, with `cu_seqlens`) read the conv state: zeros, or the `initial_state` [.., C, W-1]
holding the last W-1 *pre-conv* inputs of the history (oldest first). The final state returned is the
same thing after this call, so prefill -> decode and chunked prefill chain exactly.

The math runs in fp32 (the weights are fp32 in the checkpoint); y is cast back to u's dtype and the
state is kept in u's dtype (the model dtype).

`causal_conv1d` (with a gradient and no history: `causal_conv1d_train`, native forward and backward;
one native pass without autograd; else W shifted multiply-adds over the history-padded
sequence, token-major; packed documents go through F.conv1d, separated by their own W-1 history columns
so nothing crosses a boundary) and
`causal_conv1d_update` (one decode step) are the fast paths; `causal_conv1d_reference` is the plain per-token
loop with the same signature that tests compare to.
"""

import torch
import torch.nn.functional as F

from k3.ops import native


def _check(u: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[int, int, int]:
    if u.dim() != 3:
        raise ValueError(f"u must be [B, T, C], got shape {tuple(u.shape)}")
    B, T, C = u.shape
    if weight.dim() != 3 or weight.shape[0] != C or weight.shape[1] != 1:
        raise ValueError(f"weight must be [C, 1, W] with C={C}, got shape {tuple(weight.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs u with B=1 (packed documents), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T:
            raise ValueError(f"cu_seqlens must be [N+1] from 0 to T={T}, got {cu_seqlens.tolist()}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    return B, T, C


def _history(initial_state: torch.Tensor | None, n: int, u: torch.Tensor, W: int) -> torch.Tensor:
    """The conv history [n, C, W-1] in u's dtype (zeros when there is no initial state)."""
    C = u.shape[-1]
    if initial_state is None:
        return u.new_zeros(n, C, W - 1)
    if initial_state.shape != (n, C, W - 1):
        raise ValueError(f"initial_state must be [{n}, {C}, {W - 1}], got shape {tuple(initial_state.shape)}")
    return initial_state.to(u.dtype)


def conv_state_after(u: torch.Tensor, history: torch.Tensor | None, p: int, W: int) -> torch.Tensor:
    """The conv state after the first p tokens (0 < p <= T) of u [B, T, C] that followed `history`
    [B, C, W-1] (None: zeros): the last W-1 pre-conv inputs, [B, C, W-1]. Reads only those columns (the
    history's tail when p < W-1)."""
    tail = u[:, max(0, p - (W - 1)) : p].transpose(1, 2)
    if p >= W - 1:
        return tail
    h = history.to(u.dtype) if history is not None else u.new_zeros(u.shape[0], u.shape[2], W - 1)
    return torch.cat([h[..., p:], tail], -1)


def _conv_silu(x_BCL: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Valid (unpadded) depthwise conv over x [B, C, L] -> SiLU -> [B, L-W+1, C] in out_dtype."""
    y = F.conv1d(x_BCL.float(), weight.float(), groups=weight.shape[0])
    return F.silu(y).transpose(1, 2).to(out_dtype)


def _shifted_conv_silu(x_BLC: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Valid depthwise conv over x [B, L, C] as W shifted multiply-adds -> SiLU -> [B, L-W+1, C] in
    out_dtype. Token-major throughout: the output is contiguous [B, T, C] (what the KDA projections
    downstream read), with no transposes around a channels-first conv."""
    W, T = weight.shape[-1], x_BLC.shape[1] - weight.shape[-1] + 1
    x, w = x_BLC.float(), weight[:, 0].float().t().contiguous()  # w [W, C]: rows contiguous (vectorised)
    y = x[:, :T] * w[0]
    for j in range(1, W):
        y = y.addcmul_(x[:, j : j + T], w[j])  # in place is autograd-safe: no op here saves y
    return F.silu(y).to(out_dtype)


def causal_conv1d(
    u: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """u [B, T, C], weight [C, 1, W], initial_state [B, C, W-1] (or [N, C, W-1] with cu_seqlens [N+1], B=1)
    -> (y [B, T, C], final_state [B or N, C, W-1]): the last W-1 pre-conv inputs of each sequence."""
    B, T, C = _check(u, weight, cu_seqlens)
    W = weight.shape[-1]
    if initial_state is None:
        out = causal_conv1d_train(u, weight, cu_seqlens)
        if out is not None:
            return out
    if cu_seqlens is None:
        out = _conv_silu_native(u, weight, initial_state)
        if out is not None:
            return out
        x = torch.cat([_history(initial_state, B, u, W).transpose(1, 2), u], dim=1)  # [B, W-1+T, C]
        return _shifted_conv_silu(x, weight, u.dtype), x[:, T:].transpose(1, 2)
    # Packed documents: give every document its own W-1 history columns in one padded sequence.
    N = cu_seqlens.numel() - 1
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(N, device=u.device), lens, output_size=T)
    tok_col = torch.arange(T, device=u.device) + (W - 1) * (doc + 1)  # column of each token in x
    hist_col = (cu_seqlens[:-1].long() + (W - 1) * torch.arange(N, device=u.device))[:, None] + torch.arange(
        W - 1, device=u.device
    )  # [N, W-1]
    x = u.new_zeros(C, T + N * (W - 1))
    x = x.index_copy(1, tok_col, u[0].transpose(0, 1))
    x = x.index_copy(1, hist_col.reshape(-1), _history(initial_state, N, u, W).transpose(0, 1).reshape(C, -1))
    y_all = _conv_silu(x[None], weight, u.dtype)  # output i sees columns i .. i+W-1
    y = y_all[:, tok_col - (W - 1)]
    end_col = (cu_seqlens[1:].long() + (W - 1) * torch.arange(1, N + 1, device=u.device))[:, None]
    final = x[:, end_col - (W - 1) + torch.arange(W - 1, device=u.device)]  # [C, N, W-1]
    return y, final.permute(1, 0, 2)


_CONV_ARGS = [native.PTR] * 4 + [native.I64] * 4  # k3_conv_silu(u, hist, w, y, B, T, C, W)


def _conv_silu_native(u: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None):
    """`causal_conv1d` without documents in one C pass (`k3/ops/csrc/kda_pointwise.c`): the taps read
    the history and u in place (no padded copy) and SiLU is applied in the same loop. fp32, no autograd;
    None when the inputs do not fit or the kernel is not built."""
    B, T, C = u.shape
    W = weight.shape[-1]
    hist = None if initial_state is None else _history(initial_state, B, u, W)
    history = () if hist is None else (hist,)
    fn = native.kernel_function("kda_pointwise", "k3_conv_silu", _CONV_ARGS, u, weight, *history)
    if fn is None:
        return None
    uc, w = u.contiguous(), weight[:, 0].t().contiguous()  # w [W, C]: a tap's channels contiguous
    hc = None if hist is None else hist.contiguous()
    y = torch.empty_like(uc)
    fn(uc.data_ptr(), None if hc is None else hc.data_ptr(), w.data_ptr(), y.data_ptr(), B, T, C, W)
    return y, conv_state_after(uc, hc, T, W)  # the final state


_DOCS_ARGS = [native.PTR] * 4 + [native.I64] * 3  # k3_conv_silu_docs(u, w, first, y, T, C, W)
# k3_conv_silu_docs_grad(u, w, first, dy, dpre, du, dw_part, T, C, W, threads)
_DOCS_GRAD_ARGS = [native.PTR] * 7 + [native.I64] * 4


class _ConvSiLUDocs(torch.autograd.Function):
    """The short conv + SiLU over packed documents, forward and backward one native pass each
    (`k3/ops/csrc/kda_pointwise.c`): u [T, C] fp32, weight [C, 1, W], first [T] int64 (the index of each
    token's document start) -> y [T, C]. Saves u alone; the backward recomputes the pre-activation."""

    @staticmethod
    def forward(ctx, u, weight, first):
        T, C = u.shape
        W = weight.shape[-1]
        w = weight[:, 0].t().contiguous()  # [W, C]: a tap's channels contiguous
        y = torch.empty_like(u)
        fn = native.function("kda_pointwise", "k3_conv_silu_docs", _DOCS_ARGS)
        fn(u.data_ptr(), w.data_ptr(), first.data_ptr(), y.data_ptr(), T, C, W)
        ctx.save_for_backward(u, w, first)
        return y

    @staticmethod
    def backward(ctx, dy):
        u, w, first = ctx.saved_tensors
        (T, C), W = u.shape, w.shape[0]
        threads = max(1, torch.get_num_threads())
        dy = dy.contiguous()
        dpre, du = torch.empty_like(u), torch.empty_like(u)
        dw_part = torch.zeros(threads, W, C)  # a team smaller than `threads` leaves rows untouched
        fn = native.function("kda_pointwise", "k3_conv_silu_docs_grad", _DOCS_GRAD_ARGS)
        args = (u, w, first, dy, dpre, du, dw_part)
        fn(*(a.data_ptr() for a in args), T, C, W, threads)
        return du, dw_part.sum(0).t()[:, None, :], None


def causal_conv1d_train(
    u: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`causal_conv1d` without an initial state (training) through `_ConvSiLUDocs`, autograd included:
    fp32 CPU inputs with a gradient to record, not while torch.compile traces; None otherwise or when the
    kernel is not built (the caller takes the torch path). Same results to fp32 rounding."""
    grad = torch.is_grad_enabled() and (u.requires_grad or weight.requires_grad)
    if not grad or not native.fp32_cpu(u, weight) or torch.compiler.is_compiling():
        return None
    if native.function("kda_pointwise", "k3_conv_silu_docs_grad", _DOCS_GRAD_ARGS) is None:
        return None
    B, T, C = u.shape
    W = weight.shape[-1]
    bounds = cu_seqlens.long() if cu_seqlens is not None else torch.arange(0, B * T + 1, T)
    lens = bounds[1:] - bounds[:-1]
    first = torch.repeat_interleave(bounds[:-1], lens, output_size=B * T).contiguous()
    y = _ConvSiLUDocs.apply(u.reshape(B * T, C).contiguous(), weight, first).view(B, T, C)
    # the final state per sequence: its last W-1 inputs, zeros before its start (autograd-safe gathers)
    idx = bounds[1:, None] - (W - 1) + torch.arange(W - 1)  # [N, W-1]
    flat = u.reshape(B * T, C)
    final = flat[idx.clamp(min=0)] * (idx >= bounds[:-1, None])[..., None].to(u.dtype)  # [N, W-1, C]
    return y, final.transpose(1, 2)


def causal_conv1d_update(
    u: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: u [B, 1, C] or [B, C], weight [C, 1, W], state [B, C, W-1]
    -> (y shaped like u, new_state [B, C, W-1])."""
    x_u = u[:, 0] if u.dim() == 3 else u
    if u.dim() == 3 and u.shape[1] != 1:
        raise ValueError(f"u must be [B, 1, C] or [B, C] for a decode step, got shape {tuple(u.shape)}")
    B, C = x_u.shape
    W = weight.shape[-1]
    if weight.shape != (C, 1, W):
        raise ValueError(f"weight must be [C, 1, W] with C={C}, got shape {tuple(weight.shape)}")
    if state.shape != (B, C, W - 1):
        raise ValueError(f"state must be [{B}, {C}, {W - 1}], got shape {tuple(state.shape)}")
    x = torch.cat([state.to(u.dtype), x_u[:, :, None]], dim=2)  # [B, C, W]
    y = F.silu((x.float() * weight[:, 0].float()).sum(-1)).to(u.dtype)
    return y.view_as(u), x[:, :, 1:]


def causal_conv1d_reference(
    u: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain per-token reference of `causal_conv1d` (same signature and results)."""
    B, T, C = _check(u, weight, cu_seqlens)
    W = weight.shape[-1]
    bounds = (
        [(0, T)] * B
        if cu_seqlens is None
        else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True))
    )
    hist = _history(initial_state, len(bounds), u, W).float()
    w = weight[:, 0].float()  # [C, W]
    y = torch.zeros(B, T, C, dtype=torch.float32, device=u.device)
    finals = []
    for n, (start, end) in enumerate(bounds):
        b = n if cu_seqlens is None else 0
        seq = torch.cat([hist[n].transpose(0, 1), u[b, start:end].float()], dim=0)  # [W-1+L, C]
        for t in range(end - start):
            for j in range(W):
                y[b, start + t] += w[:, j] * seq[t + j]
        finals.append(seq[seq.shape[0] - (W - 1) :].transpose(0, 1))
    return F.silu(y).to(u.dtype), torch.stack(finals).to(u.dtype)
