"""RMSNorm as the release computes it (docs/spec.md#forward): normalize in fp32, cast back, then scale by the
weight.

`rms_norm_reference` is the plain torch form; `rms_norm` the fast path with the same signature and
result (to fp32 rounding): on fp32 CPU tensors one native pass per row (`k3/ops/csrc/rms_norm.c`), with a
gradient through `rms_norm_train` (a native backward too, shared with the gated norm), else the
reference. The torch form's five passes over an [N, D] activation
each run from memory once it outgrows L2 (k3-small prefill, [2048, 1024] on 2 threads: 1.56 ms a norm
against 0.45).
"""

import torch

from k3.ops import native

# k3_rms_norm(x, w, y, N, D, eps)
_ARGS = [native.PTR] * 3 + [native.I64] * 2 + [native.F32]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D] in x's dtype: (x / sqrt(mean(x^2) + eps)) computed in fp32, then * weight."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Fast path of `rms_norm_reference` (same signature and result to fp32 rounding)."""
    out = rms_norm_train(x, None, weight, eps)
    if out is not None:
        return out
    out = rms_norm_native(x, weight, eps)
    return rms_norm_reference(x, weight, eps) if out is None else out


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """One C pass per row: fp32 CPU x [..., D] and weight [D] (or None), no autograd, not tracing ->
    a new [..., D] tensor; None when the inputs do not fit or the kernel is not built."""
    tensors = (x,) if weight is None else (x, weight)
    D = x.shape[-1] if x.dim() else 0
    fits = D > 0 and (weight is None or weight.shape == (D,))
    fn = native.kernel_function("rms_norm", "k3_rms_norm", _ARGS, *tensors) if fits else None
    if fn is None:
        return None
    xc = x.contiguous()
    w = None if weight is None else weight.contiguous()
    y = torch.empty_like(xc)
    fn(xc.data_ptr(), None if w is None else w.data_ptr(), y.data_ptr(), xc.numel() // D, D, float(eps))
    return y


GATED_ARGS = [native.PTR] * 4 + [native.I64] * 2 + [native.F32]  # k3_gated_rms_norm(o, g, w, y, N, V, eps)
# k3_rms_norm_grad(x, g, w, dy, dx, dg, dw_part, N, D, eps, threads)
_GRAD_ARGS = [native.PTR] * 7 + [native.I64] * 2 + [native.F32, native.I64]


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm (gate None) or the gated RMSNorm, y = (x / rms(x)) * w * sigmoid(gate), with native
    forward and backward passes: x (and gate) [N, D] contiguous fp32, weight [D] or None. Saves the
    inputs only; the backward recomputes each row's norm."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        N, D = x.shape
        y = torch.empty_like(x)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        if gate is None:
            fn = native.function("rms_norm", "k3_rms_norm", _ARGS)
            fn(x.data_ptr(), ptr(weight), y.data_ptr(), N, D, eps)
        else:
            fn = native.function("rms_norm", "k3_gated_rms_norm", GATED_ARGS)
            fn(x.data_ptr(), gate.data_ptr(), weight.data_ptr(), y.data_ptr(), N, D, eps)
        ctx.save_for_backward(x, gate, weight)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight = ctx.saved_tensors
        (N, D), threads = x.shape, max(1, torch.get_num_threads())
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        dg = None if gate is None else torch.empty_like(gate)
        want_w = weight is not None and ctx.needs_input_grad[2]
        dw = torch.zeros(threads, D) if want_w else None  # a smaller team leaves rows untouched
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        fn = native.function("rms_norm", "k3_rms_norm_grad", _GRAD_ARGS)
        ptrs = (ptr(t) for t in (x, gate, weight, dy, dx, dg, dw))
        fn(*ptrs, N, D, ctx.eps, threads)
        return dx, dg, None if dw is None else dw.sum(0), None


def rms_norm_train(
    x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> torch.Tensor | None:
    """`rms_norm` (gate None) or `gated_rms_norm` with autograd through one native pass each way
    (`_RMSNormFn`): fp32 CPU tensors with a gradient to record, x [..., D], gate like x, weight [D] (or
    None without a gate), not while torch.compile traces -> [..., D]; None when they do not fit or the
    kernel is not built (the caller takes its torch path)."""
    tensors = [t for t in (x, gate, weight) if t is not None]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    D = x.shape[-1] if x.dim() else 0
    fits = (
        grad
        and D > 0
        and x.numel() > 0
        and (weight is None or weight.shape == (D,))
        and (gate is None or (gate.shape == x.shape and weight is not None))
        and native.fp32_cpu(*tensors)
        and not torch.compiler.is_compiling()
    )
    if not fits or native.function("rms_norm", "k3_rms_norm_grad", _GRAD_ARGS) is None:
        return None
    g = None if gate is None else gate.reshape(-1, D).contiguous()
    w = None if weight is None else weight.contiguous()
    return _RMSNormFn.apply(x.reshape(-1, D).contiguous(), g, w, float(eps)).view(x.shape)
