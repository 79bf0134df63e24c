"""Router (bias record + Quantile Balancing / sign update), RoutedExperts, LatentMoE, GLUMLP."""

import copy

import pytest
import torch
from torch import nn

from k3.config import preset
from k3.model.mlp import GLUMLP
from k3.model.moe import LatentMoE, RoutedExperts, Router, update_router_biases
from k3.ops.glu import situ_glu
from k3.ops.moe import expert_load, experts_reference

NANO = preset("k3-nano")  # D 64, E 8, k 2, 1 shared expert, I 32, Dl 32


def _skewed_router(bias_update="quantile", rate=1e-3, m=4096, E=16, k=4, seed=0):
    """A router over E=16 experts whose logits carry per-expert offsets in [-2, 2] (a strong skew)."""
    cfg = NANO.replace(num_experts=E, num_experts_per_token=k, bias_update=bias_update, bias_update_rate=rate)
    torch.manual_seed(seed)
    router = Router(cfg).train()
    h = torch.randn(m, cfg.hidden_size)
    h[:, 0] = 1.0
    with torch.no_grad():
        router.weight.normal_(0.0, cfg.hidden_size**-0.5)
        router.weight[:, 0] = torch.linspace(-2.0, 2.0, E)
    return router, h


def _load_frac(router, h):
    _, idx = router.eval()(h)
    router.train()
    return expert_load(idx, router.num_experts).float() / (h.shape[0] * router.top_k / router.num_experts)


def test_quantile_balancing_converges():
    router, h = _skewed_router()
    first = None
    for _ in range(8):
        router(h)
        stats = router.update_bias()
        first = first or stats
    assert first["max_load"] > 2.0 and first["min_load"] < 0.1 and first["tokens"] == 4096
    load = _load_frac(router, h)
    assert (load - 1).abs().max() < 0.10, load
    assert abs(router.e_score_correction_bias.mean().item()) < 1e-6  # re-centred


def test_sign_update_reduces_imbalance():
    router, h = _skewed_router("sign", rate=2e-3, m=1024)
    before = _load_frac(router, h)
    for _ in range(250):
        router(h)
        router.update_bias()
    after = _load_frac(router, h)
    assert before.max() - before.min() > 2.0
    assert after.max() - after.min() < 0.2, after


def test_bias_never_changes_combine_weights():
    router, h = _skewed_router()
    for _ in range(3):
        router(h)
        router.update_bias()
    assert router.e_score_correction_bias.abs().max() > 0.1
    w, idx = router.eval()(h)
    s = torch.sigmoid(h @ router.weight.T).gather(1, idx)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True))
    biased = torch.sigmoid(h @ router.weight.T) + router.e_score_correction_bias
    torch.testing.assert_close(idx, biased.topk(4, dim=-1).indices)


@pytest.mark.parametrize("bias_update", ["quantile", "sign"])
def test_micro_batches_accumulate(bias_update):
    router, h = _skewed_router(bias_update, rate=1e-2, m=2048)
    twin = copy.deepcopy(router)
    router(h[:700])
    router(h[700:])
    twin(h)
    a, b = router.update_bias(), twin.update_bias()
    assert a == b
    torch.testing.assert_close(
        router.e_score_correction_bias, twin.e_score_correction_bias, atol=1e-6, rtol=0
    )
    assert router.update_bias() is None  # the record was cleared


def test_router_records_only_in_training():
    router, h = _skewed_router()
    router.eval()(h)
    assert router.update_bias() is None
    router.train()(h)
    router.clear_record()
    assert router.update_bias() is None


def test_router_bias_buffer_state_dict_and_dtype():
    router = Router(NANO)
    sd = router.state_dict()
    assert (
        set(sd) == {"weight", "e_score_correction_bias"}
        and sd["e_score_correction_bias"].dtype == torch.float32
    )
    assert "e_score_correction_bias" not in dict(router.named_parameters())
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8) / 3)
    exact = router.e_score_correction_bias.clone()
    router.to(torch.bfloat16)  # a model-wide cast keeps the F32 bias exact
    assert router.weight.dtype == torch.bfloat16 and torch.equal(router.e_score_correction_bias, exact)
    w, _ = router(torch.randn(5, 64, dtype=torch.bfloat16))
    w.sum().backward()
    assert router.weight.grad is not None and router.e_score_correction_bias.grad is None
    assert w.dtype == torch.float32


# ---- LatentMoE ----------------------------------------------------------------------------------------
def _reference_forward(moe: LatentMoE, h: torch.Tensor) -> torch.Tensor:
    x = h.reshape(-1, h.shape[-1])
    w, idx = moe.gate(x)
    z = moe.routed_expert_down_proj(x) if moe.use_latent_moe else x
    u = experts_reference(z, w, idx, moe.experts.w1, moe.experts.w2, moe.experts.w3, moe.experts.act)
    y = u
    if moe.routed_expert_norm is not None:
        uf = u.float()
        y = uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + 1e-5) * moe.routed_expert_norm.weight
    if moe.use_latent_moe:
        y = moe.routed_expert_up_proj(y)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x)
    return y.reshape(h.shape)


