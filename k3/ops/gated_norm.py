"""Gated RMSNorm on the KDA output (SPEC §3.4): normalize per head, scale, then gate with sigmoid.

    y = (o / sqrt(mean_V(o^2) + eps)) * weight * sigmoid(gate)      (normalize-then-gate)

One weight [V] shared by all heads. The whole expression is computed in fp32 (the weight is fp32 in the
checkpoint) and cast back to o's dtype once, as a fused kernel would. (A native one-pass version was
measured at the same speed as these torch ops on [1, 512, 4, 64] and in a whole prefill, so there is
none.)
"""

import torch


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o [..., V] (e.g. [B, T, H, V]), gate like o, weight [V] -> [..., V] in o's dtype."""
    if gate.shape != o.shape:
        raise ValueError(f"gate must have o's shape {tuple(o.shape)}, got {tuple(gate.shape)}")
    if weight.shape != o.shape[-1:]:
        raise ValueError(f"weight must be [{o.shape[-1]}], got shape {tuple(weight.shape)}")
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(o.dtype)
