"""Stable LatentMoE (docs/spec.md#latentmoe): FP32 sigmoid router with Quantile Balancing, experts in a latent
width.

    h [T, D] --gate (fp32)--> p [T, k], idx [T, k]          selection on s + b, weights from s
    z = routed_expert_down_proj(h)                 [T, Dl]   one down-projection shared by all experts
    u = Σ_i p_i E_i(z)                             [T, Dl]   fp32 accumulate, cast back
    y = routed_expert_up_proj(routed_expert_norm(u)) + shared_experts(h)

With `use_latent_moe=False` (the K2-style plain-MoE ablation) there is no down/norm/up: the experts work
at width D and y = Σ_i p_i E_i(h) + shared_experts(h).

Module names are the checkpoint names under `block_sparse_moe.` (docs/spec.md#tensors). The routed experts are
stored stacked (`experts.w1` [E, I, Dl], `w2` [E, Dl, I], `w3` [E, I, Dl]); the checkpoint adapter maps
them to and from the per-expert `experts.{e}.w1.weight` tensors.

The router bias `gate.e_score_correction_bias` is an F32 checkpoint buffer that receives no gradient.
In training mode the router records each forward's scores and load; `update_bias()` (once per optimizer
step, after all micro-batches) turns that record into the next bias: Quantile Balancing by default,
DeepSeek-V3's sign update with `bias_update="sign"`. See docs/architecture.md.
"""

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.layers import Linear, RMSNorm
from k3.model.mlp import GLUMLP
from k3.ops.glu import GLUFn, glu_fn
from k3.ops.moe import EXPERT_IMPLS, expert_load, quantile_balance_bias, route, sign_update_bias


