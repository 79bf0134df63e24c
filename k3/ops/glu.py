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


def situ_glu_reference(
    gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """SiTU-GLU: β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂), in fp32, cast back to `gate.dtype` (autograd-safe)."""
    g, u = gate.float(), up.float()
    out = (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
    return out.to(gate.dtype)


def situ_glu_inplace(
    gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """`situ_glu_reference` without autograd: the same fp32 operations in the same order, so the result
    is bit for bit the same, but the chain runs in place on three fresh buffers instead of allocating
    one per op (for an expert's [T·k, I] activations the allocations alone cost as much as the maths).
    Never writes to `gate` or `up`."""
    g, u = gate.float(), up.float()
    a = torch.div(g, beta1).tanh_().mul_(beta1).mul_(torch.sigmoid(g))
    return a.mul_(torch.div(u, beta2).tanh_().mul_(beta2)).to(gate.dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU: β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂), in fp32, cast back to `gate.dtype`.

    Takes `situ_glu_inplace` when no gradient is needed (inference), else `situ_glu_reference`; both
    give identical values."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return situ_glu_reference(gate, up, beta1, beta2)
    return situ_glu_inplace(gate, up, beta1, beta2)


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
