"""Quantile Balancing across ranks, the scalable histogram form (docs/spec_training.md#quantile-balancing).

The exact form (k3.ops.moe.quantile_balance_bias) needs every margin of the step's m tokens in one
place. Across ranks each router instead keeps, per expert, a histogram of its margins
μ_tj = s_tj - c_t (c_t = the token's (k+1)-th biased score) with B equal bins over [lo, hi] (default
512 on [-1, 1], outliers clamped into the end bins), accumulated on the device over micro-batches. Once
per optimizer step all routers' histograms (and loads) are summed with ONE integer all-reduce, and each
expert's threshold is read from its histogram: with q = m·k/E and `above_b` the count in bins above b,
the crossing bin is the one with above_b <= q < above_b + n_b, and

    τ_j = hi_b - (q - above_b) / n_b · w          (linear interpolation inside the bin, w = bin width)

so (with margins spread uniformly inside the bin) exactly q margins exceed τ_j. The exact τ_j lies in
the same bin, hence |τ_hist - τ_exact| <= w. Then b̂ = -τ and b_new = b̂ - mean(b̂), as in the exact form.

Histogram counts add exactly, so the result does not depend on how tokens are split over ranks or
micro-batches: the dp x ep run and the one-process run get the same bias from the same tokens.
`HistogramRouter` is a Router subclass (swapped in by `apply_histogram_qb`); its recording does no host
sync (scatter_add instead of bincount), and its extra state is not in the state_dict.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3.config import K3Config
from k3.model.moe import Router

DEFAULT_BINS, DEFAULT_RANGE = 512, (-1.0, 1.0)


# ---- pure maths ------------------------------------------------------------------------------------
def margins(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """μ = s - c_t, c_t = (k+1)-th largest of s_t + b. [T, E] -> [T, E] fp32."""
    s = scores_TE.float()
    cutoff_T = (s + bias_E.float()).topk(top_k + 1, dim=-1).values[:, top_k]
    return s - cutoff_T[:, None]


def margin_histogram(mu_TE: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """Per-expert counts of μ in `bins` equal bins over [lo, hi], clamped: [T, E] -> [E, bins] int64."""
    T, E = mu_TE.shape
    b = ((mu_TE - lo) * (bins / (hi - lo))).floor().clamp_(0, bins - 1).long()  # [T, E]
    flat = (torch.arange(E, device=mu_TE.device) * bins + b).reshape(-1)
    hist = torch.zeros(E * bins, dtype=torch.long, device=mu_TE.device)
    return hist.scatter_add_(0, flat, torch.ones_like(flat)).view(E, bins)


def histogram_quantile(hist_EB: torch.Tensor, q: torch.Tensor | float, lo: float, hi: float) -> torch.Tensor:
    """τ_j with (interpolated) q of expert j's counts above it: hist [E, B] int, q scalar -> [E] fp32.

    q must satisfy 0 <= q < m (m = counts per row; every row has the same m)."""
    E, B = hist_EB.shape
    width = (hi - lo) / B
    n = hist_EB.double()
    at_or_above = n.flip(-1).cumsum(-1).flip(-1)  # [E, B]: counts in bins >= b
    above = at_or_above - n
    q = torch.as_tensor(q, dtype=torch.float64, device=hist_EB.device)
    crossing = (above <= q) & (q < at_or_above)
    b = crossing.to(torch.int8).argmax(-1)  # the one crossing bin per row
    n_b = n.gather(1, b[:, None])[:, 0]
    above_b = above.gather(1, b[:, None])[:, 0]
    upper = lo + (b + 1).double() * width
    return (upper - (q - above_b) / n_b * width).float()


def histogram_balance_bias(hist_EB: torch.Tensor, top_k: int, lo: float, hi: float) -> torch.Tensor:
    """QB from summed histograms: b̂ = -τ at q = m·k/E, re-centred to mean zero. [E, B] -> [E] fp32."""
    E = hist_EB.shape[0]
    if top_k >= E:
        return torch.zeros(E, dtype=torch.float32, device=hist_EB.device)
    m = hist_EB[0].sum().double()
    b_hat = -histogram_quantile(hist_EB, m * top_k / E, lo, hi)
    return b_hat - b_hat.mean()


# ---- the router -------------------------------------------------------------------------------------
class HistogramRouter(Router):
    """Router whose QB record is a margin histogram [E, bins] + load [E] on the device.

    `update_bias()` sums them over `group` (None: the default group, i.e. every rank -- the data/loss
    group; scores are not replicated under dp x ep) with one all-reduce for this layer;
    `update_all_router_biases` does every layer with one all-reduce in total.
    """

    def __init__(self, config: K3Config, group=None, bins: int = DEFAULT_BINS, value_range=DEFAULT_RANGE):
        super().__init__(config)
        if bins < 2 or not value_range[0] < value_range[1]:
            raise ValueError(f"bins must be >= 2 and value_range increasing; got {bins}, {value_range}")
        self.group, self.bins, self.value_range = group, bins, tuple(value_range)
        self._hist: torch.Tensor | None = None

    @torch.no_grad()
    def _record(self, scores_TE: torch.Tensor, indices_Tk: torch.Tensor) -> None:
        flat = indices_Tk.reshape(-1)
        load = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        load.scatter_add_(0, flat, torch.ones_like(flat))
        self._load = load if self._load is None else self._load + load
        self._tokens += scores_TE.shape[0]
        if self.bias_update == "quantile" and self.top_k < self.num_experts:
            mu = margins(scores_TE, self.e_score_correction_bias, self.top_k)
            hist = margin_histogram(mu, self.bins, *self.value_range)
            self._hist = hist if self._hist is None else self._hist + hist

    def packed_record(self) -> torch.Tensor | None:
        """[E + E*bins] int64: load then histogram (zeros if nothing was recorded here)."""
        E = self.num_experts
        dev = self.e_score_correction_bias.device
        load = self._load if self._load is not None else torch.zeros(E, dtype=torch.long, device=dev)
        hist = (
            self._hist if self._hist is not None else torch.zeros(E, self.bins, dtype=torch.long, device=dev)
        )
        return torch.cat([load, hist.reshape(-1)])

    @torch.no_grad()
    def apply_record(self, packed: torch.Tensor) -> dict | None:
        """Set the next bias from a summed `packed_record()`; returns Router.update_bias()'s stats."""
        E = self.num_experts
        load, hist = packed[:E], packed[E:].view(E, self.bins)
        tokens = int(load.sum()) // self.top_k
        self.clear_record()
        if tokens == 0:
            return None
        ideal = tokens * self.top_k / E
        stats = {"max_load": int(load.max()) / ideal, "min_load": int(load.min()) / ideal, "tokens": tokens}
        bias = self.e_score_correction_bias
        if self.bias_update == "quantile":
            bias.copy_(histogram_balance_bias(hist, self.top_k, *self.value_range))
        else:
            from k3.ops.moe import sign_update_bias

            bias.copy_(sign_update_bias(load, bias, self.bias_update_rate))
        return stats

    @torch.no_grad()
    def update_bias(self) -> dict | None:
        packed = self.packed_record()
        if dist.is_initialized():
            dist.all_reduce(packed, group=self.group)
        return self.apply_record(packed)

    def clear_record(self) -> None:
        super().clear_record()
        self._hist = None


def apply_histogram_qb(
    model: nn.Module, config: K3Config, group=None, bins: int = DEFAULT_BINS, value_range=DEFAULT_RANGE
) -> int:
    """Swap every Router in `model` for a HistogramRouter with the same weight and bias; returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Router) and not isinstance(child, HistogramRouter):
                new = HistogramRouter(config, group, bins, value_range).to(child.weight.device)
                new.load_state_dict(child.state_dict())
                new.train(child.training)
                setattr(parent, name, new)
                n += 1
    return n


@torch.no_grad()
def update_all_router_biases(model: nn.Module, group=None) -> dict[str, dict]:
    """Every HistogramRouter's update with ONE all-reduce for the whole model; {name: stats}."""
    routers = [(n, m) for n, m in model.named_modules() if isinstance(m, HistogramRouter)]
    if not routers:
        return {}
    packed = [m.packed_record() for _, m in routers]
    flat = torch.cat(packed)
    if dist.is_initialized():
        dist.all_reduce(flat, group=group)
    out = {}
    for (name, m), part in zip(routers, flat.split([p.numel() for p in packed]), strict=True):
        stats = m.apply_record(part)
        if stats is not None:
            out[name] = stats
    return out
