"""Official Kimi K3 checkpoint names <-> our in-memory state_dict (CONTRIBUTING.md#checkpoint-adapters). Pure
functions, no I/O.

Official layout (docs/spec.md#tensors): the text model lives under `language_model.` and otherwise uses our
names, with three differences that this file converts:

* routed experts are stored one tensor per expert, `...block_sparse_moe.experts.{e}.w1.weight` [I, Dl]
  (w3 likewise, w2 [Dl, I]); in memory they are stacked, `...experts.w1` [E, I, Dl], `w3`, `w2` [E, Dl, I];
* KDA `A_log` is per head, [H] in memory, but stored zero-padded to the next multiple of 128 (the release
  stores 96 heads as [128], docs/spec.md#tensors, docs/spec.md#choices); on load we also accept [H] and the
  legacy [1, 1, H, 1];
* the release stores the routed experts as MXFP4 (`weight_packed` / `weight_scale` uint8, docs/spec.md#mxfp4);
  on load they are decoded with `k3.ops.mx.dequantize_mx` to BF16 (FP32 if the embedding is FP32), which
  is exact (an FP4 value times a power of two always fits BF16). We always write BF16/FP32 experts
  (`weight`).

On load we also accept vLLM's alternative prefix `language_model.layers.*` (= `language_model.model.
layers.*`) and bare Kimi-Linear names without `language_model.`. The multimodal tensors (`vision_tower.*`,
`mm_projector.*`) are not part of the text model: `split_multimodal` separates them, `from_official` leaves
them out, and `to_official` passes them through unchanged if they are in its input.
With `tie_word_embeddings`, `lm_head.weight` is not written and is restored from the embedding on load.
"""

import math
import re
from collections import defaultdict

import torch

from k3.config import K3Config
from k3.ops.mx import dequantize_mx

PREFIX = "language_model."
MULTIMODAL_PREFIXES = ("vision_tower.", "mm_projector.")
A_LOG_PAD = 128  # A_log is stored padded to a multiple of this many heads

# Stored in FP32 in the release whatever the checkpoint dtype (docs/spec.md#tensors).
F32_SUFFIXES = ("conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")

_STACKED = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(w[123])$")
_SPLIT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight\w*)$")
_PACKED_PARTS = ("weight_packed", "weight_scale")


def is_f32_tensor(name: str) -> bool:
    """True for the tensors the release keeps in FP32 (KDA convs, A_log, dt_bias, o_norm, router bias)."""
    return name.endswith(F32_SUFFIXES)


def is_multimodal(name: str) -> bool:
    return name.startswith(MULTIMODAL_PREFIXES)


