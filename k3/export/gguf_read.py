"""Read a GGUF file of llama.cpp's `kimi-k3` architecture as a k3 model, tokenizer and chat template.

    ckpt = load_gguf("k3-nano-q8_0.gguf")           # GGUFCheckpoint(model, config, tokenizer, ...)
    config = read_gguf_config("k3-nano.gguf")        # the K3Config alone (no tensor is decoded)

What is read (the inverse of `k3.export.gguf`, which writes such files, and what llama.cpp's own
converter and quantizer write):

* metadata `kimi-k3.*` -> K3Config (`config_from_fields`): the keys llama.cpp's loader reads; MLA layers
  are those with one KV head. Keys the file does not hold (training settings such as initializer_range
  or bias_update) take K3Config's defaults; they do not change inference. A head equal byte for byte to
  the embedding means tied embeddings;
* `tokenizer.ggml.*` -> K3Tokenizer (`tokenizer_from_gguf_vocab`): the `gpt2` model
  with the `kimi-k2` pre-tokenizer, its tokens and merges; the last 256 ids are the reserved block;
* `tokenizer.chat_template` -> `GGUFCheckpoint.chat_template` (the text, or None);
* tensors (`k3.quant.ggml`): F32, F16, BF16, Q8_0, Q4_0 and MXFP4, mapped back to our state_dict by
  `k3.export.gguf_layout.state_from_gguf`. Routed experts stored as MXFP4 stay packed (k3's
  PackedRoutedExperts, 4.25 bits per weight, the layout `k3 quantize` checkpoints load into) unless
  `packed_experts=False`; Q8_0 linear layers stay as their blocks (k3.quant.q8.Q8Linear) unless
  `keep_q8=False`; every other tensor is decoded to `dtype` (default: bfloat16 for a file whose
  matrices are all exact in it, a BF16 file, else float32). Any other GGML type is refused with a
  ValueError naming the type and the tensors stored in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from k3.checkpoint.adapter import is_f32_tensor, short_list
from k3.config import K3Config, LinearAttnConfig

if TYPE_CHECKING:
    from k3.tokenizer import K3Tokenizer
    from k3.tokenizer_export import GGUFVocab

ARCH = "kimi-k3"
_ROUTED = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class GGUFCheckpoint:
    model: torch.nn.Module  # K3ForCausalLM, eval mode
    config: K3Config
    tokenizer: K3Tokenizer
    chat_template: str | None
    tensor_types: dict[str, str] = field(default_factory=dict)  # GGUF tensor name -> GGML type name
    packed_layers: list[int] = field(default_factory=list)  # layers whose routed experts stay MXFP4


def is_gguf(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def _reader(path: str | Path):
    try:
        import gguf
    except ImportError as e:
        raise ValueError("reading a GGUF needs the gguf package: pip install 'k3[gguf]'") from e
    p = Path(path)
    if not is_gguf(p):
        raise ValueError(f"{p} is not a GGUF file (no GGUF magic)")
    try:
        reader = gguf.GGUFReader(str(p), "c")  # copy-on-write: writable arrays without a copy
    except (ValueError, KeyError, IndexError) as e:
        raise ValueError(f"cannot read GGUF file {p}: {e}") from None
    arch = _value(reader.fields, "general.architecture")
    if arch != ARCH:
        raise ValueError(f"{p}: architecture {arch!r} is not {ARCH!r}; k3 reads kimi-k3 GGUFs only")
    return reader


def _value(fields: dict, key: str, default=None):
    """A metadata value: scalar, string, or list for arrays; `default` when absent."""
    f = fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v.tolist() if isinstance(v, np.ndarray) else v


def _f32(v) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-05, not 9.99999974e-06),
    so a config that wrote 1e-5 reads 1e-5 again."""
    return float(str(np.float32(v)))


def _need(fields: dict, key: str):
    v = _value(fields, key)
    if v is None:
        raise ValueError(f"the GGUF lacks metadata key {key}, which a kimi-k3 model needs")
    return v


