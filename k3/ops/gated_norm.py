"""Gated RMSNorm on the KDA output (SPEC §3.4): normalize per head, scale, then gate with sigmoid.

    y = (o / sqrt(mean_V(o^2) + eps)) * weight * sigmoid(gate)      (normalize-then-gate)

One weight [V] shared by all heads. The whole expression is computed in fp32 (the weight is fp32 in the
checkpoint) and cast back to o's dtype once, as a fused kernel would; without autograd on fp32 CPU tensors
it is one native pass per row.
"""

import torch

from k3.ops import native

_NORM_ARGS = [native.PTR] * 3 + [native.F32, native.PTR, native.I64, native.I64]  # (o, gate, w, eps, y, N, V)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o [..., V] (e.g. [B, T, H, V]), gate like o, weight [V] -> [..., V] in o's dtype."""
    if gate.shape != o.shape:
        raise ValueError(f"gate must have o's shape {tuple(o.shape)}, got {tuple(gate.shape)}")
    if weight.shape != o.shape[-1:]:
        raise ValueError(f"weight must be [{o.shape[-1]}], got shape {tuple(weight.shape)}")
    y = _gated_rms_norm_native(o, gate, weight, eps)
    if y is not None:
        return y
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(o.dtype)


def _gated_rms_norm_native(o, gate, weight, eps: float) -> torch.Tensor | None:
    """The same maths in one C pass per row (`k3/ops/csrc/kda_pointwise.c`); fp32, no autograd, else None."""
    fits = native.plain(o, gate, weight)
    fn = native.function("kda_pointwise", "k3_gated_rms_norm", _NORM_ARGS) if fits else None
    if fn is None:
        return None
    oc, gc, w = o.contiguous(), gate.contiguous(), weight.contiguous()
    y = torch.empty_like(oc)
    V = o.shape[-1]
    fn(oc.data_ptr(), gc.data_ptr(), w.data_ptr(), float(eps), y.data_ptr(), oc.numel() // max(V, 1), V)
    return y