def split_multimodal(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(text tensors, vision_tower.* / mm_projector.* tensors), both keyed by their official names."""
    text, mm = {}, {}
    for name, t in tensors.items():
        (mm if is_multimodal(name) else text)[name] = t
    return text, mm


def padded_heads(num_heads: int) -> int:
    """Length of the stored A_log: num_heads rounded up to a multiple of 128 (96 -> 128)."""
    return math.ceil(num_heads / A_LOG_PAD) * A_LOG_PAD


def pad_a_log(a_log: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A_log [H] -> [ceil(H/128)*128], zero-padded (the official storage)."""
    if tuple(a_log.shape) != (num_heads,):
        raise ValueError(f"A_log must have shape [{num_heads}] (one per KDA head), got {list(a_log.shape)}")
    out = a_log.new_zeros(padded_heads(num_heads))
    out[:num_heads] = a_log.detach()
    return out


def unpad_a_log(a_log: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Official A_log -> [H]. Accepts [H], the padded [ceil(H/128)*128] (padding dropped) or [1, 1, H, 1].

    Any other shape is returned unchanged, so the loader reports it as wrongly shaped.
    """
    shape = tuple(a_log.shape)
    if shape == (num_heads,):
        return a_log
    if shape == (padded_heads(num_heads),):
        return a_log[:num_heads].clone()
    if shape == (1, 1, num_heads, 1):
        return a_log.reshape(num_heads).clone()
    return a_log


def to_official(state_dict: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    """Our state_dict -> official tensors (names and layouts of the released checkpoint,
    docs/spec.md#tensors).

    Expert tensors are views of the stacked ones (no copy); A_log is a new padded tensor.
    """
    heads, experts = config.linear_attn_config.num_heads, config.num_experts
    out = {}
    for name, t in state_dict.items():
        if is_multimodal(name):
            out[name] = t
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        elif m := _STACKED.match(name):
            if t.ndim != 3 or t.shape[0] != experts:
                raise ValueError(
                    f"{name}: expected stacked experts [{experts}, out, in], got {list(t.shape)}"
                )
            for e, w in enumerate(t.unbind(0)):
                out[f"{PREFIX}model.layers.{m[1]}.block_sparse_moe.experts.{e}.{m[2]}.weight"] = w
        elif name.endswith(".self_attn.A_log"):
            try:
                out[PREFIX + name] = pad_a_log(t, heads)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        else:
            out[PREFIX + name] = t
    return out


def official_to_ours_name(name: str) -> str:
    """Strip the `language_model.` prefix; vLLM's `language_model.layers.` means `model.layers.`."""
    if name.startswith(PREFIX + "layers."):
        return "model." + name[len(PREFIX) :]
    if name.startswith(PREFIX):
        return name[len(PREFIX) :]
    return name  # bare Kimi-Linear names (`model.*`, `lm_head.weight`) are already ours


def from_official(tensors: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    """Official tensors -> our state_dict. Multimodal tensors are left out (see `split_multimodal`).

    Per-expert tensors (BF16 `weight`, or MXFP4 `weight_packed` + `weight_scale`) are stacked to
    [E, out, in]; every expert 0..E-1 of a stacked tensor must be present.
    """
    text, _ = split_multimodal(tensors)
    heads = config.linear_attn_config.num_heads
    state, experts, packed = {}, defaultdict(dict), defaultdict(dict)
    for name, t in text.items():
        ours = official_to_ours_name(name)
        if m := _SPLIT.match(ours):
            layer, e, w, part = m[1], int(m[2]), m[3], m[4]
            if part == "weight":
                experts[(layer, w)][e] = t
            elif part in _PACKED_PARTS:
                packed[(layer, w, e)][part] = t
            else:
                state[ours] = t  # unknown expert part: the loader reports it as unexpected
        elif ours.endswith(".self_attn.A_log"):
            state[ours] = unpad_a_log(t, heads)
        else:
            state[ours] = t
    dequant_dtype = _dequantize_dtype(state)
    for (layer, w, e), parts in packed.items():
        experts[(layer, w)][e] = _dequantize_expert(
            f"{PREFIX}model.layers.{layer}.block_sparse_moe.experts.{e}.{w}", parts, dequant_dtype
        )
    for (layer, w), per_expert in experts.items():
        name = f"model.layers.{layer}.block_sparse_moe.experts.{w}"
        state[name] = _stack_experts(name, per_expert, config.num_experts)
    if config.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _stack_experts(name: str, per_expert: dict[int, torch.Tensor], num_experts: int) -> torch.Tensor:
    """{e: [out, in]} for e = 0..E-1 -> [E, out, in]."""
    missing = [e for e in range(num_experts) if e not in per_expert]
    extra = sorted(e for e in per_expert if e >= num_experts)
    if missing or extra:
        raise ValueError(
            f"{name}: checkpoint must hold experts 0..{num_experts - 1}; "
            f"missing {short_list(missing)}, out of range {short_list(extra)}"
        )
    shapes = {tuple(t.shape) for t in per_expert.values()}
    dtypes = {t.dtype for t in per_expert.values()}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ValueError(
            f"{name}: per-expert tensors differ: shapes {sorted(shapes)}, dtypes {sorted(map(str, dtypes))}"
        )
    return torch.stack([per_expert[e] for e in range(num_experts)])


def _dequantize_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """Dtype of dequantized MXFP4 experts: the embedding's when it is FP32/FP64 (a checkpoint quantized
    with `k3 quantize --dtype keep` from an FP32 one), else BF16 -- both exact, and the model gets one
    compute dtype. (FP16 cannot hold every MXFP4 value, so an FP16 checkpoint still gets BF16 experts.)"""
    emb = state.get("model.embed_tokens.weight")
    return emb.dtype if emb is not None and emb.dtype in (torch.float32, torch.float64) else torch.bfloat16


def _dequantize_expert(
    name: str, parts: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 `weight_packed` [out, in/2] + `weight_scale` [out, in/32] (uint8) -> [out, in] in `dtype`
    (BF16 or wider: exact)."""
    lacking = [p for p in _PACKED_PARTS if p not in parts]
    if lacking:
        raise ValueError(f"{name}: packed MXFP4 expert lacks {', '.join(lacking)}")
    try:
        return dequantize_mx(parts["weight_packed"], parts["weight_scale"], "mxfp4", dtype=dtype)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def short_list(items: list, limit: int = 10) -> str:
    """A list for an error message, truncated with a count: '[0, 1, ... and 5 more]'."""
    items = list(items)
    if not items:
        return "none"
    head = ", ".join(map(str, items[:limit]))
    return f"[{head}{f', ... and {len(items) - limit} more' if len(items) > limit else ''}]"
