"""Gated RMSNorm on the KDA output (docs/spec.md#kda): normalize per head, scale, then gate with sigmoid.

    y = (o / sqrt(mean_V(o^2) + eps)) * weight * sigmoid(gate)      (normalize-then-gate)

One weight [V] shared by all heads. The whole expression is computed in fp32 (the weight is fp32 in the
checkpoint) and cast back to o's dtype once. `gated_rms_norm_reference` is the plain torch form;
`gated_rms_norm` the fast path with the same signature and result (to fp32 rounding): on fp32 CPU
tensors one native pass per row (`k3/ops/csrc/rms_norm.c`; with a gradient `k3.ops.norm.rms_norm_train`,
a native backward too), else the reference. The torch
form's eight passes over o run from memory once it outgrows L2 (k3-small prefill, [8, 256, 8, 128]:
~11 ms per layer in the engine).
"""

import torch

from k3.ops import native
from k3.ops.norm import GATED_ARGS, rms_norm_train


def _check(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> None:
    if gate.shape != o.shape:
        raise ValueError(f"gate must have o's shape {tuple(o.shape)}, got {tuple(gate.shape)}")
    if weight.shape != o.shape[-1:]:
        raise ValueError(f"weight must be [{o.shape[-1]}], got shape {tuple(weight.shape)}")


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o [..., V] (e.g. [B, T, H, V]), gate like o, weight [V] -> [..., V] in o's dtype."""
    _check(o, gate, weight)
    out = rms_norm_train(o, gate, weight, eps)
    if out is not None:
        return out
    fn = native.kernel_function("rms_norm", "k3_gated_rms_norm", GATED_ARGS, o, gate, weight)
    if fn is None or o.numel() == 0:
        return gated_rms_norm_reference(o, gate, weight, eps)
    oc, gc, w = o.contiguous(), gate.contiguous(), weight.contiguous()
    y = torch.empty_like(oc)
    V = o.shape[-1]
    fn(oc.data_ptr(), gc.data_ptr(), w.data_ptr(), y.data_ptr(), oc.numel() // V, V, float(eps))
    return y


def gated_rms_norm_reference(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The plain torch form of `gated_rms_norm` (same signature)."""
    _check(o, gate, weight)
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(o.dtype)
