"""Rotary position embedding, used only by the K2-style MLA ablation (`mla_use_nope=False`).

K3 itself has no positional encoding in the trunk (docs/spec.md#mla): q_pe/k_pe stay un-rotated. With the
ablation on, q_pe and the shared k_pe are rotated by their token position with base `rope_theta`.

Convention: the "half-split" pairing, channel i rotates with channel i + Dr/2 at frequency
theta^(-2i/Dr). (Pairing only matters for loading foreign checkpoints; this path is trained from scratch.)
Computed in fp32, cast back to x's dtype.
"""

import torch


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., T] (int) -> (cos, sin) [..., T, dim/2] fp32."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim)
    ang = positions.double()[..., None] * inv_freq  # fp64 so large positions keep their phase
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., T, Dr], positions broadcastable to x[..., 0] (e.g. [T], [B, T], [B, 1, T]) -> [..., T, Dr]."""
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"RoPE needs an even last dim, got x of shape {tuple(x.shape)}")
    if theta <= 0:
        raise ValueError(f"theta must be positive, got {theta!r}")
    cos, sin = rope_angles(positions, dim, theta)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
