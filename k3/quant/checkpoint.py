"""MXFP4 routed-expert checkpoints in the release's compressed-tensors layout (docs/spec.md#config,
docs/spec.md#tensors, docs/spec.md#mxfp4).

In the release every routed-expert matrix `...block_sparse_moe.experts.{e}.w{1,2,3}` is stored as

    weight_packed uint8 [out, in/2]    FP4 E2M1 codes, column 2j in the low nibble of byte j, 2j+1 high
    weight_scale  uint8 [out, in/32]   E8M0 exponent of columns 32b .. 32b+31: 2^(byte - 127)

(`quantize_mx(W, "mxfp4")` of the logical W [out, in]) and `text_config.quantization_config` says so
(compressed-tensors, `mxfp4-pack-quantized`, group_size 32). Every other tensor is high precision.

* `export_mxfp4(tensors, config)` / `import_mxfp4(tensors, config, dtype)`: official tensors with
  high-precision experts <-> official tensors with MXFP4 experts (pure, no I/O);
* `save_mxfp4_checkpoint(model_or_state_dict, config, out_dir)`: writes such a checkpoint through
  `k3.checkpoint.io.save_checkpoint` (atomic, sharded, provenance) with the release's quantization_config;
  a model whose experts are already packed is written without re-quantizing;
* `load_mxfp4_checkpoint(dir, packed=True)`: a model whose experts stay packed (`PackedRoutedExperts`,
  filled from the file bytes, never materialized in high precision); `packed=False` dequantizes them
  (the plain `k3.checkpoint.load_checkpoint` does the same, to BF16, or FP32 for an FP32 checkpoint).

Re-exporting a loaded checkpoint reproduces its bytes exactly: quantize∘dequantize is the identity on
MXFP4 values, and BF16 holds every MXFP4 value exactly.
"""

import copy
import re
from collections import defaultdict
from pathlib import Path

import torch

from k3.checkpoint.adapter import from_official, official_to_ours_name, short_list
from k3.checkpoint.io import (
    DEFAULT_MAX_SHARD_BYTES,
    assign_meta_model,
    load_checkpoint,
    load_official_tensors,
    save_checkpoint,
)
from k3.config import K3Config
from k3.model.moe import RoutedExperts
from k3.ops.mx import BLOCK_SIZE, dequantize_mx, quantize_mx
from k3.quant.packed import pack_model_experts

# The release's text_config.quantization_config, verbatim (docs/spec.md#config).
MXFP4_QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "scale_dtype": "torch.uint8",
                "strategy": "group",
                "symmetric": True,
                "type": "float",
                "zp_dtype": None,
            },
        }
    },
    "format": "mxfp4-pack-quantized",
    "global_compression_ratio": None,
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# `(...experts.{e}.w{1,2,3}).weight` with or without the `language_model.` prefix
_EXPERT_WEIGHT = re.compile(r"^(.*block_sparse_moe\.experts\.\d+\.(w[123]))\.weight$")
_EXPERT_PACKED = re.compile(r"^(.*block_sparse_moe\.experts\.\d+\.(w[123]))\.(weight_packed|weight_scale)$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])$")
_STACKED_PACKED = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])\.(weight_\w+)$")
_OURS_PACKED = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight_\w+)$")


def mxfp4_quantization_config() -> dict:
    """A fresh copy of the release's quantization_config."""
    return copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)


def is_mxfp4_config(config: K3Config) -> bool:
    q = config.quantization_config or {}
    return q.get("quant_method") == "compressed-tensors" and q.get("format") == "mxfp4-pack-quantized"


def with_mxfp4_config(config: K3Config) -> K3Config:
    """`config` with the release's quantization_config (written inside text_config by to_hf)."""
    return config.replace(quantization_config=mxfp4_quantization_config())


def _expert_shape(w: str, config: K3Config) -> tuple[int, int]:
    """Logical [out, in] of one expert matrix: w1/w3 [I, Dl], w2 [Dl, I]."""
    inter, width = config.moe_intermediate_size, config.expert_width
    return (width, inter) if w == "w2" else (inter, width)