class Router(nn.Module):
    """Sigmoid top-k router with a selection-only bias. h [T, D] -> (weights [T, k] fp32, indices [T, k])."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_token
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        grouped = config.use_grouped_topk and config.num_expert_group > 1
        self.num_expert_group = config.num_expert_group if grouped else 1
        self.topk_group = config.topk_group if grouped else 1
        self.bias_update, self.bias_update_rate = config.bias_update, config.bias_update_rate
        self.init_std = config.initializer_range
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self._scores: list[torch.Tensor] = []  # per-forward detached scores [T, E] (QB only)
        self._load: torch.Tensor | None = None  # [E] int64, summed since the last update_bias()
        self._tokens = 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.init_std)
        nn.init.zeros_(self.e_score_correction_bias)

    def _apply(self, fn, recurse=True):
        # A model-wide `.to(bfloat16)` must not round the F32 bias (docs/spec.md#tensors): keep its fp32
        # values and take only the new device.
        bias = self.e_score_correction_bias
        out = super()._apply(fn, recurse)
        if self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.to(self.e_score_correction_bias.device, torch.float32)
        return out

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(h.float(), self.weight.float())  # both upcast (docs/spec.md#latentmoe step 1)
        weights, indices, scores = route(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.renormalize,
            self.scaling,
            self.num_expert_group,
            self.topk_group,
        )
        if self.training:
            self._record(scores.detach(), indices)
        return weights, indices

    @torch.no_grad()
    def _record(self, scores_TE: torch.Tensor, indices_Tk: torch.Tensor) -> None:
        load = expert_load(indices_Tk, self.num_experts)
        self._load = load if self._load is None else self._load + load
        self._tokens += scores_TE.shape[0]
        if self.bias_update == "quantile":
            self._scores.append(scores_TE.float())

    @torch.no_grad()
    def update_bias(self) -> dict | None:
        """Apply QB (or the sign update) from everything recorded since the last call, then clear it.

        Returns None if nothing was recorded, else {"max_load", "min_load"} (the step's busiest and idlest
        expert load as a fraction of the ideal m·k/E, measured with the bias the step was routed with)
        and "tokens" (m). Combine weights never depend on the bias; only the next selections do.
        """
        if self._load is None:
            return None
        ideal = self._tokens * self.top_k / self.num_experts
        stats = {
            "max_load": self._load.max().item() / ideal,
            "min_load": self._load.min().item() / ideal,
            "tokens": self._tokens,
        }
        bias = self.e_score_correction_bias
        if self.bias_update == "quantile":
            new = quantile_balance_bias(torch.cat(self._scores), bias, self.top_k)
        else:
            new = sign_update_bias(self._load, bias, self.bias_update_rate)
        bias.copy_(new)
        self.clear_record()
        return stats

    def clear_record(self) -> None:
        """Drop what was recorded since the last update_bias() (e.g. after a skipped step)."""
        self._scores, self._load, self._tokens = [], None, 0

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, bias_update={self.bias_update}"


class RoutedExperts(nn.Module):
    """E GLU experts stored stacked: w1 (gate) [E, I, Dl], w2 (down) [E, Dl, I], w3 (up) [E, I, Dl].

    forward(z [T, Dl], weights [T, k], indices [T, k], impl=None) -> u [T, Dl] = Σ_i p_i E_i(z).
    `impl` (a key of k3.ops.moe.EXPERT_IMPLS) overrides `self.impl` (default "auto": by size).

    QAT hook: `compute()` is the one place the expert maths runs. A QAT subclass overrides it to
    fake-quantize z and w1/w2/w3 and to wrap `act` (whose output is w2's input), e.g.
    `fn(fq(z), weights, indices, fq(self.w1), fq(self.w2), fq(self.w3), lambda g, u: fq(self.act(g, u)))`.
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        intermediate: int,
        act: GLUFn,
        init_std: float = 0.02,
        impl: str = "auto",
    ):
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"impl must be one of {tuple(EXPERT_IMPLS)}, got {impl!r}")
        self.act, self.impl, self.init_std = act, impl, init_std
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, 0.0, self.init_std)

    def forward(
        self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, impl: str | None = None
    ) -> torch.Tensor:
        impl = impl or self.impl
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"impl must be one of {tuple(EXPERT_IMPLS)}, got {impl!r}")
        return self.compute(EXPERT_IMPLS[impl], z, weights, indices)

    def compute(self, fn, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The expert maths (the QAT override point): `fn` is one of k3.ops.moe.EXPERT_IMPLS."""
        return fn(z, weights, indices, self.w1, self.w2, self.w3, self.act)

    def extra_repr(self) -> str:
        E, I, Dl = self.w1.shape
        return f"experts={E}, dim={Dl}, intermediate={I}, impl={self.impl}"


class LatentMoE(nn.Module):
    """The MoE FFN of layers 1-92 (`block_sparse_moe`). h [B, T, D] (or [T, D]) -> same shape."""

    def __init__(self, config: K3Config):
        super().__init__()
        D, Dl = config.hidden_size, config.expert_width
        self.use_latent_moe = config.use_latent_moe
        self.gate = Router(config)
        self.shared_experts = None
        if config.num_shared_experts > 0:
            inter = config.moe_intermediate_size * config.num_shared_experts
            self.shared_experts = GLUMLP(D, inter, config)
        self.routed_expert_down_proj = self.routed_expert_norm = self.routed_expert_up_proj = None
        if config.use_latent_moe:
            self.routed_expert_down_proj = Linear(D, Dl)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(Dl, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = Linear(Dl, D)
        act = glu_fn(config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta)
        self.experts = RoutedExperts(
            config.num_experts, Dl, config.moe_intermediate_size, act, config.initializer_range
        )

    def reset_parameters(self) -> None:
        """Only the latent norm (ones); gate and experts reset themselves, Linears belong to init_weights."""
        if self.routed_expert_norm is not None:
            nn.init.ones_(self.routed_expert_norm.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])  # [T, D]
        weights, indices = self.gate(x)
        z = self.routed_expert_down_proj(x) if self.use_latent_moe else x
        y = self.experts(z, weights, indices)
        if self.routed_expert_norm is not None:
            y = self._latent_norm(y)
        if self.use_latent_moe:
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(h.shape)

    def _latent_norm(self, y: torch.Tensor) -> torch.Tensor:
        """routed_expert_norm(y); an fp32 call without autograd uses torch's fused RMSNorm (same maths
        as k3.ops.norm.rms_norm in fp32: one op instead of ten on the decode path)."""
        norm = self.routed_expert_norm
        if y.dtype == torch.float32 and type(norm) is RMSNorm and not torch.is_grad_enabled():
            return F.rms_norm(y, (y.shape[-1],), norm.weight.float(), norm.eps)
        return norm(y)


@torch.no_grad()
def update_router_biases(model: nn.Module) -> dict[str, dict]:
    """Call `update_bias()` on every Router in `model`; returns {router module name: stats} for those
    that had recorded something. Call once per optimizer step, after the last micro-batch."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Router):
            stats = module.update_bias()
            if stats is not None:
                out[name] = stats
    return out