# ---- metadata -> K3Config ---------------------------------------------------------------------------
def config_from_fields(
    fields: dict, *, tie_word_embeddings: bool = False, latent_norm: bool = True
) -> K3Config:
    """K3Config from GGUF metadata (`GGUFReader.fields`). `latent_norm`: the file holds
    `ffn_routed_norm` tensors (LatentMoE's norm is not a metadata key)."""

    def k(key: str):
        return _need(fields, f"{ARCH}.{key}")

    def opt(key: str, default=None):
        return _value(fields, f"{ARCH}.{key}", default)

    layers = int(k("block_count"))
    heads_kv = k("attention.head_count_kv")
    heads_kv = heads_kv if isinstance(heads_kv, list) else [heads_kv] * layers
    if len(heads_kv) != layers or any(h not in (0, 1) for h in heads_kv):
        raise ValueError(
            f"{ARCH}.attention.head_count_kv must give 0 (KDA) or 1 (MLA) per layer for {layers} layers, "
            f"got {heads_kv}"
        )
    lower = opt("kda.gate_lower_bound")
    la = LinearAttnConfig(
        num_heads=int(k("attention.head_count")),
        head_dim=int(k("kda.head_dim")),
        full_attn_layers=tuple(i + 1 for i, h in enumerate(heads_kv) if h == 1),
        kda_layers=tuple(i + 1 for i, h in enumerate(heads_kv) if h == 0),
        short_conv_kernel_size=int(k("ssm.conv_kernel")),
        gate_lower_bound=None if lower is None else _f32(lower),
    )
    rope = int(k("rope.dimension_count"))
    gating = int(opt("expert_gating_func", 2))
    if gating != 2:
        raise ValueError(f"{ARCH}.expert_gating_func is {gating}; K3's router is sigmoid gating (2)")
    q_lora = opt("attention.q_lora_rank")
    tokens = {
        key: _value(fields, f"tokenizer.ggml.{name}")
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"))
    }
    tokens["pad_token_id"] = _value(fields, "tokenizer.ggml.padding_token_id")
    groups = int(opt("expert_group_count", 1) or 1)
    return K3Config(
        vocab_size=int(opt("vocab_size") or len(_need(fields, "tokenizer.ggml.tokens"))),
        hidden_size=int(k("embedding_length")),
        num_hidden_layers=layers,
        linear_attn_config=la,
        rms_norm_eps=_f32(k("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(k("context_length")),
        tie_word_embeddings=tie_word_embeddings,
        activation_situ_beta=_f32(opt("activation.situ_beta", 4.0)),
        activation_situ_linear_beta=_f32(opt("activation.situ_linear_beta", 25.0)),
        **{key: None if v is None else int(v) for key, v in tokens.items()},
        num_attention_heads=int(k("attention.head_count")),
        num_key_value_heads=int(k("attention.head_count")),
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(k("attention.kv_lora_rank")),
        qk_nope_head_dim=int(k("attention.key_length_mla")) - rope,
        qk_rope_head_dim=rope,
        v_head_dim=int(k("attention.value_length_mla")),
        attn_res_block_size=int(k("attn_res.block_size")),
        num_experts=int(k("expert_count")),
        num_experts_per_token=int(k("expert_used_count")),
        num_shared_experts=int(opt("expert_shared_count", 0)),
        moe_intermediate_size=int(k("expert_feed_forward_length")),
        routed_expert_hidden_size=int(k("expert_latent_length")),
        latent_moe_use_norm=latent_norm,
        intermediate_size=int(k("feed_forward_length")),
        first_k_dense_replace=int(k("leading_dense_block_count")),
        moe_renormalize=bool(opt("expert_weights_norm", True)),
        routed_scaling_factor=_f32(opt("expert_weights_scale", 1.0)),
        num_expert_group=groups,
        topk_group=int(opt("expert_group_used_count", 1) or 1),
        dtype="float32",
    )


def read_gguf_config(path: str | Path) -> K3Config:
    """The K3Config of a kimi-k3 GGUF (metadata, plus which tensors exist); no tensor is decoded."""
    reader = _reader(path)
    return _config(reader)


def _config(reader) -> K3Config:
    by_name = {t.name: t for t in reader.tensors}
    embd, head = by_name.get("token_embd.weight"), by_name.get("output.weight")
    tied = head is None or (
        embd is not None
        and embd.tensor_type == head.tensor_type
        and embd.data.shape == head.data.shape
        and np.array_equal(embd.data[:1], head.data[:1])  # an untied head differs in its first row
        and np.array_equal(embd.data, head.data)
    )
    latent_norm = any(n.endswith("ffn_routed_norm.weight") for n in by_name)
    return config_from_fields(reader.fields, tie_word_embeddings=tied, latent_norm=latent_norm)


# ---- tokenizer and chat template --------------------------------------------------------------------
def tokenizer_from_fields(fields: dict) -> K3Tokenizer:
    """K3Tokenizer from the `tokenizer.ggml.*` keys (see `tokenizer_from_gguf_vocab`)."""
    from k3.tokenizer_export import GGUFVocab

    merges = _value(fields, "tokenizer.ggml.merges", [])
    vocab = GGUFVocab(
        tokens=list(_need(fields, "tokenizer.ggml.tokens")),
        token_types=[int(t) for t in _value(fields, "tokenizer.ggml.token_type", [])],
        merges=list(merges),
        model=str(_need(fields, "tokenizer.ggml.model")),
        pre=str(_value(fields, "tokenizer.ggml.pre", "default")),
    )
    return tokenizer_from_gguf_vocab(vocab)


_MARKERS = ("<|open|>", "<|close|>", "<|sep|>")  # reserved but not special: decode keeps them


def tokenizer_from_gguf_vocab(vocab: GGUFVocab) -> K3Tokenizer:
    """Inverse of :func:`k3.tokenizer_export.gguf_vocab`: a K3Tokenizer from a GGUF's ``tokenizer.ggml.*``
    values.

    The ordinary ids ``0 .. n-257`` and the merges make an HF ``tokenizers`` byte-level BPE (as
    :func:`k3.tokenizer_train.train_tokenizer` builds) cut by Kimi K2's split; the last 256 tokens are the
    reserved block, named as in the file. Raises ValueError for a vocabulary this cannot reproduce: a
    model other than ``gpt2``, a pre-tokenizer other than ``kimi-k2``, or fewer than 512 tokens."""
    from tokenizers import models

    from k3.tokenizer import MIN_VOCAB_SIZE, NUM_RESERVED, K3Tokenizer, ReservedToken, byte_level_bpe

    if vocab.model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {vocab.model!r}; k3 reads byte-level BPE ('gpt2') only")
    if vocab.pre != "kimi-k2":
        raise ValueError(
            f"tokenizer.ggml.pre is {vocab.pre!r}; k3 reproduces only Kimi K2's split ('kimi-k2')"
        )
    n = len(vocab.tokens)
    if n < MIN_VOCAB_SIZE:
        raise ValueError(f"tokenizer.ggml.tokens holds {n} tokens, fewer than {MIN_VOCAB_SIZE}")
    base = n - NUM_RESERVED
    ordinary = {s: i for i, s in enumerate(vocab.tokens[:base])}
    if len(ordinary) != base:
        raise ValueError("tokenizer.ggml.tokens repeats an ordinary token")
    merges = []
    for m in vocab.merges:
        a, sep, b = m.partition(" ")
        if not sep or " " in b:
            raise ValueError(f"tokenizer.ggml.merges holds {m!r}, not 'a b'")
        merges.append((a, b))
    tok = byte_level_bpe(models.BPE(vocab=ordinary, merges=merges))
    reserved = [
        ReservedToken(base + j, name, name not in _MARKERS) for j, name in enumerate(vocab.tokens[base:])
    ]
    return K3Tokenizer.from_hf_tokenizer(tok, base, reserved)


def read_gguf_tokenizer(path: str | Path) -> K3Tokenizer:
    """The K3Tokenizer of a kimi-k3 GGUF; no tensor is decoded."""
    return tokenizer_from_fields(_reader(path).fields)


# ---- tensors ----------------------------------------------------------------------------------------
def tensor_types(reader) -> dict[str, str]:
    """GGUF tensor name -> GGML type name, in file order."""
    import gguf

    return {t.name: gguf.GGMLQuantizationType(int(t.tensor_type)).name for t in reader.tensors}


def check_types(types: dict[str, str]) -> None:
    """ValueError naming every GGML type k3 does not decode and the tensors stored in it."""
    from k3.quant.ggml import BLOCK_SIZES

    bad: dict[str, list[str]] = {}
    for name, kind in types.items():
        if kind not in BLOCK_SIZES:
            bad.setdefault(kind, []).append(name)
    if bad:
        listed = "; ".join(f"{kind}: {short_list(names)}" for kind, names in sorted(bad.items()))
        raise ValueError(
            f"the GGUF holds tensor types k3 does not read ({listed}); k3 reads {', '.join(BLOCK_SIZES)}"
        )


def _raw(t) -> torch.Tensor:
    """A reader tensor's stored bytes as a flat uint8 tensor (sharing the copy-on-write mapping)."""
    return torch.from_numpy(np.ascontiguousarray(t.data).reshape(-1).view(np.uint8))


def _torch_shape(t) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def load_gguf(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    packed_experts: bool = True,
    keep_q8: bool = True,
    device: str | torch.device = "cpu",
) -> GGUFCheckpoint:
    """Load a kimi-k3 GGUF (see the module doc). dtype: what every decoded tensor becomes, except those the
    release keeps in F32 (convs, A_log, dt_bias, o_norm, router bias); None (default): bfloat16 when every
    matrix among them holds bf16 values exactly (a BF16 file: kept at its size, no f32 copy; its vectors
    stay F32 where they are not exact in bf16), else float32;
    packed_experts: keep MXFP4 routed experts packed; keep_q8: hold Q8_0 linear layers as their blocks
    (k3.quant.q8.Q8Linear, a quarter of the f32 bytes). Raises ValueError for another architecture,
    unreadable tensor types, or tensors that do not form a K3 model of the file's metadata."""
    from k3.export.gguf_layout import state_from_gguf
    from k3.quant.ggml import decode, mxfp4_to_packed, q8_0_blocks

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPES))}, got {dtype}")
    reader = _reader(path)
    types = tensor_types(reader)
    check_types(types)
    config = _config(reader)
    tokenizer = tokenizer_from_fields(reader.fields)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} ids, the model {config.vocab_size}"
        )
    template = _value(reader.fields, "tokenizer.chat_template")

    packed_layers = _packed_layers(types, config) if packed_experts else []
    packed_names = {f"blk.{i}.{w}" for i in packed_layers for w in _ROUTED}
    tensors: dict[str, torch.Tensor] = {}
    q8: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of a decoded Q8_0 matrix -> its blocks
    for t in reader.tensors:
        if config.tie_word_embeddings and t.name == "output.weight":
            continue
        shape = _torch_shape(t)
        if t.name in packed_names:
            codes, scales = mxfp4_to_packed(_raw(t), shape)
            tensors[f"{t.name}:weight_packed"], tensors[f"{t.name}:weight_scale"] = codes, scales
        else:
            tensors[t.name] = decode(_raw(t), types[t.name], shape)
            if keep_q8 and types[t.name] == "Q8_0" and len(shape) == 2:
                q8[id(tensors[t.name])] = q8_0_blocks(_raw(t), shape)
    state = state_from_gguf(tensors, config)
    del tensors
    q8_names = {name: q8[id(t)] for name, t in state.items() if id(t) in q8}  # mapped one to one
    auto = dtype is None
    if auto:
        dtype = torch.bfloat16 if _matrices_exact_in_bf16(state) else torch.float32
    for name, t in state.items():
        if t.is_floating_point() and not is_f32_tensor(name):
            if auto and _kept_f32(name, t):  # a BF16 file's F32 norms and router stay F32
                continue
            state[name] = t.to(dtype)
    state = {n: t.to(device) for n, t in state.items()}
    if packed_layers:
        from k3.quant.checkpoint import with_mxfp4_config

        config = with_mxfp4_config(config)
    config = config.replace(dtype=_DTYPES[dtype])
    model = _build(config, state, packed_layers, path)
    _hold_q8(model, q8_names, device)
    return GGUFCheckpoint(model.eval(), config, tokenizer, template, types, packed_layers)