# ---- official tensors <-> MXFP4 official tensors ------------------------------------------------------
def export_mxfp4(tensors: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    """Official tensors -> the same with every routed-expert `weight` replaced by MXFP4 parts.

    `...experts.{e}.w{1,2,3}.weight` [out, in] (float) becomes `.weight_packed` uint8 [out, in/2] and
    `.weight_scale` uint8 [out, in/32]; every other tensor (already packed experts included) is passed on
    as is. Raises ValueError naming the tensor for a wrong shape (vs config) or a NaN/Inf weight.
    Works on official names and on our un-prefixed ones alike. Use with_mxfp4_config for the config.
    """
    out = {}
    for name, t in tensors.items():
        m = _EXPERT_WEIGHT.match(name)
        if m is None:
            out[name] = t
            continue
        expected = _expert_shape(m[2], config)
        if tuple(t.shape) != expected or not t.is_floating_point():
            raise ValueError(
                f"{name}: expected a float expert weight {list(expected)}, got {t.dtype} {list(t.shape)}"
            )
        if expected[1] % BLOCK_SIZE:
            raise ValueError(f"{name}: input dim {expected[1]} is not a multiple of {BLOCK_SIZE}")
        packed, scale = quantize_mx(t.detach(), "mxfp4")
        if bool((scale == 255).any()):
            raise ValueError(f"{name}: holds NaN or Inf values, which MXFP4 can only store as a NaN block")
        out[f"{m[1]}.weight_packed"], out[f"{m[1]}.weight_scale"] = packed, scale
    return out


def import_mxfp4(
    tensors: dict[str, torch.Tensor], config: K3Config, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Inverse of export_mxfp4: MXFP4 expert parts -> `...experts.{e}.w{1,2,3}.weight` in `dtype`.

    Exact for BF16 and wider. Raises ValueError naming the expert if a part is missing or misshaped.
    """
    out, parts = {}, defaultdict(dict)
    for name, t in tensors.items():
        if m := _EXPERT_PACKED.match(name):
            parts[(m[1], m[2])][m[3]] = t
        else:
            out[name] = t
    for (base, w), p in parts.items():
        if len(p) != 2:
            lacking = "weight_scale" if "weight_packed" in p else "weight_packed"
            raise ValueError(f"{base}: MXFP4 expert lacks {lacking}")
        rows, cols = _expert_shape(w, config)
        want = ((rows, cols // 2), (rows, cols // BLOCK_SIZE))
        got = (tuple(p["weight_packed"].shape), tuple(p["weight_scale"].shape))
        if got != want:
            raise ValueError(f"{base}: expected weight_packed / weight_scale {want}, got {got}")
        out[f"{base}.weight"] = dequantize_mx(p["weight_packed"], p["weight_scale"], "mxfp4", dtype)
    return out


# ---- our state_dict -> checkpoint directory ----------------------------------------------------------
def split_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state_dict with stacked experts -> per-expert entries under our (un-prefixed) names, as views.

    `...experts.w1` [E, I, Dl] -> `...experts.{e}.w1.weight` [I, Dl]; a packed model's
    `...experts.w1.weight_packed` [E, I, Dl/2] (and `weight_scale`) -> `...experts.{e}.w1.weight_packed`.
    """
    out = {}
    for name, t in state_dict.items():
        if m := _STACKED.match(name):
            out |= {f"{m[1]}.{e}.{m[2]}.weight": t[e] for e in range(t.shape[0])}
        elif m := _STACKED_PACKED.match(name):
            out |= {f"{m[1]}.{e}.{m[2]}.{m[3]}": t[e] for e in range(t.shape[0])}
        else:
            out[name] = t
    return out


def save_mxfp4_checkpoint(
    model_or_state_dict,
    config: K3Config,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = torch.bfloat16,
    extra_files: dict[str, str | bytes | Path] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a checkpoint with MXFP4 routed experts and the release's quantization_config.

    Experts are quantized from their in-memory precision (before any `dtype` cast); `dtype` (default BF16,
    as the release; None keeps each tensor's dtype) applies to every other floating tensor except the
    release's F32 ones. Packed experts (PackedRoutedExperts) are written as they are.
    """
    state = (
        model_or_state_dict.state_dict()
        if isinstance(model_or_state_dict, torch.nn.Module)
        else model_or_state_dict
    )
    tensors = export_mxfp4(split_experts(state), config)
    return save_checkpoint(
        tensors,
        with_mxfp4_config(config),
        out_dir,
        dtype=dtype,
        extra_files=extra_files,
        max_shard_bytes=max_shard_bytes,
    )


# ---- checkpoint directory -> model -------------------------------------------------------------------
def _take_packed(tensors: dict[str, torch.Tensor], config: K3Config) -> tuple[dict, dict]:
    """Split official tensors into (stacked packed experts under the PackedRoutedExperts state_dict
    names, everything else). Every expert 0..E-1 of each packed matrix must be present."""
    groups, rest = defaultdict(dict), {}
    for name, t in tensors.items():
        if m := _OURS_PACKED.match(official_to_ours_name(name)):
            groups[(m[1], m[3], m[4])][int(m[2])] = t
        else:
            rest[name] = t
    stacked = {}
    for (layer, w, part), per_e in groups.items():
        key = f"model.layers.{layer}.block_sparse_moe.experts.{w}.{part}"
        missing = [e for e in range(config.num_experts) if e not in per_e]
        extra = sorted(e for e in per_e if e >= config.num_experts)
        if missing or extra:
            raise ValueError(
                f"{key}: checkpoint must hold experts 0..{config.num_experts - 1}; missing "
                f"{short_list(missing)}, out of range {short_list(extra)}"
            )
        stacked[key] = torch.stack([per_e[e] for e in range(config.num_experts)])
    return stacked, rest


def load_mxfp4_checkpoint(
    ckpt_dir: str | Path,
    *,
    packed: bool = True,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[torch.nn.Module, K3Config]:
    """Load a checkpoint with MXFP4 experts -> (K3ForCausalLM, config).

    packed=True: routed experts are PackedRoutedExperts holding the file's bytes (4.25 bits/weight),
    every other tensor as stored; built on the meta device, nothing is initialized or held twice.
    packed=False: plain RoutedExperts, dequantized to `dtype` (default: the embedding's dtype, so the
    model has one compute dtype). Raises ValueError naming missing, unexpected or misshaped tensors.
    """
    if not packed:
        model, config = load_checkpoint(ckpt_dir, device=device)
        target = dtype or model.model.embed_tokens.weight.dtype
        for m in model.modules():
            if isinstance(m, RoutedExperts):
                for name in ("w1", "w2", "w3"):
                    setattr(m, name, torch.nn.Parameter(getattr(m, name).detach().to(target)))
        return model, config
    from k3.model.transformer import K3ForCausalLM

    config = K3Config.load(Path(ckpt_dir))
    stacked, rest = _take_packed(load_official_tensors(ckpt_dir, device=device), config)
    state = from_official(rest, config) | stacked
    with torch.device("meta"):
        model = pack_model_experts(K3ForCausalLM(config))
    return assign_meta_model(model, state, config, ckpt_dir), config
