"""QAT by module swap: only routed experts fake-quantize (MXFP4 weights, MXFP8 inputs), STE backward."""

import copy

import pytest
import torch
from torch import nn

from k3.config import preset
from k3.model.init import init_weights
from k3.model.moe import RoutedExperts
from k3.model.transformer import K3ForCausalLM
from k3.ops.glu import glu_fn
from k3.ops.moe import EXPERT_IMPLS, route
from k3.ops.mx import fake_quant_mx
from k3.quant import qat
from k3.quant.qat import (
    QATRoutedExperts,
    convert_qat,
    maybe_enable_qat,
    qat_enabled,
    set_qat_enabled,
    unconvert_qat,
)

NANO = preset("k3-nano")


@pytest.fixture(scope="module")
def nano():
    model = K3ForCausalLM(NANO)
    init_weights(model, 0.5, NANO.num_hidden_layers, seed=0)
    return model


def tokens(seed=0, b=2, t=24):
    return torch.randint(0, NANO.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def experts_and_inputs(seed=0, E=4, Dl=64, I=96, T=20, k=2):
    g = torch.Generator().manual_seed(seed)
    m = RoutedExperts(E, Dl, I, glu_fn("situ"))
    with torch.no_grad():
        for w in (m.w1, m.w2, m.w3):
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    z = torch.randn(T, Dl, generator=g).requires_grad_()
    weights, indices, _ = route(torch.randn(T, E, generator=g), torch.zeros(E), k)
    return m, z, weights, indices


def test_nano_and_tiny_expert_widths_are_block_multiples():
    for name in ("k3-nano", "k3-tiny", "k3-small", "k3-full"):
        c = preset(name)
        assert c.expert_width % 32 == 0 and c.moe_intermediate_size % 32 == 0, name


def test_convert_swaps_only_routed_experts(nano):
    model = copy.deepcopy(nano)
    before_modules = dict(model.named_modules())
    before_params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    convert_qat(model)
    after = dict(model.named_modules())
    assert after.keys() == before_modules.keys()
    swapped = [n for n, m in after.items() if isinstance(m, QATRoutedExperts)]
    assert swapped == [n for n, m in before_modules.items() if isinstance(m, RoutedExperts)]
    assert len(swapped) == sum(NANO.is_moe_layer(i) for i in range(NANO.num_hidden_layers)) > 0
    for (
        n,
        m,
    ) in after.items():  # every other module (attention, latent projections, router, ...) is the same object
        if n not in swapped and not any(s.startswith(n) for s in swapped):
            assert m is before_modules[n], n
    assert list(model.state_dict()) == keys
    assert all(p is before_params[n] for n, p in model.named_parameters())  # optimizer state stays valid
    assert qat_enabled(model)


def test_qat_forward_differs_master_weights_untouched(nano):
    model = copy.deepcopy(nano)
    ids = tokens()
    ref = model(ids).logits
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    convert_qat(model)
    out = model(ids, labels=ids)
    diff = (out.logits - ref).abs().max().item()
    assert 1e-4 < diff < 0.2 * ref.abs().max().item(), diff  # quantization noise, not garbage
    out.loss.backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), masters[n]), n  # fake quant lives in the forward only
        assert p.dtype == torch.float32
    for m in model.modules():
        if isinstance(m, QATRoutedExperts):
            for w in (m.w1, m.w2, m.w3):
                assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


def test_only_expert_tensors_are_fake_quantized(nano, monkeypatch):
    model = convert_qat(copy.deepcopy(nano))
    calls = []

    def spy(x, fmt):
        calls.append((tuple(x.shape), fmt))
        return fake_quant_mx(x, fmt)

    monkeypatch.setattr(qat, "fake_quant_mx", spy)
    ids = tokens(t=8)
    model(ids)
    E, I, Dl = NANO.num_experts, NANO.moe_intermediate_size, NANO.expert_width
    T = ids.numel()
    layers = sum(NANO.is_moe_layer(i) for i in range(NANO.num_hidden_layers))
    weights = [c for c in calls if c[1] == "mxfp4"]
    acts = [c for c in calls if c[1] == "mxfp8_e4m3"]
    assert sorted(weights) == sorted([((E, I, Dl), "mxfp4")] * 2 * layers + [((E, Dl, I), "mxfp4")] * layers)
    assert acts.count(((T, Dl), "mxfp8_e4m3")) == layers  # z, before w1 / w3
    glu_rows = [s[0] for s, _ in acts if s != (T, Dl)]  # GLU outputs, one per used expert, before w2
    assert all(len(s) == 2 for s, _ in acts) and sum(glu_rows) == layers * T * NANO.num_experts_per_token
    assert len(weights) + len(acts) == len(calls)


@pytest.mark.parametrize("impl", ["reference", "grouped"])
def test_qat_experts_equal_explicit_fake_quant(impl):
    m, z, weights, indices = experts_and_inputs()
    out = QATRoutedExperts.from_experts(m)(z, weights, indices, impl=impl)
    fq4 = lambda w: fake_quant_mx(w, "mxfp4")
    act = lambda g, u: fake_quant_mx(m.act(g, u), "mxfp8_e4m3")
    ref = EXPERT_IMPLS[impl](
        fake_quant_mx(z, "mxfp8_e4m3"), weights, indices, fq4(m.w1), fq4(m.w2), fq4(m.w3), act
    )
    assert torch.equal(out, ref)
    assert not torch.allclose(out, m(z, weights, indices, impl=impl), atol=1e-4)


