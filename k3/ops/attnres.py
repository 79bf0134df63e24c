"""Attention Residuals aggregation over depth (docs/spec.md#attnres).

Given n source vectors per token v_0..v_{n-1} (completed block representations and the running partial
sum), a pseudo-query w [D] and a key-norm weight gamma [D], computed in fp32:

    s_i = sum_c (v_i[c] / rms(v_i)) * gamma[c] * w[c],   rms(v) = sqrt(mean_c v[c]^2 + eps)
    alpha = softmax_i(s)
    out = sum_i alpha_i * v_i        (the mixture is over the RAW sources; cast back to the input dtype)

`attn_res_reference` is the plain per-source reference; `attn_res` the fast path (on fp32 CPU tensors one
native pass: `attn_res_train` with a gradient, forward and backward, `attn_res_native` without; else
stacked for small sources, streamed source by source for large ones). Same signature; tests compare them
forward and backward.
"""

import torch

from k3.ops import native

ATTN_RES_EPS = 1e-5


def attn_res_reference(
    sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float = ATTN_RES_EPS
) -> torch.Tensor:
    """sources: n tensors [..., D] (same shape/dtype); query, norm_weight: [D] -> [..., D]."""
    if len(sources) == 1:
        return sources[0]
    qk = norm_weight.float() * query.float()
    scores = []
    for v in sources:
        vf = v.float()
        rms = torch.sqrt(vf.pow(2).mean(-1) + eps)
        scores.append((vf * qk).sum(-1) / rms)
    alpha = torch.softmax(torch.stack(scores, 0), dim=0)  # [n, ...]
    out = sum(a.unsqueeze(-1) * v.float() for a, v in zip(alpha, sources, strict=True))
    return out.to(sources[0].dtype)


STREAM_MIN_ELEMENTS = 1 << 16  # `attn_res`: sources at least this large take the per-source streaming form


def attn_res(
    sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float = ATTN_RES_EPS
) -> torch.Tensor:
    """Fast path of `attn_res_reference` (same signature and result). Small sources (decode rows) are stacked
    and scored in one pass of a few ops; large ones (prefill) are scored and mixed source by source, two
    reads each (a mat-vec and a norm) and no [n, ..., D] stack or squared copy: the stack of three
    512 x 256 sources outgrows a 512 KB L2 and every pass over it then runs from L3 (k3-tiny prefill:
    890 -> ~300 us per mixture)."""
    if len(sources) == 1:
        return sources[0]
    qk = (norm_weight.float() * query.float()).reshape(-1)
    out = attn_res_train(sources, qk, eps)
    if out is not None:
        return out
    out = attn_res_native(sources, qk, eps)
    if out is not None:
        return out
    if sources[0].numel() < STREAM_MIN_ELEMENTS:
        v = torch.stack(sources, 0).float()  # [n, ..., D]
        scores = (v @ qk) * torch.rsqrt(v.pow(2).mean(-1) + eps)  # [n, ...]
        alpha = torch.softmax(scores, dim=0).unsqueeze(-1)
        return (alpha * v).sum(0).to(sources[0].dtype)
    D = qk.shape[0]
    vs = [v.float() for v in sources]
    ms = [torch.linalg.vector_norm(v, dim=-1).square() / D for v in vs]  # mean of squares [...]
    scores = torch.stack([(v @ qk) * torch.rsqrt(m + eps) for v, m in zip(vs, ms, strict=True)])
    alpha = torch.softmax(scores, dim=0).unsqueeze(-1)  # [n, ..., 1]
    out = vs[0] * alpha[0]
    for a, v in zip(alpha[1:], vs[1:], strict=True):
        out = out + v * a if out.requires_grad else out.addcmul_(v, a)
    return out.to(sources[0].dtype)


_NATIVE_ARGS = [native.PTR, native.I64, native.I64, native.I64, native.PTR, native.F32, native.PTR]
NATIVE_MAX_SOURCES = 64  # the kernel's score buffer (MAX_SOURCES in attn_res.c); K3 mixes at most 10


