"""One optimizer step: micro-batch forward/backward, NaN guard, clipping, Muon/AdamW, QK-Clip, QB.

    for each of grad_accum micro-batches:  loss = CE(model(batch)) / grad_accum;  loss.backward()
    non-finite loss or grad norm          -> drop the gradients and the routers' records, skip the step
    clip the global grad norm, optimizers step
    QK-Clip (K2, docs/spec_training.md#qk-clip): each MLA layer's q_b_proj / kv_b_proj scaled so its
        heads' max logit <= tau
    Quantile Balancing (docs/spec_training.md#quantile-balancing): every router's update_bias(), once,
        from all micro-batches' scores

Every reduction, the clip, QK-Clip's weight edit and the router update go through `runtime`
(k3.train.runtime.LocalRuntime by default; k3.train.distributed.DistributedRuntime under torchrun), so
the same step runs on one process or a dp x ep mesh. Ranks agree on every branch (skip or not): the
loss is averaged over ranks before the finiteness test and the grad norm is global.

QK-Clip needs each head's largest pre-softmax logit of the step. The MLA module does not report it, so
`MaxLogitMonitor` hooks the projections whose outputs hold q and k (q_b_proj / q_proj,
kv_a_proj_with_mqa for the shared k_pe, kv_b_proj for k_nope), and after each MLA forward recomputes
the masked logits q_nope.k_nope + q_pe.k_pe (times the softmax scale, RoPE applied for the K2 ablation)
under no_grad -- one extra [B, H, T, T] einsum per MLA layer, no extra projection.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from k3.model.layers import Linear
from k3.model.mla import MLAAttention, doc_positions
from k3.model.moe import Router
from k3.model.transformer import K3ForCausalLM, make_context
from k3.ops.mla import causal_mask
from k3.ops.rope import apply_rope
from k3.train.loss import chunked_linear_cross_entropy
from k3.train.runtime import LocalRuntime

LOCAL = LocalRuntime()


@dataclass
class StepResult:
    loss: float  # mean micro-batch loss (nats/token); NaN/inf when skipped for that reason
    grad_norm: float
    skipped: bool
    tokens: int  # target tokens seen by the step
    moe_load: dict[str, tuple[float, float]] = field(default_factory=dict)  # router -> (max, min) load
    max_logit: dict[str, float] = field(default_factory=dict)  # MLA layer -> max logit before the clip
    clipped_heads: int = 0  # heads whose weights QK-Clip scaled this step


class MaxLogitMonitor:
    """Running per-head max pre-softmax logit [H] of every MLA layer during training forwards."""

    def __init__(self, model: nn.Module):
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, MLAAttention)}
        self.s_max: dict[str, torch.Tensor] = {}
        self._seen: dict[str, dict] = {}
        self._handles = []
        for name, m in self.layers.items():
            q = m.q_b_proj if hasattr(m, "q_b_proj") else m.q_proj
            for key, sub in (("q", q), ("kv_a", m.kv_a_proj_with_mqa), ("kv_b", m.kv_b_proj)):
                self._handles.append(sub.register_forward_hook(self._capture(name, key)))
            self._handles.append(m.register_forward_hook(self._finish(name), with_kwargs=True))

    def _capture(self, name: str, key: str):
        def hook(module, args, output):
            if module.training and torch.is_grad_enabled():
                self._seen.setdefault(name, {})[key] = output.detach()

        return hook

    def _finish(self, name: str):
        def hook(module, args, kwargs, output):
            seen = self._seen.pop(name, None)
            if seen is None or len(seen) < 3 or kwargs.get("state") is not None:
                return
            s = max_logits(module, seen["q"], seen["kv_a"], seen["kv_b"], kwargs.get("doc_ids"))
            self.s_max[name] = s if name not in self.s_max else torch.maximum(self.s_max[name], s)

        return hook

    def pop(self) -> dict[str, torch.Tensor]:
        out, self.s_max, self._seen = self.s_max, {}, {}
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@torch.no_grad()
def max_logits(
    m: MLAAttention, q: torch.Tensor, kv_a: torch.Tensor, kv_b: torch.Tensor, doc_ids: torch.Tensor | None
) -> torch.Tensor:
    """Per-head max of scale * (q_nope.k_nope + q_pe.k_pe) over visible (causal, same-document) pairs.

    q [B, T, H*(Dn+Dr)] (q_b_proj output), kv_a [B, T, R+Dr], kv_b [B, T, H*(Dn+Dv)] -> [H] fp32.
    """
    B, T = q.shape[:2]
    H, Dn, Dr = m.num_heads, m.nope_dim, m.rope_dim
    q_nope, q_pe = q.float().view(B, T, H, Dn + Dr).split([Dn, Dr], dim=-1)
    k_pe = kv_a.float()[..., m.kv_lora_rank :]
    k_nope = kv_b.float().view(B, T, H, -1)[..., :Dn]
    if m.use_rope:
        pos = doc_positions(doc_ids) if doc_ids is not None else torch.arange(T, device=q.device)[None]
        q_pe = apply_rope(q_pe.transpose(1, 2), pos[:, None], m.rope_theta).transpose(1, 2)
        k_pe = apply_rope(k_pe, pos, m.rope_theta)
    scores = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)
    mask = causal_mask(T, T, q.device, doc_ids, doc_ids)  # [B|1, T, S]
    scores = scores.masked_fill(~mask[:, None], float("-inf")) * m.scale
    return scores.amax(dim=(0, 2, 3))


def forward_loss(model: nn.Module, batch: dict, bf16: bool) -> torch.Tensor:
    """Mean next-token cross-entropy of one packed micro-batch (a test seam: NaN injection patches it).

    A plain single-process K3ForCausalLM with gradients on runs the trunk, then the head and loss as
    `chunked_linear_cross_entropy` (k3.train.loss: the same loss without the [B*T, V] logits); anything
    else (a QAT or sharded head, no autograd) calls the model with labels."""
    ctx = torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    with ctx:
        if _chunked_head(model):
            c = make_context(*batch["input_ids"].shape, batch["cu_seqlens"], batch["doc_ids"], None)
            h = model.model.norm(model.model(batch["input_ids"], ctx=c))
            return chunked_linear_cross_entropy(
                h.flatten(0, 1), model.lm_head.weight, batch["labels"].flatten()
            )
        out = model(
            batch["input_ids"],
            labels=batch["labels"],
            cu_seqlens=batch["cu_seqlens"],
            doc_ids=batch["doc_ids"],
        )
    return out.loss


def _chunked_head(model: nn.Module) -> bool:
    return (
        torch.is_grad_enabled()
        and type(model) is K3ForCausalLM
        and type(model.lm_head) is Linear
        and type(model.lm_head.weight) is nn.Parameter
        and not (torch.distributed.is_available() and torch.distributed.is_initialized())
    )


def _drop_step(model: nn.Module, optimizers, monitor: MaxLogitMonitor | None) -> None:
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    for m in model.modules():
        if isinstance(m, Router):
            m.clear_record()
    if monitor is not None:
        monitor.pop()


def _qk_clip(monitor: MaxLogitMonitor, tau: float, runtime: LocalRuntime) -> tuple[dict[str, float], int]:
    logged, clipped = {}, 0
    for name, s_max in runtime.max_logits(monitor.pop()).items():
        m = monitor.layers[name]
        q_w = m.q_b_proj.weight if hasattr(m, "q_b_proj") else m.q_proj.weight
        gamma = runtime.qk_clip_(q_w, m.kv_b_proj.weight, s_max, m.nope_dim, m.rope_dim, m.v_dim, tau)
        logged[name] = float(s_max.max())
        clipped += int((gamma < 1).sum())
    return logged, clipped


def train_step(
    model: nn.Module,
    micro_batches: list[dict],
    optimizers: list[torch.optim.Optimizer],
    *,
    grad_clip: float = 1.0,
    bf16: bool = False,
    monitor: MaxLogitMonitor | None = None,
    qk_clip_tau: float | None = 100.0,
    runtime: LocalRuntime = LOCAL,
) -> StepResult:
    """One optimizer step over `micro_batches` (each {input_ids, labels [B, T], cu_seqlens, doc_ids}, this
    rank's rows); loss and tokens are over all ranks."""
    rt = runtime
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    n, total, tokens = len(micro_batches), 0.0, 0
    for batch in micro_batches:
        loss = forward_loss(model, batch, bf16)
        tokens += int((batch["labels"] != -100).sum())
        value = rt.mean_loss(float(loss.detach()))
        if not math.isfinite(value):
            _drop_step(model, optimizers, monitor)
            tokens = int(rt.sum([tokens])[0])  # every rank skips: the loss is the mean over ranks
            return StepResult(loss=value, grad_norm=float("nan"), skipped=True, tokens=tokens)
        (loss / n).backward()
        total += value / n
    tokens = int(rt.sum([tokens])[0])
    params = [p for group_owner in optimizers for g in group_owner.param_groups for p in g["params"]]
    norm = rt.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    if not torch.isfinite(norm):
        _drop_step(model, optimizers, monitor)
        return StepResult(loss=total, grad_norm=float(norm), skipped=True, tokens=tokens)
    for opt in optimizers:
        opt.step()
    max_logit, clipped = (
        _qk_clip(monitor, qk_clip_tau, rt) if monitor is not None and qk_clip_tau else ({}, 0)
    )
    if monitor is not None and not qk_clip_tau:
        max_logit = {k: float(v.max()) for k, v in rt.max_logits(monitor.pop()).items()}
    loads = {name: (s["max_load"], s["min_load"]) for name, s in rt.update_router_biases(model).items()}
    return StepResult(
        loss=total,
        grad_norm=float(norm),
        skipped=False,
        tokens=tokens,
        moe_load=loads,
        max_logit=max_logit,
        clipped_heads=clipped,
    )
