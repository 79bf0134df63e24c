"""RMSNorm as the release computes it (SPEC §3): normalize in fp32, cast back, then scale by the weight.

`rms_norm` is the plain reference and the only implementation (it is already a few fused torch ops).
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D] in x's dtype: (x / sqrt(mean(x^2) + eps)) computed in fp32, then * weight."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight.to(x.dtype)
