"""What vLLM's Kimi K3 model needs of a checkpoint folder, checked on what k3 writes.

Each rule cites the vLLM source it is read from (vllm-project/vllm; `nvidia/` is
vllm/models/kimi_k3/nvidia/). vLLM itself needs a GPU, so this is the loader's contract, not a run:

R1  vllm/models/kimi_k3/__init__.py, vllm/transformers_utils/config.py (_CONFIG_REGISTRY): the class is
    picked by `architectures == ["KimiK3ForConditionalGeneration"]` and top-level `model_type: kimi_k3`.
R2  vllm/transformers_utils/configs/kimi_k3.py (KimiK3Config): `text_config` builds KimiLinearConfig;
    `quantization_config` is read from inside text_config; vision_config may be absent.
R3  nvidia/model.py (KimiMoE, KimiDecoderLayer, KimiLinearModel) reads these text_config attributes
    directly, so each must be present: attn_res_block_size, routed_expert_hidden_size,
    latent_moe_use_norm, activation_situ_beta, activation_situ_linear_beta, mla_use_output_gate, plus
    linear_attn_config.kda_layers / full_attn_layers (configs/kimi_linear.py asserts both).
R4  nvidia/mla.py and the K3 MLA CUDA epilogues (csrc/.../fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu)
    check kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128 (a 576-wide
    latent cache entry, the only head size vLLM's MLA backends offer); mla_use_nope must be true.
R5  nvidia/kda.py (KimiK3DeltaAttention): use_full_rank_gate true; gate_lower_bound in [-5, 0).
R6  nvidia/model.py (KimiMoE): num_shared_experts >= 1 (0 builds a zero-width shared MLP).
R7  nvidia/model.py (KimiLinearForCausalLM): the head is never tied in code: tie_word_embeddings false
    and `lm_head.weight` shipped.
R8  nvidia/model.py (load_weights, stacked_params_mapping): per-projection names that vLLM fuses on load
    (q/k/v/b/f_a/g_proj into in_proj_qkvgfab, q/k/v_conv1d into conv1d, gate/up_proj into gate_up_proj,
    q_a_proj + kv_a_proj_with_mqa into fused_qkv_a_proj), experts `experts.{e}.w1|w2|w3.weight` or
    `.weight_packed` + `.weight_scale`, `gate.e_score_correction_bias` always.
R9  nvidia/kda.py (a_log_weight_loader): A_log is 1-D with at least H entries (the loader narrows to
    the heads) or [1, 1, H, 1]; dt_bias [H*D]; convs [H*D, 1, W] or [H*D, W].
R10 compressed_tensors_moe_w4a4_mxfp4.py: MXFP4 experts with group_size 32 (widths multiples of 32).
"""

import json

import pytest
import torch
from safetensors import safe_open

from k3.checkpoint.adapter import to_official
from k3.config import preset
from k3.params import expected_shapes

R3_KEYS = (
    "attn_res_block_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "mla_use_output_gate",
)


def vllm_violations(config_json: dict, shapes: dict[str, tuple[int, ...]], gpu: bool) -> list[str]:
    """Every rule above that a (config.json, {tensor name: shape}) pair breaks. `gpu`: check R4's dims."""
    bad = []
    if config_json.get("architectures") != ["KimiK3ForConditionalGeneration"]:
        bad.append("R1 architectures")
    if config_json.get("model_type") != "kimi_k3":
        bad.append("R1 model_type")
    t = config_json.get("text_config")
    if not isinstance(t, dict) or t.get("model_type") != "kimi_linear":
        return bad + ["R2 text_config"]
    if "quantization_config" in config_json:
        bad.append("R2 quantization_config belongs inside text_config")
    bad += [f"R3 {k}" for k in R3_KEYS if k not in t]
    la = t.get("linear_attn_config", {})
    bad += [f"R3 linear_attn_config.{k}" for k in ("kda_layers", "full_attn_layers") if k not in la]
    if not t.get("mla_use_nope"):
        bad.append("R4 mla_use_nope")
    dims = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    bad += [f"R4 {k}={t.get(k)}" for k, v in dims.items() if gpu and t.get(k) != v]
    if not la.get("use_full_rank_gate"):
        bad.append("R5 use_full_rank_gate")
    lb = la.get("gate_lower_bound")
    if lb is not None and not -5 <= lb < 0:
        bad.append("R5 gate_lower_bound")
    if not t.get("num_shared_experts"):
        bad.append("R6 num_shared_experts")
    if t.get("tie_word_embeddings") or "language_model.lm_head.weight" not in shapes:
        bad.append("R7 lm_head")
    bad += _weight_violations(t, shapes)
    q = t.get("quantization_config")
    if q is not None:
        group = q["config_groups"]["group_0"]["weights"]["group_size"]
        if q.get("format") != "mxfp4-pack-quantized" or group != 32:
            bad.append("R10 quantization_config")
        if t["moe_intermediate_size"] % 32 or t["routed_expert_hidden_size"] % 32:
            bad.append("R10 expert widths")
    return bad


