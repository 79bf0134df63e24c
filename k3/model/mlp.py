"""The gated MLP: `down_proj(GLU(gate_proj(x), up_proj(x)))`, GLU = SiTU (K3) or SwiGLU
(docs/spec.md#situ-glu).

Used for the dense layer 0 (intermediate = `intermediate_size`, 33792 in the release) and for the shared
experts of every MoE layer, which are one fused GLU of intermediate
`moe_intermediate_size * num_shared_experts` (2 × 3072 = 6144). Checkpoint names: `gate_proj`, `up_proj`,
`down_proj` (docs/spec.md#tensors).
"""

import torch
from torch import nn

from k3.config import K3Config
from k3.model.layers import Linear
from k3.ops.glu import glu_fn


class GLUMLP(nn.Module):
    """x [..., hidden] -> [..., hidden] through a GLU of width `intermediate`."""

    def __init__(self, hidden: int, intermediate: int, config: K3Config):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.act = glu_fn(config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
