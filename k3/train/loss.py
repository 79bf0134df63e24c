"""The training loss: lm_head + next-token cross-entropy, computed a few hundred rows at a time.

`linear_cross_entropy` is the plain reference: logits = h W^T in full ([N, V] fp32), then the mean
cross-entropy over labels != -100. At the CPU demo's shape (4,096 tokens x 4,096 ids per step) those
logits are 64 MiB that log_softmax, its backward and the matmuls each stream through memory: the head
took ~20 % of a step though it is ~10 % of the FLOPs.

`chunked_linear_cross_entropy` computes the same loss and its gradients in one pass over row chunks
whose logits stay in cache (chunk x V fp32, ~2 MiB at 128 x 4,096): per chunk the logits, their
log-sum-exp, the loss, dlogits = (softmax - onehot) / n, and right away dh = dlogits W and
dW += dlogits^T h. The backward only scales the stored gradients by the incoming one. On fp32 CPU rows the
softmax, loss and dlogits of a chunk are one native call (`k3/ops/csrc/cross_entropy.c`: exp once per
logit, in place), else the torch ops of `_softmax_xent_grad`. Same FLOPs as the
reference (one forward and two backward products), the logits are never written out. It runs in fp32
also under autocast (the head is where bf16 rounding would hurt the loss most).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops import native

IGNORE_INDEX = -100
CHUNK_ROWS = 128


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits h [N, D] @ weight [V, D]^T (fp32) against labels [N] (-100: ignored)."""
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=IGNORE_INDEX)


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int):
        with torch.autocast(h.device.type, enabled=False):
            hf, wf = h.float(), weight.float()
            valid = labels != IGNORE_INDEX
            n = valid.sum().clamp(min=1).to(torch.float32)
            grad_h = torch.empty_like(hf)
            grad_w = torch.zeros_like(wf)
            total = hf.new_zeros(())
            fused = _xent_kernel(hf, labels)
            labels64 = labels.long().where(valid, -1).contiguous() if fused is not None else None
            # one logits buffer for every chunk: a fresh multi-MB tensor per chunk costs page faults
            buf = hf.new_empty(min(chunk, hf.shape[0]), wf.shape[0])
            rows_loss, scale = hf.new_empty(buf.shape[0]), 1 / n.item()  # (the native path's)
            for lo in range(0, hf.shape[0], chunk):
                hc, lab, ok = hf[lo : lo + chunk], labels[lo : lo + chunk], valid[lo : lo + chunk]
                logits = torch.mm(hc, wf.T, out=buf[: hc.shape[0]])  # [c, V]
                if fused is not None:  # the same maths in one native call, in place of the logits
                    p, c = logits, hc.shape[0]
                    fused(p.data_ptr(), labels64[lo:].data_ptr(), rows_loss.data_ptr(), c, p.shape[1], scale)
                    total += rows_loss[:c].sum()
                else:
                    p = _softmax_xent_grad(logits, lab, ok, n, total)
                torch.mm(p, wf, out=grad_h[lo : lo + chunk])
                grad_w.addmm_(p.T, hc)
        ctx.save_for_backward(grad_h.to(h.dtype), grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None


def _softmax_xent_grad(logits, labels, ok, n, total):
    """The torch form of `k3_softmax_xent_grad` (csrc/cross_entropy.c): adds the chunk's loss sum to
    `total` and returns (softmax - onehot) / n in place of the logits (0 on ignored rows)."""
    lse = torch.logsumexp(logits, -1)
    safe = torch.where(ok, labels, 0)
    target = logits.gather(1, safe[:, None])[:, 0]
    total += ((lse - target) * ok).sum()
    p = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    p[torch.arange(p.shape[0], device=p.device), safe] -= 1.0
    return p.mul_((ok.to(p.dtype) / n)[:, None])


# k3_softmax_xent_grad(x, labels, loss, rows, V, scale)
_XENT_ARGS = [native.PTR] * 3 + [native.I64] * 2 + [native.F32]


def _xent_kernel(h: torch.Tensor, labels: torch.Tensor):
    """The native softmax-cross-entropy gradient for fp32 CPU rows (not while compiling), else None."""
    if not native.fp32_cpu(h) or labels.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return native.function("cross_entropy", "k3_softmax_xent_grad", _XENT_ARGS)


def chunked_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = CHUNK_ROWS
) -> torch.Tensor:
    """`linear_cross_entropy` (same signature, plus the rows per chunk) without materializing the logits;
    gradients are computed during the forward, so call it only for a loss that will be backpropagated."""
    if h.ndim != 2 or weight.ndim != 2 or labels.shape != h.shape[:1] or h.shape[1] != weight.shape[1]:
        raise ValueError(
            f"h [N, D], weight [V, D], labels [N] expected, got {tuple(h.shape)}, {tuple(weight.shape)}, "
            f"{tuple(labels.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _ChunkedLinearCE.apply(h, weight, labels, chunk)
