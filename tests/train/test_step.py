"""train_step internals: the max-logit monitor is exact, QK-Clip brings a head to tau, QB runs once/step."""

import pytest
import torch

from k3.config import preset
from k3.model.mla import MLAAttention, doc_positions
from k3.model.moe import Router
from k3.model.transformer import K3ForCausalLM
from k3.ops.mla import causal_mask
from k3.ops.rope import apply_rope
from k3.train.param_groups import build_optimizers
from k3.train.step import MaxLogitMonitor, train_step


def _batch(B=2, T=24, V=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [2] * 24])[:B]
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "doc_ids": doc_ids, "cu_seqlens": None}


def _reference_max_logits(m: MLAAttention, x, doc_ids):
    """From the module's own projections, independent of the monitor's hooks."""
    q_nope, q_pe = m._queries(x)
    c_kv, k_pe = m._latents(x)
    if m.use_rope:
        pos = doc_positions(doc_ids)
        q_pe = apply_rope(q_pe.transpose(1, 2), pos[:, None], m.rope_theta).transpose(1, 2)
        k_pe = apply_rope(k_pe, pos, m.rope_theta)
    k_nope = m.kv_b_proj(c_kv).view(*c_kv.shape[:2], m.num_heads, -1)[..., : m.nope_dim]
    s = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)
    mask = causal_mask(x.shape[1], x.shape[1], None, doc_ids, doc_ids)
    return (s * m.scale).masked_fill(~mask[:, None], -torch.inf).amax(dim=(0, 2, 3))


def _model(**overrides):
    torch.manual_seed(0)
    cfg = preset("k3-nano").replace(**overrides)
    return K3ForCausalLM(cfg).train(), cfg


@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
def test_monitor_matches_a_direct_computation(nope):
    model, _ = _model(mla_use_nope=nope)
    monitor = MaxLogitMonitor(model)
    ((name, mla),) = monitor.layers.items()
    seen = {}
    mla.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0].detach()))
    b = _batch()
    model(b["input_ids"], labels=b["labels"], doc_ids=b["doc_ids"]).loss.backward()
    got = monitor.pop()[name]
    with torch.no_grad():
        want = _reference_max_logits(mla, seen["x"], b["doc_ids"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert monitor.pop() == {}


def test_qk_clip_brings_the_max_logit_to_tau():
    model, _ = _model()
    monitor = MaxLogitMonitor(model)
    ((name, mla),) = monitor.layers.items()
    with torch.no_grad():
        mla.q_b_proj.weight.mul_(40.0)
        mla.kv_b_proj.weight.mul_(40.0)
    opts = build_optimizers(model, lr=0.0, adamw_lr=0.0, weight_decay=0.0)  # only QK-Clip moves weights
    b = _batch()
    biases = {n: t.clone() for n, t in model.named_buffers()}
    res = train_step(model, [b], opts, monitor=monitor, qk_clip_tau=1.0)
    assert res.max_logit[name] > 1.0 and res.clipped_heads >= 1
    with torch.no_grad():  # undo Quantile Balancing so the MLA layer sees the same inputs again
        for n, t in model.named_buffers():
            t.copy_(biases[n])
    model(b["input_ids"], labels=b["labels"], doc_ids=b["doc_ids"])
    after = monitor.pop()[name]
    assert float(after.max()) == pytest.approx(1.0, rel=1e-4)


def test_quantile_balancing_runs_once_per_step_over_all_micro_batches(monkeypatch):
    model, _ = _model()
    routers = [m for m in model.modules() if isinstance(m, Router)]
    calls = []
    real = Router.update_bias

    def spy(self):
        calls.append(self._tokens)
        return real(self)

    monkeypatch.setattr(Router, "update_bias", spy)
    opts = build_optimizers(model)
    res = train_step(
        model, [_batch(seed=0), _batch(seed=1), _batch(seed=2)], opts, monitor=MaxLogitMonitor(model)
    )
    assert calls == [3 * 2 * 24] * len(routers)  # one update per router, from all 3 micro-batches
    assert len(res.moe_load) == len(routers)
    assert all(r.e_score_correction_bias.abs().sum() > 0 for r in routers)
    assert all(r._load is None for r in routers)
