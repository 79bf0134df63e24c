"""Gated linear units: K3's SiTU-GLU (SPEC §3.6) and SwiGLU.

    SiTU(g, u) = β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂),   β₁ = 4, β₂ = 25 in the release

SiTU is SwiGLU with both halves soft-clipped: the gate branch g·σ(g) becomes β₁·tanh(g/β₁)·σ(g) (σ still
takes the un-clipped g) and the linear branch u becomes β₂·tanh(u/β₂), so |SiTU| < β₁·β₂ = 100 for any
input, which bounds the activations that reach the down projection (and its MXFP4 quantization). As
β → ∞, β·tanh(x/β) → x and SiTU → SwiGLU. Both are computed in fp32 and cast back to the input dtype.

Shapes: `gate`, `up` [..., I] -> [..., I].
"""

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

GLUFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU: β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂), in fp32, cast back to `gate.dtype`."""
    g, u = gate.float(), up.float()
    out = (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
    return out.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(g)·u, in fp32, cast back to `gate.dtype`."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def glu_fn(hidden_act: str, beta1: float = 4.0, beta2: float = 25.0) -> GLUFn:
    """The GLU named by `config.hidden_act`: "situ" (with its β₁, β₂) or "silu" (SwiGLU)."""
    if hidden_act == "situ":
        return partial(situ_glu, beta1=beta1, beta2=beta2)
    if hidden_act == "silu":
        return swiglu
    raise ValueError(f"hidden_act must be 'situ' or 'silu', got {hidden_act!r}")
