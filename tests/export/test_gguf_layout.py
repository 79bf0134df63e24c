"""The kimi-k3 GGUF writer without llama.cpp: tensor names and layouts, the fusions, encodings, refusals.

The byte-for-byte comparison with llama.cpp itself is tests/export/test_llamacpp_parity.py.
"""

import gguf
import numpy as np
import pytest
import torch

from k3.config import preset
from k3.export.gguf import hparams, mxfp4_blocks, stored_type, write_gguf
from k3.export.gguf_layout import gguf_tensors
from k3.ops.mx import dequantize_mx, quantize_mx

NANO = preset("k3-nano")


def nano_state(seed: int = 0) -> dict[str, torch.Tensor]:
    from k3.model.transformer import K3ForCausalLM

    torch.manual_seed(seed)
    model = K3ForCausalLM(NANO)
    with torch.no_grad():
        for p in model.state_dict().values():
            p.copy_(torch.randn(p.shape) * 0.1)
    return model.state_dict()


@pytest.fixture(scope="module")
def state():
    return nano_state()


@pytest.fixture(scope="module")
def tensors(state):
    return gguf_tensors(state, NANO)


def test_every_loader_tensor_is_written_once_with_its_shape(tensors):
    c = NANO
    h, d, la = c.num_attention_heads, c.hidden_size, c.linear_attn_config
    inner = la.num_heads * la.head_dim
    assert tensors["token_embd.weight"].shape == (c.vocab_size, d)
    assert tensors["output.weight"].shape == (c.vocab_size, d)
    assert tensors["output_res_score.weight"].shape == (d,)
    kda, mla = 0, c.num_hidden_layers - 1  # layer 0 is KDA, the last layer MLA (docs/spec.md#config)
    assert tensors[f"blk.{kda}.ssm_a"].shape == (la.num_heads,)
    assert tensors[f"blk.{kda}.ssm_conv1d_q.weight"].shape == (1, inner, 1, la.short_conv_kernel_size)
    assert tensors[f"blk.{kda}.ssm_g.weight"].shape == (inner, d)
    assert f"blk.{kda}.attn_gate.weight" not in tensors
    assert tensors[f"blk.{mla}.attn_gate.weight"].shape == (h * c.v_head_dim, d)
    assert tensors[f"blk.{mla}.attn_k_b.weight"].shape == (h, c.kv_lora_rank, c.qk_nope_head_dim)
    assert tensors[f"blk.{mla}.attn_v_b.weight"].shape == (h, c.v_head_dim, c.kv_lora_rank)
    moe = 1
    assert tensors[f"blk.{moe}.ffn_gate_exps.weight"].shape == (
        c.num_experts,
        c.moe_intermediate_size,
        c.routed_expert_hidden_size,
    )
    assert tensors[f"blk.{moe}.ffn_down_exps.weight"].shape == (
        c.num_experts,
        c.routed_expert_hidden_size,
        c.moe_intermediate_size,
    )
    per_layer = {n.split(".", 2)[2] for n in tensors if n.startswith(f"blk.{moe}.")}
    assert {
        "ffn_routed_down.weight",
        "ffn_routed_norm.weight",
        "exp_probs_b.bias",
        "ffn_up_shexp.weight",
    } <= (per_layer)
    assert "ffn_gate.weight" in {
        n.split(".", 2)[2] for n in tensors if n.startswith("blk.0.")
    }  # dense layer 0


def test_fusions_are_the_maths_llamacpp_expects(state, tensors):
    p = "model.layers.2."
    fused = tensors["blk.2.attn_res_score.weight"]
    want = state[p + "self_attention_res_norm.weight"] * state[p + "self_attention_res_proj.weight"][0]
    torch.testing.assert_close(fused, want)
    torch.testing.assert_close(tensors["blk.2.ssm_a"], -torch.exp(state[p + "self_attn.A_log"]))
    # kv_b_proj is recovered exactly from the per-head key (transposed back) and value blocks
    last = NANO.num_hidden_layers - 1
    k_b, v_b = tensors[f"blk.{last}.attn_k_b.weight"], tensors[f"blk.{last}.attn_v_b.weight"]
    rebuilt = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, NANO.kv_lora_rank)
    assert torch.equal(rebuilt, state[f"model.layers.{last}.self_attn.kv_b_proj.weight"])
    conv = state[p + "self_attn.k_conv1d.weight"]  # [C, 1, W]
    assert torch.equal(tensors["blk.2.ssm_conv1d_k.weight"][0, :, 0, :], conv[:, 0, :])


def test_tied_head_is_written_from_the_embedding():
    tied = NANO.replace(tie_word_embeddings=True)
    state = nano_state()
    state.pop("lm_head.weight")
    out = gguf_tensors(state, tied)
    assert torch.equal(out["output.weight"], state["model.embed_tokens.weight"])