def _hold_q8(model: torch.nn.Module, blocks: dict[str, tuple], device) -> None:
    """Swap each linear layer whose weight came from a Q8_0 tensor for a Q8Linear of those blocks."""
    from k3.quant.q8 import Q8Linear

    for name, (codes, scales) in blocks.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if leaf != "weight" or not isinstance(module, torch.nn.Linear):
            continue  # an embedding, or a tensor the layout joins (kv_b): widened
        parent, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, Q8Linear(codes.to(device), scales.to(device)))


def _exact_in_bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 or torch.equal(t.to(torch.bfloat16).to(t.dtype), t)


def _kept_f32(name: str, t: torch.Tensor) -> bool:
    """A vector (one row: norm gains, AttnRes queries) or the router's matrix, which a BF16 file stores
    F32 (as llama.cpp's writers do), where its values are not exact in bf16: kept F32 in a bf16 model."""
    vector = t.numel() == t.shape[-1] if t.ndim else True
    return (vector or name.endswith("block_sparse_moe.gate.weight")) and not _exact_in_bf16(t)


def _matrices_exact_in_bf16(state: dict[str, torch.Tensor]) -> bool:
    """Whether every floating tensor the model stores in its dtype holds bf16 values exactly, but for
    those a BF16 file keeps F32 (`_kept_f32`)."""
    return all(
        _exact_in_bf16(t) or _kept_f32(name, t)
        for name, t in state.items()
        if t.is_floating_point() and not is_f32_tensor(name)
    )


def _packed_layers(types: dict[str, str], config: K3Config) -> list[int]:
    """Layers whose three routed-expert matrices are all stored MXFP4."""
    return [
        i
        for i in range(config.num_hidden_layers)
        if all(types.get(f"blk.{i}.{w}") == "MXFP4" for w in _ROUTED)
    ]


def _build(config: K3Config, state: dict, packed_layers: list[int], source) -> torch.nn.Module:
    from k3.checkpoint.io import assign_meta_model
    from k3.model.transformer import K3ForCausalLM
    from k3.quant.packed import PackedRoutedExperts

    with torch.device("meta"):
        model = K3ForCausalLM(config)
        for i in packed_layers:
            moe = model.model.layers[i].block_sparse_moe
            moe.experts = PackedRoutedExperts.from_experts(moe.experts)
    return assign_meta_model(model, state, config, source)