def test_straight_through_gradient_equals_grad_at_quantized_weights():
    """d loss / d master w == d loss / d w_q of the model with w_q = fq(w) held as constants."""
    m, z, weights, indices = experts_and_inputs(seed=1)
    q = QATRoutedExperts.from_experts(m)
    target = torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
    ((q(z, weights, indices) - target) ** 2).sum().backward()

    z_ref = z.detach().clone().requires_grad_()
    wq = [fake_quant_mx(w.detach(), "mxfp4").requires_grad_() for w in (m.w1, m.w2, m.w3)]
    act = lambda g, u: fake_quant_mx(m.act(g, u), "mxfp8_e4m3")
    out = EXPERT_IMPLS["grouped"](fake_quant_mx(z_ref, "mxfp8_e4m3"), weights, indices, *wq, act)
    ((out - target) ** 2).sum().backward()

    for master, const in zip((m.w1, m.w2, m.w3), wq, strict=True):
        assert master.grad is not None and master.grad.abs().sum() > 0
        assert torch.equal(master.grad, const.grad)
    assert torch.equal(z.grad, z_ref.grad)  # activation STE: identity through the MXFP8 rounding

    qat_grad = m.w1.grad.clone()  # q shares m's Parameters
    m.zero_grad()
    ((m(z.detach(), weights, indices) - target) ** 2).sum().backward()
    assert not torch.allclose(m.w1.grad, qat_grad)  # the full-precision gradient is a different one


def test_idempotent_and_unconvert_restores_fp(nano):
    model = copy.deepcopy(nano)
    ids = tokens(1)
    ref = model(ids).logits
    convert_qat(model)
    mods = [m for m in model.modules() if isinstance(m, QATRoutedExperts)]
    convert_qat(model)
    assert [m for m in model.modules() if isinstance(m, QATRoutedExperts)] == mods  # not re-wrapped
    params = {n: p for n, p in model.named_parameters()}
    unconvert_qat(model)
    assert not any(isinstance(m, QATRoutedExperts) for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    assert torch.equal(model(ids).logits, ref)


def test_disabled_qat_is_the_fp_model_and_from_step(nano):
    model = copy.deepcopy(nano)
    ids = tokens(2)
    ref = model(ids).logits
    convert_qat(model, enabled=False)
    assert not qat_enabled(model)
    for step in range(3):
        assert maybe_enable_qat(model, step, from_step=3) is False
        assert torch.equal(model(ids).logits, ref)
    assert maybe_enable_qat(model, 3, from_step=3) is True and qat_enabled(model)
    on = model(ids).logits
    assert not torch.equal(on, ref)
    assert maybe_enable_qat(model, 10, from_step=3) is True
    moe_layers = sum(NANO.is_moe_layer(i) for i in range(NANO.num_hidden_layers))
    assert set_qat_enabled(model, False) == moe_layers and torch.equal(model(ids).logits, ref)

    plain = copy.deepcopy(nano)  # not converted up front: maybe_enable_qat swaps at from_step
    assert maybe_enable_qat(plain, 0, from_step=None) is False and not qat_enabled(plain)
    assert maybe_enable_qat(plain, 5, from_step=0) is True
    assert torch.equal(plain(ids).logits, on)


def test_optimizer_keeps_working_across_the_swap(nano):
    model = copy.deepcopy(nano)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = tokens(3)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    w1 = model.model.layers[1].block_sparse_moe.experts.w1
    before = w1.detach().clone()
    maybe_enable_qat(model, 1, from_step=1)
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert model.model.layers[1].block_sparse_moe.experts.w1 is w1
    assert not torch.equal(w1.detach(), before)


def test_widths_not_multiple_of_32_are_named():
    for dim, inter, needle in [
        (48, 32, "experts.w1: input dim Dl=48"),
        (32, 40, "experts.w2: input dim I=40"),
    ]:
        holder = nn.Module()
        holder.experts = RoutedExperts(2, dim, inter, glu_fn("silu"))
        with pytest.raises(ValueError, match=needle):
            convert_qat(holder)
        assert type(holder.experts) is RoutedExperts  # nothing swapped


def test_bad_recipe():
    holder = nn.Module()
    holder.experts = RoutedExperts(2, 32, 32, glu_fn("silu"))
    with pytest.raises(ValueError, match="recipe='int4'"):
        convert_qat(holder, "int4")
    custom = qat.QATRecipe(weight_fmt="mxfp8_e5m2", act_fmt="mxfp8_e4m3")
    assert convert_qat(holder, custom).experts.recipe == custom
    with pytest.raises(ValueError, match="fmt='fp3'"):
        convert_qat(holder, qat.QATRecipe(weight_fmt="fp3", act_fmt="mxfp8_e4m3"))
