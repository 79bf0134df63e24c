"""Write a k3 checkpoint as a GGUF file for llama.cpp's `kimi-k3` model (the `gguf` package's writer).

    write_gguf(state, config, tokenizer_dir, out_path, outtype="f32")

Metadata: the keys llama.cpp's kimi-k3 loader reads (`load_arch_hparams`), under the arch prefix
`kimi-k3.`; MLA is declared as MQA over the compressed latent (one KV head on MLA layers, zero on KDA
layers, which is how llama.cpp tells the layer kinds apart), so `attention.key_length` is
kv_lora_rank + qk_rope_head_dim and `attention.value_length` kv_lora_rank, while `*_mla` give the
per-head query/key and value widths. Tensors: `k3.export.gguf_layout`. Tokenizer: `K3Tokenizer.gguf_vocab()`
(k3/tokenizer_export.py) and the chat template of tokenizer_config.json.

Outtypes (what each tensor is stored as; norms, biases, convs, `ssm_a` and the router stay F32 always,
as in llama.cpp's own converter, because they are small and the router's choice is sensitive):

    f32     everything F32 (bit-exact weights: the parity reference)
    bf16    matrices BF16
    q8_0    matrices Q8_0 (blocks of 32 along the input width; a matrix whose input width is not a
            multiple of 32 stays F32)
    mxfp4   routed experts MXFP4 (the codes k3's MXFP4 checkpoints hold, bit for bit), the rest F32
    mxfp4_moe  llama.cpp's MXFP4_MOE recipe, as its quantizer (`llama-quantize F32.gguf OUT MXFP4_MOE`,
            src/llama-quant.cpp) types an f32 file: every 3-D tensor holding more than one matrix (the
            routed experts, and MLA's attn_k_b / attn_v_b) MXFP4 with ggml's own rounding (the `gguf`
            package's port of it), every other matrix Q8_0 (the router F32), a matrix whose input width
            is not a multiple of 32 F16
"""

import json
from pathlib import Path

import torch

from k3.config import K3Config
from k3.export.gguf_layout import ROUTED_EXPERTS, ROUTER, gguf_tensors
from k3.ops.mx import quantize_mx
from k3.tokenizer import K3Tokenizer

ARCH = "kimi-k3"
OUTTYPES = ("f32", "bf16", "q8_0", "mxfp4", "mxfp4_moe")
BLOCK = 32
# general.file_type (llama.cpp's llama_ftype) per outtype
_FILE_TYPES = {"f32": 0, "bf16": 32, "q8_0": 7, "mxfp4": 38, "mxfp4_moe": 38}
_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ValueError("GGUF export needs the gguf package: pip install 'k3[gguf]'") from e
    return gguf