def _randomize_norm(moe):
    if moe.routed_expert_norm is not None:
        with torch.no_grad():
            moe.routed_expert_norm.weight.uniform_(0.5, 1.5)


VARIANTS = {
    "latent": {},
    "latent-nonorm": {"latent_moe_use_norm": False},
    "plain": {"use_latent_moe": False},
    "noshared": {"num_shared_experts": 0},
    "silu-2shared": {"hidden_act": "silu", "num_shared_experts": 2},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_latent_moe_forward_backward(variant):
    cfg = NANO.replace(**VARIANTS[variant])
    torch.manual_seed(0)
    moe = LatentMoE(cfg)
    _randomize_norm(moe)
    h = torch.randn(2, 7, cfg.hidden_size, requires_grad=True)
    y = moe(h)
    assert y.shape == h.shape
    torch.testing.assert_close(y, _reference_forward(moe, h), rtol=1e-5, atol=1e-6)
    y.pow(2).sum().backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert moe.gate.weight.grad.abs().sum() > 0  # the router learns through the combine weights


def test_latent_moe_checkpoint_names_and_shapes():
    cfg = NANO.replace(num_shared_experts=2)
    D, Dl, E, I = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    shapes = {k: tuple(v.shape) for k, v in LatentMoE(cfg).state_dict().items()}
    assert shapes == {
        "gate.weight": (E, D),
        "gate.e_score_correction_bias": (E,),
        "shared_experts.gate_proj.weight": (2 * I, D),
        "shared_experts.up_proj.weight": (2 * I, D),
        "shared_experts.down_proj.weight": (D, 2 * I),
        "routed_expert_down_proj.weight": (Dl, D),
        "routed_expert_norm.weight": (Dl,),
        "routed_expert_up_proj.weight": (D, Dl),
        "experts.w1": (E, I, Dl),
        "experts.w2": (E, Dl, I),
        "experts.w3": (E, I, Dl),
    }
    plain = LatentMoE(NANO.replace(use_latent_moe=False, num_shared_experts=0)).state_dict()
    assert set(plain) == {
        "gate.weight",
        "gate.e_score_correction_bias",
        "experts.w1",
        "experts.w2",
        "experts.w3",
    }
    assert plain["experts.w1"].shape == (E, I, D)


def test_reference_impl_switch_matches():
    torch.manual_seed(1)
    moe = LatentMoE(NANO)
    h = torch.randn(3, 5, NANO.hidden_size)
    y = moe(h)
    moe.experts.impl = "reference"
    torch.testing.assert_close(moe(h), y, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="impl"):
        moe.experts(torch.zeros(1, 32), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), impl="fast")


def test_qat_hook_compute_override():
    class Scaled(RoutedExperts):  # stands in for a fake-quantizing subclass
        def compute(self, fn, z, weights, indices):
            return fn(z, weights, indices, self.w1, 2 * self.w2, self.w3, self.act)

    torch.manual_seed(2)
    base = RoutedExperts(4, 8, 16, situ_glu)
    swapped = Scaled(4, 8, 16, situ_glu)
    swapped.load_state_dict(base.state_dict())
    z, w = torch.randn(6, 8), torch.rand(6, 2)
    idx = torch.randint(0, 4, (6, 2))
    torch.testing.assert_close(swapped(z, w, idx), 2 * base(z, w, idx))


def test_bf16_module_and_meta_build():
    with torch.device("meta"):
        moe = LatentMoE(NANO)
    moe = moe.to_empty(device="cpu")
    for m in moe.modules():
        if hasattr(m, "reset_parameters"):  # Linear, Router, RoutedExperts, LatentMoE (the norm)
            m.reset_parameters()
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.abs().max() == 0
    assert (moe.routed_expert_norm.weight == 1).all()
    assert 0.01 < moe.experts.w1.std().item() < 0.03
    moe = moe.to(torch.bfloat16)
    y = moe(torch.randn(2, 4, NANO.hidden_size, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert moe.gate.e_score_correction_bias.dtype == torch.float32


def test_update_router_biases_collects_per_layer():
    model = nn.ModuleList([LatentMoE(NANO), LatentMoE(NANO)]).train()
    h = torch.randn(2, 16, NANO.hidden_size)
    for layer in model:
        h = layer(h)
    stats = update_router_biases(model)
    assert set(stats) == {"0.gate", "1.gate"} and all(s["tokens"] == 32 for s in stats.values())
    assert update_router_biases(model) == {}


def test_glu_mlp():
    torch.manual_seed(3)
    mlp = GLUMLP(64, 96, NANO)
    x = torch.randn(3, 64)
    want = mlp.down_proj(situ_glu(mlp.gate_proj(x), mlp.up_proj(x)))
    torch.testing.assert_close(mlp(x), want)
    assert {k: tuple(v.shape) for k, v in mlp.state_dict().items()} == {
        "gate_proj.weight": (96, 64),
        "up_proj.weight": (96, 64),
        "down_proj.weight": (64, 96),
    }
