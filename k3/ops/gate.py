"""The KDA forget gate: per (head, key channel) log-decay g, so the retention is alpha = exp(g)
(docs/spec.md#kda).

Shapes: B batch, T tokens, H heads, K key channels per head.

Two forms, chosen by `gate_lower_bound`:

    safe (K3, lower_bound lb in [-5, 0)):  g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias[h, c]))  in (lb, 0)
    Kimi-Linear (lower_bound None):        g = -exp(A_log[h]) * softplus(z + dt_bias[h, c])       in (-inf, 0)

`A_log` is per head ([H]); the checkpoint's zero-padded [128] layout (docs/spec.md#choices) is cut to [H] by
the checkpoint adapter, not here. The bounded form keeps exp(+-cumsum(g)) inside a chunk well-scaled, which
is what lets the chunked KDA kernel use small tensor-core sub-chunks. Everything is computed in fp32; the
safe form without autograd runs as one native pass where the kernel is built.
"""

import torch
import torch.nn.functional as F

from k3.ops import native

# k3_kda_safe_gate(z, A_log, dt_bias, lower_bound, g, N, H, K)
_GATE_ARGS = [native.PTR] * 3 + [native.F32, native.PTR] + [native.I64] * 3


def kda_gate(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Raw decay logits z [B, T, H, K], A_log [H], dt_bias [H*K] -> log-decay g [B, T, H, K] (fp32, <= 0)."""
    if z.dim() != 4:
        raise ValueError(f"z must be [B, T, H, K], got shape {tuple(z.shape)}")
    H, K = z.shape[-2:]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must be [H]=[{H}], got shape {tuple(A_log.shape)}")
    if dt_bias.shape != (H * K,):
        raise ValueError(f"dt_bias must be [H*K]=[{H * K}], got shape {tuple(dt_bias.shape)}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative or None, got {lower_bound!r}")
    if lower_bound is not None:
        g = _safe_gate_native(z, A_log, dt_bias, lower_bound)
        if g is not None:
            return g
    x = z.float() + dt_bias.float().view(H, K)
    a = A_log.float().exp().view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x, beta=1.0, threshold=20.0)


def _safe_gate_native(z, A_log, dt_bias, lower_bound: float) -> torch.Tensor | None:
    """The safe form in one C pass (`k3/ops/csrc/kda_pointwise.c`); fp32, no autograd, else None."""
    fn = native.kernel_function("kda_pointwise", "k3_kda_safe_gate", _GATE_ARGS, z, A_log, dt_bias)
    if fn is None:
        return None
    H, K = z.shape[-2:]
    zc, a, b = z.contiguous(), A_log.contiguous(), dt_bias.contiguous()
    g = torch.empty_like(zc)
    fn(
        zc.data_ptr(),
        a.data_ptr(),
        b.data_ptr(),
        float(lower_bound),
        g.data_ptr(),
        zc.numel() // (H * K),
        H,
        K,
    )
    return g
