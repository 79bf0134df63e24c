"""Packed MXFP4 experts: the logits and greedy tokens of the dequantized weights, at 4.25/16 of BF16 bytes."""

import copy

import pytest
import torch

from k3.checkpoint import adapter
from k3.config import preset
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.model.generate import generate
from k3.model.init import init_weights
from k3.model.moe import RoutedExperts
from k3.model.transformer import K3ForCausalLM
from k3.ops.glu import glu_fn
from k3.ops.moe import route
from k3.ops.mx import dequantize_mx, quantize_mx
from k3.quant.checkpoint import load_mxfp4_checkpoint, save_mxfp4_checkpoint
from k3.quant.packed import PackedRoutedExperts, PackedWeight, expert_bytes, pack_model_experts

NANO = preset("k3-nano")


@pytest.fixture(scope="module")
def nano():
    model = K3ForCausalLM(NANO)
    init_weights(model, 0.5, NANO.num_hidden_layers, seed=0)  # large init: peaked, input-dependent logits
    return model.eval()


def dequantized_model(model):
    """The reference: plain RoutedExperts holding dequantize(quantize(w)) in the model's dtype."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, RoutedExperts):
                for w in (m.w1, m.w2, m.w3):
                    w.copy_(dequantize_mx(*quantize_mx(w, "mxfp4"), "mxfp4", w.dtype))
    return ref


def prompt(n=12, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_layout_and_memory_ratio(nano):
    model = pack_model_experts(copy.deepcopy(nano))
    E, I, Dl = NANO.num_experts, NANO.moe_intermediate_size, NANO.expert_width
    sd = model.state_dict()
    prefix = "model.layers.1.block_sparse_moe.experts."
    for w, (rows, cols) in {"w1": (I, Dl), "w3": (I, Dl), "w2": (Dl, I)}.items():
        assert sd[prefix + w + ".weight_packed"].shape == (E, rows, cols // 2)
        assert sd[prefix + w + ".weight_scale"].shape == (E, rows, cols // 32)
        assert (
            sd[prefix + w + ".weight_packed"].dtype == sd[prefix + w + ".weight_scale"].dtype == torch.uint8
        )
    assert not any(k.endswith(("experts.w1", "experts.w2", "experts.w3")) for k in sd)
    b = expert_bytes(model)
    assert b["dense"] == 0 and b["packed"] / b["bf16_equivalent"] == 4.25 / 16
    assert expert_bytes(nano)["dense"] == 2 * b["bf16_equivalent"]  # the fp32 original
    assert all(not isinstance(m, RoutedExperts) for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["reference", "grouped"])
def test_module_equals_dequantized_routed_experts(impl, dtype):
    g = torch.Generator().manual_seed(0)
    E, Dl, I, T, k = 6, 64, 96, 40, 2
    m = RoutedExperts(E, Dl, I, glu_fn("situ"))
    z = torch.randn(T, Dl, generator=g).to(dtype)
    weights, indices, _ = route(torch.randn(T, E, generator=g), torch.zeros(E), k)
    packed = PackedRoutedExperts.from_experts(m)
    ref = packed.dequantize(dtype)
    assert isinstance(ref, RoutedExperts) and ref.w1.dtype == dtype
    out = packed(z, weights, indices, impl=impl)
    assert out.dtype == dtype
    with torch.no_grad():  # the packed weights carry no gradient: the same (no-grad) activation path
        assert torch.equal(out, ref(z, weights, indices, impl=impl))
    torch.testing.assert_close(
        packed(z, weights, indices, impl="grouped"), packed(z, weights, indices, impl="reference")
    )


def test_only_experts_with_tokens_are_dequantized(monkeypatch):
    m = RoutedExperts(8, 32, 32, glu_fn("silu"))
    packed = PackedRoutedExperts.from_experts(m)
    seen = []
    real = PackedWeight.dequantize

    def spy(self, e=None, dtype=torch.float32):
        seen.append(e)
        return real(self, e, dtype)

    monkeypatch.setattr(PackedWeight, "dequantize", spy)
    indices = torch.tensor([[1, 5], [5, 1], [1, 5]])
    packed(torch.randn(3, 32), torch.full((3, 2), 0.5), indices)
    assert sorted(seen) == [1, 1, 1, 5, 5, 5]  # w1, w2, w3 of experts 1 and 5, nothing else


def test_bad_buffers_and_impl():
    with pytest.raises(ValueError, match="uint8"):
        PackedWeight(torch.zeros(2, 4, 16), torch.zeros(2, 4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight_scale"):
        PackedWeight(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8))
    packed = PackedRoutedExperts.from_experts(RoutedExperts(2, 32, 32, glu_fn("silu")))
    with pytest.raises(ValueError, match="impl"):
        packed(torch.randn(1, 32), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), impl="fast")
    with pytest.raises(ValueError, match=r"z \[T, 32\]"):
        packed(torch.randn(1, 64), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long))


def test_packed_model_same_logits_and_tokens_as_dequantized(nano):
    ref = dequantized_model(nano)
    packed = pack_model_experts(copy.deepcopy(nano))
    ids = torch.randint(0, NANO.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    assert torch.equal(packed(ids).logits, ref(ids).logits)
    assert not torch.equal(nano(ids).logits, ref(ids).logits)  # quantization does change the model
    for use_cache in (True, False):
        out = generate(packed, prompt(), 12, use_cache=use_cache)
        assert torch.equal(out, generate(ref, prompt(), 12, use_cache=use_cache))


def test_engine_with_packed_experts_gives_the_dequantized_tokens(nano):
    cfg = EngineConfig(page_size=16, prefix_unit=16, num_pages=64, max_model_len=256, max_num_seqs=4)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [prompt(n, s)[0].tolist() for n, s in [(5, 0), (19, 1)]]
    packed_out = Engine(pack_model_experts(copy.deepcopy(nano)), cfg).generate(prompts, greedy)
    ref_out = Engine(dequantized_model(nano), cfg).generate(prompts, greedy)
    assert [s.output for s in packed_out] == [s.output for s in ref_out]
    assert all(len(s.output) == 10 for s in packed_out)


def test_load_packed_from_checkpoint_never_dequantizes_all(nano, tmp_path, monkeypatch):
    save_mxfp4_checkpoint(nano, NANO, tmp_path / "q", dtype=None)
    monkeypatch.setattr(
        adapter, "_dequantize_expert", lambda *a: pytest.fail("experts were dequantized on load")
    )
    loaded, config = load_mxfp4_checkpoint(tmp_path / "q", packed=True)
    assert config.quantization_config is not None
    from_model = pack_model_experts(copy.deepcopy(nano))
    for (n, a), (n2, b) in zip(loaded.state_dict().items(), from_model.state_dict().items(), strict=True):
        assert n == n2 and a.dtype == b.dtype and torch.equal(a, b), n
    ids = prompt(16, 3)
    assert torch.equal(loaded(ids).logits, from_model(ids).logits)
    monkeypatch.undo()
    plain, _ = load_mxfp4_checkpoint(tmp_path / "q", packed=False)
    assert plain.model.layers[1].block_sparse_moe.experts.w1.dtype == torch.float32  # the model's dtype
    assert torch.equal(plain(ids).logits, loaded(ids).logits)
    assert torch.equal(generate(plain, ids, 8), generate(loaded, ids, 8))