def write_gguf(
    state: dict[str, torch.Tensor],
    config: K3Config,
    tokenizer_dir: str | Path,
    out_path: str | Path,
    outtype: str = "f32",
    name: str | None = None,
) -> Path:
    """Write our `state` (state_dict) + the tokenizer in `tokenizer_dir` as `out_path` (a .gguf file).

    The file is written beside its final name and renamed when complete, so a failed export leaves no
    partial .gguf behind. Returns the path.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    gguf = _gguf()
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        writer.add_name(name or out_path.stem)
        writer.add_type("model")
        writer.add_file_type(_FILE_TYPES[outtype])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_hparams(writer, config)
        _add_tokenizer(writer, tokenizer_dir, config)
        for tensor_name, t in gguf_tensors(state, config).items():
            data, raw = _encode(gguf, tensor_name, t, outtype)
            writer.add_tensor(tensor_name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path


# ---- metadata ---------------------------------------------------------------------------------------
def hparams(config: K3Config) -> list[tuple[str, str, object]]:
    """(key without the arch prefix, GGUF value kind, value) for every hyperparameter kimi-k3 reads."""
    c, la = config, config.linear_attn_config
    heads_kv = [0 if c.is_kda_layer(i) else 1 for i in range(c.num_hidden_layers)]
    keys = [
        ("vocab_size", "u32", c.vocab_size),
        ("block_count", "u32", c.num_hidden_layers),
        ("context_length", "u32", c.max_position_embeddings),
        ("embedding_length", "u32", c.hidden_size),
        ("feed_forward_length", "u32", c.intermediate_size),
        ("attention.head_count", "u32", c.num_attention_heads),
        ("attention.head_count_kv", "i32[]", heads_kv),
        ("attention.layer_norm_rms_epsilon", "f32", c.rms_norm_eps),
        ("attention.kv_lora_rank", "u32", c.kv_lora_rank),
        ("attention.key_length", "u32", c.kv_lora_rank + c.qk_rope_head_dim),
        ("attention.value_length", "u32", c.kv_lora_rank),
        ("attention.key_length_mla", "u32", c.qk_nope_head_dim + c.qk_rope_head_dim),
        ("attention.value_length_mla", "u32", c.v_head_dim),
        ("rope.dimension_count", "u32", c.qk_rope_head_dim),
        ("ssm.conv_kernel", "u32", la.short_conv_kernel_size),
        ("kda.head_dim", "u32", la.head_dim),
        ("expert_count", "u32", c.num_experts),
        ("expert_used_count", "u32", c.num_experts_per_token),
        ("expert_group_used_count", "u32", c.topk_group),
        ("expert_gating_func", "u32", _GATING_SIGMOID),
        ("expert_feed_forward_length", "u32", c.moe_intermediate_size),
        ("expert_shared_count", "u32", c.num_shared_experts),
        ("leading_dense_block_count", "u32", c.first_k_dense_replace),
        ("expert_weights_scale", "f32", c.routed_scaling_factor),
        ("expert_weights_norm", "bool", c.moe_renormalize),
        ("expert_latent_length", "u32", c.routed_expert_hidden_size),
        ("activation.situ_beta", "f32", c.activation_situ_beta),
        ("activation.situ_linear_beta", "f32", c.activation_situ_linear_beta),
        ("attn_res.block_size", "u32", c.attn_res_block_size),
    ]
    if c.q_lora_rank is not None:
        keys.append(("attention.q_lora_rank", "u32", c.q_lora_rank))
    if la.gate_lower_bound is not None:  # absent: llama.cpp uses the softplus (Kimi-Linear) gate
        keys.append(("kda.gate_lower_bound", "f32", la.gate_lower_bound))
    return keys


def _add_hparams(writer, config: K3Config) -> None:
    gguf = _gguf()
    for key, kind, value in hparams(config):
        full = f"{ARCH}.{key}"
        if kind == "u32":
            writer.add_uint32(full, int(value))
        elif kind == "f32":
            writer.add_float32(full, float(value))
        elif kind == "bool":
            writer.add_bool(full, bool(value))
        else:  # i32[]
            ints = [int(v) for v in value]
            writer.add_key_value(full, ints, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)


def _add_tokenizer(writer, tokenizer_dir: str | Path, config: K3Config) -> None:
    tokenizer = K3Tokenizer.from_dir(tokenizer_dir)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(
            f"{tokenizer_dir}: the tokenizer has {tokenizer.vocab_size} ids, the model {config.vocab_size}"
        )
    vocab = tokenizer.gguf_vocab()  # refuses a tokenizer whose split is not Kimi K2's
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    ids = vocab.special_ids
    writer.add_bos_token_id(ids["bos"])
    # <|end_of_msg|>, the stop token of a turn (docs/spec_text.md#tokenizer), not [EOS]
    writer.add_eos_token_id(ids["eos"])
    writer.add_unk_token_id(ids["unk"])
    writer.add_pad_token_id(ids["pad"])
    writer.add_add_bos_token(False)  # the chat path prepends nothing (docs/spec_text.md#tokenizer)
    writer.add_add_eos_token(False)
    template = chat_template(tokenizer_dir)
    if template:
        writer.add_chat_template(template)


def chat_template(tokenizer_dir: str | Path) -> str | None:
    """The chat template of tokenizer_config.json, or None when the checkpoint has none."""
    path = Path(tokenizer_dir) / "tokenizer_config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("chat_template")


# ---- tensor encodings ---------------------------------------------------------------------------------
def stored_type(name: str, t: torch.Tensor, outtype: str) -> str:
    """What `name` is stored as for `outtype`: "f32", "f16", "bf16", "q8_0" or "mxfp4"."""
    short = name.split(".", 2)[-1] if name.startswith("blk.") else name  # drop "blk.{i}."
    if outtype == "f32" or t.ndim not in (2, 3) or short == ROUTER:
        return "f32"
    if outtype == "mxfp4":
        return "mxfp4" if short in ROUTED_EXPERTS else "f32"
    if outtype == "mxfp4_moe":
        if t.shape[-1] % BLOCK:
            return "f16"  # llama.cpp's fallback for a width no 32-element block type fits
        return "mxfp4" if t.ndim == 3 and t.shape[0] > 1 else "q8_0"
    if outtype == "q8_0" and t.shape[-1] % BLOCK:
        return "f32"
    return outtype


def _encode(gguf, name: str, t: torch.Tensor, outtype: str):
    """(numpy array, raw GGML type or None) for GGUFWriter.add_tensor."""
    kind = stored_type(name, t, outtype)
    q = gguf.GGMLQuantizationType
    if kind == "f32":
        return t.float().contiguous().numpy(), None
    if kind == "bf16":
        return t.to(torch.bfloat16).contiguous().view(torch.uint8).numpy(), q.BF16
    if kind == "f16":
        return t.float().numpy().astype("float16"), None
    if kind == "q8_0":
        return gguf.quants.quantize(t.float().contiguous().numpy(), q.Q8_0), q.Q8_0
    if outtype == "mxfp4_moe":  # ggml's rounding (ties toward zero), as llama.cpp's quantizer writes
        return gguf.quants.quantize(t.float().contiguous().numpy(), q.MXFP4), q.MXFP4
    return mxfp4_blocks(t).numpy(), q.MXFP4


def mxfp4_blocks(w: torch.Tensor) -> torch.Tensor:
    """Float experts [..., out, in] -> ggml MXFP4 blocks, uint8 [..., out, in/32 * 17].

    Each block of 32 inputs is one E8M0 scale byte then 16 bytes of E2M1 codes; ggml puts element j in
    the low nibble of byte j and element j+16 in its high nibble. The codes are `quantize_mx`'s (k3's
    MXFP4 checkpoints), repacked: compressed-tensors stores elements 2j / 2j+1 in byte j instead.
    """
    packed, scales = quantize_mx(w.float(), "mxfp4")  # [..., in/2], [..., in/32]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # [..., in]
    codes = codes.unflatten(-1, (-1, BLOCK))  # [..., nb, 32]
    qs = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)  # [..., nb, 16]
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).flatten(-2)
