"""Block Attention Residuals wiring (docs/spec.md#attnres).

A decoder layer does not read a residual stream: its mixer and FFN inputs are depth-softmax mixtures
(`k3.ops.attnres.attn_res`) over the completed block representations R and the running partial sum P of
the current block. Each mixture has a pseudo-query `*_res_proj.weight` [1, D] and a key-norm weight
`*_res_norm.weight` [D] (checkpoint names). The pseudo-query starts at zero, i.e. uniform averaging.
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from k3.ops.attnres import attn_res


class AttnResQuery(nn.Module):
    """The pseudo-query of one AttnRes mixture: `weight` [1, D] (stored like a D -> 1 projection)."""

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim, device=device, dtype=dtype))


class AttnResKeyNorm(nn.Module):
    """The key-norm weight gamma [D] of one AttnRes mixture (the RMS itself is inside the op)."""

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))


def mix(
    blocks: list[torch.Tensor], partial: torch.Tensor | None, query: AttnResQuery, norm: AttnResKeyNorm
) -> torch.Tensor:
    """AttnRes([R..., P]) for one sub-layer; P may be absent right after a block boundary."""
    sources = blocks if partial is None else [*blocks, partial]
    return attn_res(sources, query.weight[0], norm.weight)


@dataclass
class BlockStream:
    """What flows between decoder layers: completed blocks R and the current partial sum P."""

    blocks: list[torch.Tensor] = field(default_factory=list)
    partial: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        self.partial = x if self.partial is None else self.partial + x

    def keep_last(self, n: int) -> None:
        """Cut every block and the partial sum to their last n positions ([B, T, D] -> [B, n, D] views)."""
        cut = lambda t: t[:, t.shape[1] - n :]
        self.blocks = [cut(b) for b in self.blocks]
        self.partial = None if self.partial is None else cut(self.partial)

    def close_block(self) -> None:
        """Block boundary: the partial sum becomes a completed block, and a new block starts empty."""
        self.blocks.append(self.partial)
        self.partial = None
