"""Weight initialization for K3, in one place (CONTRIBUTING.md#one-init). Build on the meta device, then call
this.

| parameter                                        | init                                            |
|--------------------------------------------------|-------------------------------------------------|
| every `Linear` weight, embeddings, stacked experts| normal(0, initializer_range)                    |
| `o_proj`, `down_proj`, `w2`, `routed_expert_up_proj`| normal(0, initializer_range / sqrt(2 * layers)) |
| RMSNorm weights, AttnRes key norms               | ones                                            |
| AttnRes pseudo-queries (`*_res_proj`)            | zeros (uniform averaging over depth at start)   |
| router bias `e_score_correction_bias`            | zeros                                           |
| KDA `A_log`, `dt_bias`, conv weights             | the layer's own `reset_parameters()` (fla init) |

The scaled init of the residual-writing projections is the GPT-2 rule; with AttnRes it keeps the partial
sums at a comparable scale to the embedding at the start of training.
"""

import math

import torch
from torch import nn

from k3.model.attnres import AttnResKeyNorm, AttnResQuery
from k3.model.layers import Linear, RMSNorm

_OUTPUT_PROJ = ("o_proj", "down_proj", "routed_expert_up_proj")


@torch.no_grad()
def init_weights(
    model: nn.Module, initializer_range: float, num_layers: int, seed: int | None = None
) -> None:
    """Initialize every parameter of a K3 model (materialize with `model.to_empty(device=...)` first)."""
    if seed is not None:
        torch.manual_seed(seed)
    out_std = initializer_range / math.sqrt(2 * num_layers)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, Linear):
            nn.init.normal_(module.weight, 0.0, out_std if leaf in _OUTPUT_PROJ else initializer_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, initializer_range)
        elif isinstance(module, RMSNorm | AttnResKeyNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, AttnResQuery):
            nn.init.zeros_(module.weight)
        elif hasattr(module, "reset_parameters") and not isinstance(module, nn.Embedding | nn.Linear):
            module.reset_parameters()  # KDA gate/conv params, router bias, stacked experts
    for name, p in model.named_parameters():
        if name.endswith("experts.w2"):
            nn.init.normal_(p, 0.0, out_std)