def _weight_violations(t: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    bad = []
    la, H = t["linear_attn_config"], t["num_attention_heads"]
    kda_heads, D, W = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    for i in range(t["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        if i + 1 in la["kda_layers"]:
            names = [
                f"self_attn.{n}.weight"
                for n in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_proj")
            ]
            names += [f"self_attn.{c}_conv1d.weight" for c in "qkv"] + ["self_attn.f_b_proj.weight"]
            bad += [f"R8 {p}{n}" for n in names if p + n not in shapes]
            a_log = shapes.get(p + "self_attn.A_log")
            if a_log not in ((1, 1, kda_heads, 1),) and not (
                a_log and len(a_log) == 1 and a_log[0] >= kda_heads
            ):
                bad.append(f"R9 {p}A_log {a_log}")
            if shapes.get(p + "self_attn.dt_bias") != (kda_heads * D,):
                bad.append(f"R9 {p}dt_bias")
            if shapes.get(p + "self_attn.q_conv1d.weight") not in ((kda_heads * D, 1, W), (kda_heads * D, W)):
                bad.append(f"R9 {p}q_conv1d")
        else:
            names = ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj", "g_proj"]
            bad += [f"R8 {p}self_attn.{n}.weight" for n in names if f"{p}self_attn.{n}.weight" not in shapes]
            kv_b = shapes.get(p + "self_attn.kv_b_proj.weight")
            if kv_b != (H * (t["qk_nope_head_dim"] + t["v_head_dim"]), t["kv_lora_rank"]):
                bad.append(f"R8 {p}kv_b_proj {kv_b}")
        if i >= t["first_k_dense_replace"]:
            moe = p + "block_sparse_moe."
            if moe + "gate.e_score_correction_bias" not in shapes:
                bad.append(f"R8 {moe}gate.e_score_correction_bias")
            for e in range(t["num_experts"]):
                for w in ("w1", "w2", "w3"):
                    base = f"{moe}experts.{e}.{w}."
                    if base + "weight" not in shapes and base + "weight_packed" not in shapes:
                        bad.append(f"R8 {base}weight")
    return bad


def official_shapes(config) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes k3 writes for `config`, without allocating (meta tensors)."""
    meta = {n: torch.empty(s, device="meta") for n, s in expected_shapes(config).items()}
    return {n: tuple(t.shape) for n, t in to_official(meta, config).items()}


@pytest.mark.parametrize("name", ["k3-small", "k3-full"])
def test_gpu_presets_meet_vllms_contract(name):
    config = preset(name)
    assert vllm_violations(config.to_hf(), official_shapes(config), gpu=True) == []


@pytest.mark.parametrize("name", ["k3-nano", "k3-tiny"])
def test_cpu_presets_meet_it_but_for_the_gpu_kernels_mla_widths(name):
    config = preset(name)
    found = vllm_violations(config.to_hf(), official_shapes(config), gpu=True)
    assert found and all(v.startswith("R4 ") for v in found), found
    assert vllm_violations(config.to_hf(), official_shapes(config), gpu=False) == []


def test_the_checker_catches_each_kind_of_break():
    config = preset("k3-small")
    good, shapes = config.to_hf(), official_shapes(config)
    bare = good["text_config"]
    assert "R1 architectures" in vllm_violations(bare, shapes, gpu=True)
    tied = json.loads(json.dumps(good))
    tied["text_config"]["tie_word_embeddings"] = True
    assert "R7 lm_head" in vllm_violations(tied, shapes, gpu=True)
    narrow = dict(shapes)
    narrow["language_model.model.layers.0.self_attn.A_log"] = (3,)
    assert any(v.startswith("R9") for v in vllm_violations(good, narrow, gpu=True))
    small = json.loads(json.dumps(good))
    small["text_config"]["kv_lora_rank"] = 256
    assert "R4 kv_lora_rank=256" in vllm_violations(small, shapes, gpu=True)


def test_an_exported_folder_meets_the_contract(tmp_path):
    """A real `k3 export --format hf` of a k3-nano (and of its MXFP4 quantization) on disk."""
    from k3.checkpoint.io import save_checkpoint
    from k3.export.hf import export_hf
    from k3.export.source import load_source
    from k3.model.transformer import K3ForCausalLM
    from k3.quant.checkpoint import save_mxfp4_checkpoint

    config = preset("k3-nano")
    model = K3ForCausalLM(config)
    save_checkpoint(model, config, tmp_path / "run")
    save_mxfp4_checkpoint(model, config, tmp_path / "quant")
    for src in ("run", "quant"):
        out = export_hf(load_source(tmp_path / src), tmp_path / f"{src}-release")
        cfg = json.loads((out / "config.json").read_text())
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        assert vllm_violations(cfg, shapes, gpu=False) == [], src
        assert cfg["text_config"]["dtype"] == ("bfloat16" if src == "quant" else "float32")
        assert ("quantization_config" in cfg["text_config"]) == (src == "quant")
