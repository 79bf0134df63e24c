"""Basic layers shared by the whole model.

`Linear` is the one linear class of the model: QAT and quantized inference swap it
(CONTRIBUTING.md#quantization-by-module-swap), so every projection in the trunk is a `k3.model.layers.Linear`.
Weights are stored [out, in] as in the checkpoint.
"""

import torch
from torch import nn

from k3.ops.norm import rms_norm


class Linear(nn.Linear):
    """A bias-free (by default) linear layer; the swap point for quantization."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: fp32 normalization, cast back, times `weight` [D] (docs/spec.md#forward)."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
