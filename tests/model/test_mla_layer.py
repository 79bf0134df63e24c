"""MLAAttention layer: checkpoint names, naive == absorbed, cache (prefill/decode/chunks), documents, RoPE."""

import pytest
import torch
from torch import nn

from k3.config import preset
from k3.model.layers import Linear
from k3.model.mla import MLAAttention, doc_positions
from k3.model.state import MLAState, ModelState


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, rtol: float) -> None:
    """Max-abs error relative to the reference's max magnitude, reported with the tensor name."""
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    ref, got = ref.double(), got.double()
    err = (ref - got).abs().max().item()
    rel = err / max(ref.abs().max().item(), 1e-12)
    assert rel <= rtol, (
        f"{name}: rel err {rel:.3e} > {rtol:.1e} (max abs {err:.3e}, mean {(ref - got).abs().mean():.3e})"
    )


CFG = preset("k3-nano")  # D=64, H=2, q_lora 48, kv_lora 32, nope 16, rope 8, v 16
ROPE = CFG.replace(mla_use_nope=False)


def build(config=CFG, seed=0, dtype=None) -> MLAAttention:
    torch.manual_seed(seed)
    layer = MLAAttention(config, layer_idx=3, dtype=dtype)
    for m in layer.modules():  # unit-scale projections so attention is far from uniform
        if isinstance(m, Linear):
            nn.init.normal_(m.weight, 0.0, 2.0 * m.in_features**-0.5)
    return layer


def inputs(B, T, seed=1):
    return torch.randn(B, T, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))


def test_parameter_names_and_shapes():
    sd = {k: tuple(v.shape) for k, v in build().state_dict().items()}
    assert sd == {
        "q_a_proj.weight": (48, 64), "q_a_layernorm.weight": (48,), "q_b_proj.weight": (2 * 24, 48),
        "kv_a_proj_with_mqa.weight": (32 + 8, 64), "kv_a_layernorm.weight": (32,),
        "kv_b_proj.weight": (2 * 32, 32), "g_proj.weight": (32, 64), "o_proj.weight": (64, 32),
    }  # fmt: skip
    no_lora = build(CFG.replace(q_lora_rank=None, mla_use_output_gate=False)).state_dict()
    assert "q_proj.weight" in no_lora and "q_a_proj.weight" not in no_lora and "g_proj.weight" not in no_lora


def test_full_size_parameter_count_on_meta():
    layer = MLAAttention(preset("k3-full"), layer_idx=3, device="meta")
    assert sum(p.numel() for p in layer.parameters()) == 232_196_096  # docs/spec.md#parameter-counts
    assert layer.kv_a_layernorm.eps == preset("k3-full").latent_norm_eps


@pytest.mark.parametrize("config", [CFG, ROPE], ids=["nope", "rope"])
def test_absorbed_equals_naive(config):
    layer = build(config)
    x = inputs(2, 11)
    with torch.no_grad():
        assert_close("no cache", layer(x, absorb=False), layer(x, absorb=True), 1e-5)
        s1, s2 = MLAState(), MLAState()
        layer(x[:, :7], state=s1), layer(x[:, :7], state=s2)
        naive, absorbed = layer(x[:, 7:], state=s1, absorb=False), layer(x[:, 7:], state=s2, absorb=True)
        assert_close("with cache", naive, absorbed, 1e-5)


@pytest.mark.parametrize("config", [CFG, ROPE], ids=["nope", "rope"])
def test_prefill_then_decode_equals_full_forward(config):
    layer = build(config)
    x = inputs(2, 12)
    with torch.no_grad():
        full = layer(x)
        state = ModelState.empty(config)[3]
        assert isinstance(state, MLAState)
        pre = layer(x[:, :9], state=state)
        steps = [layer(x[:, t : t + 1], state=state) for t in range(9, 12)]  # absorbed decode
    assert state.length == 12 and state.latent.shape == (2, 12, 40)
    assert_close("prefill", full[:, :9], pre, 1e-5)
    assert_close("decode", full[:, 9:], torch.cat(steps, 1), 1e-5)


def test_chunked_prefill_equals_one_pass():
    layer = build(ROPE)
    x = inputs(1, 20)
    with torch.no_grad():
        full = layer(x)
        state = MLAState.zeros(ROPE, 1, dtype=torch.float32)
        parts = [layer(x[:, a:b], state=state) for a, b in [(0, 6), (6, 15), (15, 20)]]
    assert_close("chunked prefill", full, torch.cat(parts, 1), 1e-5)


def test_cache_holds_normed_latent():
    layer = build()
    x = inputs(1, 4)
    state = MLAState()
    with torch.no_grad():
        layer(x, state=state)
        c_kv, k_pe = layer.kv_a_proj_with_mqa(x).split([32, 8], -1)
    assert_close("c_kv", layer.kv_a_layernorm(c_kv), state.latent[..., :32], 0)
    assert_close("k_pe", k_pe, state.latent[..., 32:], 0)


@pytest.mark.parametrize("config", [CFG, ROPE], ids=["nope", "rope"])
def test_doc_ids_equal_separate_docs(config):
    layer = build(config)
    x = inputs(2, 10)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3]])
    with torch.no_grad():
        packed = layer(x, doc_ids=doc_ids)
        for a, b in [(0, 3), (3, 8), (8, 10)]:
            assert_close(f"doc {a}:{b}", layer(x[:1, a:b]), packed[:1, a:b], 1e-5)
        assert_close("single-doc row", layer(x[1:]), packed[1:], 1e-6)
    with pytest.raises(ValueError, match="doc_ids"):
        layer(x, state=MLAState(), doc_ids=doc_ids)


def test_doc_positions():
    d = torch.tensor([[5, 5, 7, 7, 7, 2], [1, 1, 1, 1, 1, 1]])
    assert doc_positions(d).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("config", [CFG, ROPE], ids=["nope", "rope"])
def test_causality(config):
    layer = build(config)
    x = inputs(1, 16)
    t = 9
    x2 = x.clone()
    x2[0, t] += 1.0
    with torch.no_grad():
        y, y2 = layer(x), layer(x2)
    assert torch.equal(y[:, :t], y2[:, :t])  # exact: masked scores are -inf, their weights exactly 0
    assert (y[:, t:] - y2[:, t:]).abs().max() > 1e-2 * y.abs().max()


def test_positions_only_matter_with_rope_and_only_relatively():
    x = inputs(1, 5)
    shifted, gapped = torch.arange(100, 105), torch.tensor([0, 1, 2, 10, 11])
    with torch.no_grad():
        nope, rope = build(CFG), build(ROPE)
        assert torch.equal(nope(x), nope(x, positions=gapped))  # NoPE ignores positions
        a = rope(x)
        assert_close("rope: a constant shift cancels", a, rope(x, positions=shifted), 1e-5)
        b = rope(x, positions=gapped)
    assert_close("rope: unchanged before the gap", a[:, :3], b[:, :3], 1e-6)
    assert (a[:, 3:] - b[:, 3:]).abs().max() > 1e-3 * a.abs().max()


def test_backward_finite_grads():
    layer = build(ROPE)
    x = inputs(2, 8).requires_grad_(True)
    layer(x, doc_ids=torch.tensor([[0] * 3 + [1] * 5, [2] * 8])).square().mean().backward()
    for name, p in [("x", x), *layer.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
