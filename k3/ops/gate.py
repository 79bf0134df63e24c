"""The KDA forget gate: per (head, key channel) log-decay g, so the retention is alpha = exp(g) (SPEC §3.4).

Shapes: B batch, T tokens, H heads, K key channels per head.

Two forms, chosen by `gate_lower_bound`:

    safe (K3, lower_bound lb in [-5, 0)):  g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias[h, c]))  in (lb, 0)
    Kimi-Linear (lower_bound None):        g = -exp(A_log[h]) * softplus(z + dt_bias[h, c])       in (-inf, 0)

`A_log` is per head ([H]); the checkpoint's zero-padded [128] layout (SPEC §8.1) is cut to [H] by the
checkpoint adapter, not here. The bounded form keeps exp(+-cumsum(g)) inside a chunk well-scaled, which
is what lets the chunked KDA kernel use small tensor-core sub-chunks. Everything is computed in fp32.
"""

import torch
import torch.nn.functional as F


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
    x = z.float() + dt_bias.float().view(H, K)
    a = A_log.float().exp().view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x, beta=1.0, threshold=20.0)
