"""Gated linear units: K3's SiTU-GLU (docs/spec.md#situ-glu) and SwiGLU.

    SiTU(g, u) = β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂),   β₁ = 4, β₂ = 25 in the release

SiTU is SwiGLU with both halves soft-clipped: the gate branch g·σ(g) becomes β₁·tanh(g/β₁)·σ(g) (σ still
takes the un-clipped g) and the linear branch u becomes β₂·tanh(u/β₂), so |SiTU| < β₁·β₂ = 100 for any
input, which bounds the activations that reach the down projection (and its MXFP4 quantization). As
β → ∞, β·tanh(x/β) → x and SiTU → SwiGLU. Both are computed in fp32 and cast back to the input dtype.

Shapes: `gate`, `up` [..., I] -> [..., I].
"""

import contextlib
import contextvars
import warnings
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from k3.ops import native

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


# odd Taylor coefficients of tanh(y) / y in y^2 up to y^10: below |y| = 0.3 the next term is < 6e-8 relative
_TANH_SERIES = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925)
_SERIES_MAX = 0.3
_EXP_CAP = 60.0  # e^60 keeps (1 - e) / (1 + e) finite (-1) and sends 1 / (1 + e^2) to 0 without inf/inf


def _tanh_from_exp(y: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """tanh(y) given e = exp(-2y): (1 - e) / (1 + e), or the odd series near 0 where that cancels."""
    y2 = y * y
    series = _TANH_SERIES[-1]
    for c in reversed(_TANH_SERIES[:-1]):
        series = series * y2 + c
    return torch.where(y.abs() < _SERIES_MAX, y * series, (1 - e) / (1 + e))


def situ_glu_fused(
    gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """`situ_glu_reference` written for a fusing compiler: two exponentials per element instead of two
    tanh and a sigmoid (tanh is ~4x a sigmoid on the CPUs we measure), within ~1e-6 relative of it.

    With e = exp(-g/2): σ(g) = 1 / (1 + e²) and tanh(g/β₁) = tanh(y), y = g/β₁, from exp(-2y) = e when
    β₁ = 4 (else its own exponential); near 0 tanh comes from its odd series, since (1 - e) / (1 + e)
    cancels there. Exponents are capped at 60 so saturated inputs give the exact limits, never inf/inf.
    Eager, its ~40 small ops are slower than the reference; `torch.compile` fuses them into one loop
    (k3-tiny expert activations [2048, 256], one thread: 2.1 vs 6.4 ms)."""
    g, u = gate.float(), up.float()
    e = torch.exp((g * -0.5).clamp(max=_EXP_CAP))
    sig = 1 / (1 + e * e)
    y = g / beta1
    e_y = e if beta1 == 4.0 else torch.exp((y * -2).clamp(max=_EXP_CAP))
    z = u / beta2
    e_z = torch.exp((z * -2).clamp(max=_EXP_CAP))
    out = (beta1 * _tanh_from_exp(y, e_y) * sig) * (beta2 * _tanh_from_exp(z, e_z))
    return out.to(gate.dtype)


FUSED_MIN_ELEMENTS = 1 << 15  # smaller inputs stay eager: a compiled call costs ~0.2 ms of guards and glue
_FUSED = contextvars.ContextVar("k3_fused_activations", default=False)
_COMPILED: list = []  # [torch.compile(situ_glu_fused)] once built; [None] after it failed


@contextlib.contextmanager
def fused_activations(enabled: bool = True):
    """Within the block, SiTU-GLU without autograd runs `situ_glu_fused` compiled by torch.compile
    (built on first use, dynamic shapes; a failure to compile warns once and leaves the eager path).
    The engine's prefill uses it when `EngineConfig.compile` is set."""
    token = _FUSED.set(enabled)
    try:
        yield
    finally:
        _FUSED.reset(token)


def fused_activations_enabled() -> bool:
    return _FUSED.get() and (not _COMPILED or _COMPILED[0] is not None)


def _situ_compiled(gate, up, beta1, beta2) -> torch.Tensor | None:
    if not _COMPILED:
        _COMPILED.append(torch.compile(situ_glu_fused, dynamic=True, fullgraph=True))
    try:
        return _COMPILED[0](gate, up, beta1, beta2)
    except Exception as e:  # noqa: BLE001 - e.g. no C++ compiler: stay eager from now on
        warnings.warn(f"fused SiTU disabled, running eagerly: {type(e).__name__}: {e}", stacklevel=3)
        _COMPILED[0] = None
        return None


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU: β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂), in fp32, cast back to `gate.dtype`.

    With a gradient: `situ_glu_train` (native forward and backward) when it fits, else
    `situ_glu_reference`. Without one: `situ_glu_fused` (to ~1e-6) while
    torch.compile traces the caller; else the native kernel when it is built (`situ_glu_native`, one C
    pass); else `situ_glu_fused` compiled on its own inside
    `fused_activations()`, or `situ_glu_inplace` (the reference's values bit for bit)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        out = situ_glu_train(gate, up, beta1, beta2)
        return situ_glu_reference(gate, up, beta1, beta2) if out is None else out
    if torch.compiler.is_compiling():
        return situ_glu_fused(gate, up, beta1, beta2)
    out = situ_glu_native(gate, up, beta1, beta2)
    if out is not None:
        return out
    if gate.numel() >= FUSED_MIN_ELEMENTS and fused_activations_enabled():
        out = _situ_compiled(gate, up, beta1, beta2)
        if out is not None:
            return out
    return situ_glu_inplace(gate, up, beta1, beta2)


_SITU_ARGS = [native.PTR] * 3 + [native.I64, native.F32, native.F32]  # k3_situ_glu(gate, up, out, n, b1, b2)


def situ_glu_native(
    gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor | None:
    """SiTU-GLU as one vectorised C pass (`k3/ops/csrc/situ_glu.c`): fp32 CPU tensors of one shape, no
    autograd -> a new tensor; None when the kernel is not built or the inputs do not fit (the caller then
    takes a torch path). Written in |g|, |u| with expm1 so that the three factors share one division and
    no series is needed near 0; two exponentials per element when β₁ = 4. Within ~5e-7 relative of the
    float64 truth (the reference: ~3e-7)."""
    fits = (
        gate.shape == up.shape and gate.is_contiguous() and up.is_contiguous() and native.fp32_cpu(gate, up)
    )
    fn = native.function("situ_glu", "k3_situ_glu", _SITU_ARGS) if fits else None
    if fn is None:
        return None
    out = torch.empty_like(gate)
    fn(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), float(beta1), float(beta2))
    return out


_TEAM_ARGS = _SITU_ARGS  # k3_situ_glu_team: the same forward split over torch's threads
# k3_situ_glu_backward(gate, up, dout, dgate, dup, n, b1, b2)
_BACKWARD_ARGS = [native.PTR] * 5 + [native.I64, native.F32, native.F32]


class _SituGLU(torch.autograd.Function):
    """SiTU-GLU with native forward and backward passes (k3/ops/csrc/situ_glu.c): saves only gate and
    up, and the backward recomputes the factors from them in one pass (the reference's autograd graph
    keeps ~8 [T, I] intermediates and runs ~20 passes over them)."""

    @staticmethod
    def forward(ctx, gate, up, beta1: float, beta2: float):
        fn = native.function("situ_glu", "k3_situ_glu_team", _TEAM_ARGS)
        out = torch.empty_like(gate)
        fn(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), beta1, beta2)
        ctx.save_for_backward(gate, up)
        ctx.betas = (beta1, beta2)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        fn = native.function("situ_glu", "k3_situ_glu_backward", _BACKWARD_ARGS)
        d = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        ptrs = (t.data_ptr() for t in (gate, up, d, dgate, dup))
        fn(*ptrs, gate.numel(), *ctx.betas)
        return dgate, dup, None, None


def situ_glu_train(
    gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor | None:
    """`situ_glu_reference` with autograd through one native pass each way (`_SituGLU`): fp32 contiguous
    CPU tensors of one shape, not while torch.compile traces; None when they do not fit or the kernel
    is not built (the caller takes the reference). Same values as `situ_glu_native`; gradients within
    ~1e-6 relative of the reference's."""
    fits = (
        gate.shape == up.shape
        and gate.is_contiguous()
        and up.is_contiguous()
        and native.fp32_cpu(gate, up)
        and not torch.compiler.is_compiling()
    )
    if not fits or native.function("situ_glu", "k3_situ_glu_backward", _BACKWARD_ARGS) is None:
        return None
    return _SituGLU.apply(gate, up, float(beta1), float(beta2))


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