def attn_res_native(sources: list[torch.Tensor], qk: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The mixture in one C pass (`k3/ops/csrc/attn_res.c`): each token's n source rows are scored,
    softmaxed and mixed while they sit in L1 (the torch paths read every source twice from memory).
    sources: n contiguous fp32 CPU tensors [..., D] of one shape, no autograd; qk = norm_weight * query
    [D] fp32 -> [..., D] fp32; None when the inputs do not fit, torch.compile is tracing, or the kernel is
    not built."""
    s0 = sources[0]
    fits = (
        len(sources) <= NATIVE_MAX_SOURCES
        and all(v.shape == s0.shape and v.is_contiguous() for v in sources)
        and qk.is_contiguous()
    )
    fn = native.kernel_function("attn_res", "k3_attn_res", _NATIVE_ARGS, qk, *sources) if fits else None
    return None if fn is None else _mix(fn, sources, qk, eps)


def _mix(fn, sources: list[torch.Tensor], qk: torch.Tensor, eps: float) -> torch.Tensor:
    """One call of the forward kernel `fn` (k3_attn_res) on contiguous fp32 sources -> a new [..., D]."""
    s0 = sources[0]
    out = torch.empty_like(s0)
    ptrs = torch.tensor([v.data_ptr() for v in sources], dtype=torch.int64)
    D = s0.shape[-1]
    fn(ptrs.data_ptr(), len(sources), s0.numel() // max(D, 1), D, qk.data_ptr(), eps, out.data_ptr())
    return out


# k3_attn_res_grad(sources, n, rows, D, qk, eps, dout, dsrc, dqk_part, threads)
_GRAD_ARGS = [native.PTR, native.I64, native.I64, native.I64, native.PTR, native.F32, native.PTR, native.PTR]
_GRAD_ARGS += [native.PTR, native.I64]


class _AttnRes(torch.autograd.Function):
    """The mixture with native forward and backward passes (`k3/ops/csrc/attn_res.c`): qk [D], n sources
    [..., D] -> [..., D]. Saves the sources (the caller keeps them alive anyway) and recomputes the scores
    in the backward, so no [n, ..., D] stack or per-source intermediate is stored."""

    @staticmethod
    def forward(ctx, qk, eps, *sources):
        out = _mix(native.function("attn_res", "k3_attn_res", _NATIVE_ARGS), list(sources), qk, eps)
        ctx.save_for_backward(qk, *sources)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, dout):
        qk, *sources = ctx.saved_tensors
        fn = native.function("attn_res", "k3_attn_res_grad", _GRAD_ARGS)
        D, threads = qk.shape[0], max(1, torch.get_num_threads())
        dout = dout.contiguous()
        grads = [torch.empty_like(v) for v in sources]
        dqk = torch.zeros(threads, D)  # a team smaller than `threads` leaves rows untouched
        src = torch.tensor([v.data_ptr() for v in sources], dtype=torch.int64)
        dst = torch.tensor([v.data_ptr() for v in grads], dtype=torch.int64)
        rows = sources[0].numel() // D
        fn(src.data_ptr(), len(sources), rows, D, qk.data_ptr(), ctx.eps, dout.data_ptr(), dst.data_ptr(),
           dqk.data_ptr(), threads)  # fmt: skip
        return dqk.sum(0), None, *grads


def attn_res_train(sources: list[torch.Tensor], qk: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`attn_res` with autograd through one native pass each way (`_AttnRes`): contiguous fp32 CPU
    sources of one shape with a gradient to record (not while torch.compile traces); qk [D] fp32 ->
    [..., D]; None when they do not fit or the kernel is not built (the caller takes a torch path)."""
    grad = torch.is_grad_enabled() and (qk.requires_grad or any(v.requires_grad for v in sources))
    s0 = sources[0]
    fits = (
        grad
        and len(sources) <= NATIVE_MAX_SOURCES
        and all(v.shape == s0.shape and v.is_contiguous() for v in sources)
        and native.fp32_cpu(qk, *sources)
        and not torch.compiler.is_compiling()
    )
    if not fits or native.function("attn_res", "k3_attn_res_grad", _GRAD_ARGS) is None:
        return None
    return _AttnRes.apply(qk.contiguous(), float(eps), *sources)