def test_unplaceable_and_missing_tensors_are_named(state):
    extra = dict(state, **{"model.layers.0.self_attn.surprise.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="surprise"):
        gguf_tensors(extra, NANO)
    lacking = {k: v for k, v in state.items() if not k.endswith("routed_expert_norm.weight")}
    with pytest.raises(ValueError, match="ffn_routed_norm"):
        gguf_tensors(lacking, NANO)


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"hidden_act": "silu"}, "hidden_act"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"use_attn_res": False}, "use_attn_res"),
        ({"use_latent_moe": False}, "use_latent_moe"),
    ],
)
def test_ablation_variants_are_refused_by_name(changes, key, state):
    with pytest.raises(ValueError, match=key):
        gguf_tensors(state, NANO.replace(**changes))


def test_hparams_declare_mla_as_mqa_over_the_latent():
    keys = {k: v for k, _, v in hparams(NANO)}
    full = set(NANO.linear_attn_config.full_attn_layers)
    assert keys["attention.head_count_kv"] == [int(i + 1 in full) for i in range(NANO.num_hidden_layers)]
    assert keys["attention.key_length"] == NANO.kv_lora_rank + NANO.qk_rope_head_dim
    assert keys["attention.value_length"] == NANO.kv_lora_rank
    assert keys["attention.key_length_mla"] == NANO.qk_nope_head_dim + NANO.qk_rope_head_dim
    assert keys["expert_latent_length"] == NANO.routed_expert_hidden_size


def ggml_mxfp4_decode(blocks: np.ndarray, n: int) -> np.ndarray:
    """ggml's MXFP4 block [e, qs[16]] -> 32 floats, from the format's definition (OCP MX + ggml layout)."""
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    b = blocks.reshape(*blocks.shape[:-1], n // 32, 17)
    scale = np.ldexp(1.0, b[..., 0].astype(np.int64) - 127)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # element j low nibble, j+16 high nibble
    return (e2m1[codes] * scale[..., None]).reshape(*blocks.shape[:-1], n)


def test_mxfp4_blocks_hold_the_same_values_as_our_mxfp4():
    w = torch.randn(3, 5, 64) * torch.logspace(-3, 2, 64)
    ours = dequantize_mx(*quantize_mx(w, "mxfp4"), "mxfp4", torch.float32).double().numpy()
    theirs = ggml_mxfp4_decode(mxfp4_blocks(w).numpy(), 64)
    np.testing.assert_array_equal(theirs, ours)


def test_stored_types_follow_the_outtype():
    m, v = torch.zeros(64, 64), torch.zeros(64)
    assert stored_type("blk.1.attn_q.weight", m, "q8_0") == "q8_0"
    assert stored_type("blk.1.attn_k_b.weight", torch.zeros(2, 32, 16), "q8_0") == "f32"  # 16 % 32
    assert stored_type("blk.1.ffn_gate_inp.weight", m, "bf16") == "f32"  # the router stays F32
    assert stored_type("blk.1.ffn_norm.weight", v, "bf16") == "f32"
    assert stored_type("blk.1.ffn_up_exps.weight", torch.zeros(4, 32, 32), "mxfp4") == "mxfp4"
    assert stored_type("blk.1.ffn_up_shexp.weight", m, "mxfp4") == "f32"


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0", "mxfp4"])
def test_written_file_reads_back(outtype, state, tensors, tmp_path):
    from k3.tokenizer_train import train_tokenizer

    tok_dir = tmp_path / "tok"
    train_tokenizer(["def f(x):\n    return x + 1\n" * 50], vocab_size=NANO.vocab_size).save(tok_dir)
    path = write_gguf(state, NANO, tok_dir, tmp_path / "nano.gguf", outtype)
    assert not list(tmp_path.glob("*.partial"))
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "kimi-k3"
    assert r.fields["tokenizer.ggml.pre"].contents() == "kimi-k2"
    assert len(r.fields["tokenizer.ggml.tokens"].data) == NANO.vocab_size
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == NANO.eos_token_id  # <|end_of_msg|>
    read = {t.name: t for t in r.tensors}
    assert set(read) == set(tensors)
    t = read["blk.0.attn_q.weight"]
    assert list(t.shape) == list(reversed(tensors["blk.0.attn_q.weight"].shape))  # GGUF: ne0 first
    if outtype == "f32":
        np.testing.assert_array_equal(np.asarray(t.data), tensors["blk.0.attn_q.weight"].numpy())
    if outtype == "mxfp4":
        assert read["blk.1.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.MXFP4


def test_failed_write_leaves_no_file(state, tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        write_gguf(state, NANO, tmp_path / "no-tokenizer", tmp_path / "x.gguf")
    assert not list(tmp_path.glob("x.gguf*"))
