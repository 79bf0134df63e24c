# Long file: the fields, their named checks and the release-file round trip of one config read each other.
"""K3 model configuration: frozen dataclasses whose field names are the official config.json keys.

`K3Config` is the text model (`text_config` of the released checkpoint, `model_type: "kimi_linear"`);
`LinearAttnConfig` is its nested `linear_attn_config`. `from_hf(d)` takes the full multimodal config
(top level `model_type: "kimi_k3"` around a `text_config`) or a bare text config; `to_hf()` always
writes the released three-level file (wrapper `KimiK3ForConditionalGeneration` / `kimi_k3` around
`text_config` `KimiLinearForCausalLM` / `kimi_linear`), so llama.cpp's converter and vLLM pick their
K3 class from any file k3 writes, and every key we do not model is kept verbatim (`extra`, `wrapper`):
the official file round-trips exactly. Ablation switches the release does not have are k3 extension
keys (commented at their fields), written only when they differ from the K3 default.

Construction rejects what no K3 engine can run (one named check per concern); the release format
cannot express the ablation switches, so `release_problems()` names each one and every exporter
refuses a config that has any.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS = ("k3-nano", "k3-mini", "k3-tiny", "k3-small", "k3-full")

WRAPPER_ARCHITECTURE = "KimiK3ForConditionalGeneration"
WRAPPER_MODEL_TYPE = "kimi_k3"
TEXT_ARCHITECTURE = "KimiLinearForCausalLM"
MX_BLOCK = 32  # elements per MX block scale (OCP MX v1.0)
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"  # the wrapper's `image_placeholder`: plain text, not a token

_ACTS = ("situ", "silu")
_BIAS_UPDATES = ("quantile", "sign")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key '{key}': {msg}")


def _is_mxfp4(quantization_config: dict | None) -> bool:
    q = quantization_config
    return isinstance(q, dict) and q.get("format") == "mxfp4-pack-quantized"


def _positive_int(value: Any, key: str) -> None:
    _check(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        key,
        f"must be a positive integer, got {value!r}",
    )


@dataclass(frozen=True)
class LinearAttnConfig:
    """`linear_attn_config`: KDA heads and the KDA/MLA layer pattern (layer lists are 1-indexed)."""

    num_heads: int
    head_dim: int
    full_attn_layers: tuple[int, ...]
    kda_layers: tuple[int, ...]
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def validate(self, num_layers: int) -> None:
        p = "linear_attn_config."
        _positive_int(self.num_heads, p + "num_heads")
        _positive_int(self.head_dim, p + "head_dim")
        _positive_int(self.short_conv_kernel_size, p + "short_conv_kernel_size")
        if self.gate_lower_bound is not None:
            _check(
                -5.0 <= self.gate_lower_bound < 0,
                p + "gate_lower_bound",
                f"must be in [-5, 0) or null, got {self.gate_lower_bound!r}",
            )
        full, kda = set(self.full_attn_layers), set(self.kda_layers)
        _check(
            not (full & kda),
            p + "full_attn_layers",
            f"layers {sorted(full & kda)} are listed as both KDA and full attention",
        )
        _check(
            full | kda == set(range(1, num_layers + 1)),
            p + "kda_layers",
            f"kda_layers + full_attn_layers must cover layers 1..{num_layers} (1-indexed) exactly",
        )

    def to_hf(self) -> dict:
        d = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra":
                v = getattr(self, f.name)
                d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_hf(cls, d: dict) -> LinearAttnConfig:
        _check(isinstance(d, dict), "linear_attn_config", f"must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        for key in ("num_heads", "head_dim", "full_attn_layers", "kda_layers"):
            _check(key in d, f"linear_attn_config.{key}", "is required")
        kw = {k: v for k, v in d.items() if k in names}
        for key in ("full_attn_layers", "kda_layers"):
            _check(isinstance(kw[key], list | tuple), f"linear_attn_config.{key}", "must be a list")
            kw[key] = tuple(kw[key])
        return cls(**kw, extra={k: v for k, v in d.items() if k not in names})


@dataclass(frozen=True)
class K3Config:
    """The K3 text model. Field names are the official `text_config` keys (docs/spec.md#config)."""

    # trunk
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    linear_attn_config: LinearAttnConfig
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    hidden_act: str = "situ"  # the GLU: "situ" (SiTU-GLU, docs/spec.md#situ-glu) or "silu" (SwiGLU)
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: str = "bfloat16"
    use_cache: bool = True
    # MLA
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # AttnRes
    attn_res_block_size: int = 12
    # MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    num_nextn_predict_layers: int = 0
    quantization_config: dict | None = None
    model_type: str = "kimi_linear"
    # k3 extension keys (ablation switches, docs/spec_training.md; `k3 ablate`); written by to_hf() only
    # when they differ from these defaults, so an official config stays byte-for-byte official
    use_attn_res: bool = True  # Block AttnRes (docs/spec.md#attnres); False: plain pre-norm residual stream
    use_latent_moe: bool = True  # Stable LatentMoE (docs/spec.md#latentmoe); False: experts at full width
    # "quantile": Quantile Balancing (docs/spec_training.md#quantile-balancing); "sign": DeepSeek-V3's
    # aux-free sign update
    bias_update: str = "quantile"
    bias_update_rate: float = 1e-3  # step size of the sign update (Quantile Balancing ignores it)
    rope_theta: float = 10000.0  # RoPE base, used only when mla_use_nope is False (K2-style RoPE MLA)
    # eps of the q_a / kv_a latent norms; sources differ (docs/spec.md#choices): None follows vLLM
    # (rms_norm_eps)
    mla_latent_norm_eps: float | None = None
    # everything else from the file, kept verbatim
    extra: dict = field(default_factory=dict, compare=False, repr=False)
    wrapper: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Reject what no K3 engine can run, one named check per concern (the first failure raises)."""
        self._check_sizes()
        self._check_mla()
        self._check_moe()
        self._check_trunk()
        self._check_kda()
        self._check_mxfp4()

    def _check_sizes(self) -> None:
        """Widths, counts and lengths are positive integers (qk_rope_head_dim may be 0, q_lora_rank null)."""
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "num_experts",
            "num_experts_per_token",
            "moe_intermediate_size",
            "routed_expert_hidden_size",
            "intermediate_size",
            "moe_layer_freq",
            "max_position_embeddings",
        ):
            _positive_int(getattr(self, key), key)
        _check(
            isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0,
            "qk_rope_head_dim",
            f"must be a non-negative integer, got {self.qk_rope_head_dim!r}",
        )
        if self.q_lora_rank is not None:
            _positive_int(self.q_lora_rank, "q_lora_rank")

    def _check_mla(self) -> None:
        _check(
            self.num_key_value_heads == self.num_attention_heads,
            "num_key_value_heads",
            "MLA uses one latent shared by all heads; must equal num_attention_heads",
        )

    def _check_moe(self) -> None:
        """The GLU, the sigmoid router, top-k, shared experts, dense layers, the bias update, grouping."""
        _check(self.hidden_act in _ACTS, "hidden_act", f"must be one of {_ACTS}, got {self.hidden_act!r}")
        _check(
            self.moe_router_activation_func == "sigmoid",
            "moe_router_activation_func",
            f"only 'sigmoid' is supported, got {self.moe_router_activation_func!r}",
        )
        _check(
            self.num_experts_per_token <= self.num_experts,
            "num_experts_per_token",
            f"{self.num_experts_per_token} exceeds num_experts={self.num_experts}",
        )
        _check(
            isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0,
            "num_shared_experts",
            f"must be a non-negative integer, got {self.num_shared_experts!r}",
        )
        _check(
            isinstance(self.first_k_dense_replace, int)
            and 0 <= self.first_k_dense_replace <= self.num_hidden_layers,
            "first_k_dense_replace",
            "must be in [0, num_hidden_layers]",
        )
        _check(
            self.bias_update in _BIAS_UPDATES,
            "bias_update",
            f"must be one of {_BIAS_UPDATES}, got {self.bias_update!r}",
        )
        _check(
            self.num_expert_group == 1
            or not self.use_grouped_topk
            or self.num_experts % self.num_expert_group == 0,
            "num_expert_group",
            "must divide num_experts",
        )

    def _check_trunk(self) -> None:
        """AttnRes block size, the norm epsilon, embedding tying."""
        _check(
            isinstance(self.attn_res_block_size, int) and self.attn_res_block_size > 0,
            "attn_res_block_size",
            f"must be a positive integer, got {self.attn_res_block_size!r}",
        )
        _check(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps!r}")
        _check(
            self.tie_word_embeddings is False or isinstance(self.tie_word_embeddings, bool),
            "tie_word_embeddings",
            "must be a boolean",
        )

    def _check_kda(self) -> None:
        """The KDA layer pattern covers every layer once; KDA and MLA share one head count."""
        self.linear_attn_config.validate(self.num_hidden_layers)
        _check(
            self.linear_attn_config.num_heads == self.num_attention_heads,
            "linear_attn_config.num_heads",
            f"KDA heads ({self.linear_attn_config.num_heads}) must equal the MLA heads "
            f"(num_attention_heads={self.num_attention_heads}): K3 engines size both from one head count",
        )

    def _check_mxfp4(self) -> None:
        """MXFP4 experts need widths in whole 32-element blocks."""
        if not _is_mxfp4(self.quantization_config):
            return
        for key, width in (
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("routed_expert_hidden_size", self.expert_width),
        ):
            _check(width % MX_BLOCK == 0, key, f"MXFP4 experts need multiples of {MX_BLOCK}, got {width}")

    # ---- release format ------------------------------------------------------------------------
    def release_problems(self) -> list[str]:
        """What the released K3 format (and so llama.cpp's kimi-k3 and vLLM) cannot express, one line per
        departure, each naming its config key; empty for every K3 preset."""
        checks = (
            (self.mla_use_nope, "mla_use_nope", "RoPE MLA (K3's MLA is NoPE)"),
            (self.hidden_act == "situ", "hidden_act", f"{self.hidden_act!r} experts (K3 uses 'situ')"),
            (self.use_attn_res, "use_attn_res", "a plain residual stream (K3 uses Block AttnRes)"),
            (self.use_latent_moe, "use_latent_moe", "full-width experts (K3 uses LatentMoE)"),
            (self.moe_layer_freq == 1, "moe_layer_freq", "MoE on every k-th layer only (K3: every layer)"),
            (self.mla_use_output_gate, "mla_use_output_gate", "MLA without its output gate"),
            (
                self.linear_attn_config.use_full_rank_gate,
                "linear_attn_config.use_full_rank_gate",
                "a low-rank KDA output gate (K3's is full rank)",
            ),
            (self.num_nextn_predict_layers == 0, "num_nextn_predict_layers", "MTP layers"),
        )
        return [f"{key}: {what}" for ok, key, what in checks if not ok]

    def check_release(self, what: str = "export") -> None:
        """Raise ValueError naming every key that the release format cannot express."""
        problems = self.release_problems()
        if problems:
            raise ValueError(
                f"cannot {what} this config in the K3 release format (an ablation variant?): "
                + "; ".join(problems)
            )

    # ---- layer pattern -------------------------------------------------------------------------
    def is_kda_layer(self, i: int) -> bool:
        """0-indexed layer i is KDA iff (i+1) is in the 1-indexed `kda_layers` (docs/spec.md#config)."""
        return (i + 1) in self.linear_attn_config.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        """DeepSeek convention: MoE from `first_k_dense_replace` on, every `moe_layer_freq`-th layer."""
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_norm_eps(self) -> float:
        return self.rms_norm_eps if self.mla_latent_norm_eps is None else self.mla_latent_norm_eps

    @property
    def expert_width(self) -> int:
        """Width the routed experts work in: the latent width, or the model width for plain MoE."""
        return self.routed_expert_hidden_size if self.use_latent_moe else self.hidden_size

    def replace(self, **changes: Any) -> K3Config:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_layers(self, num_layers: int) -> K3Config:
        """A copy with `num_layers` layers in the preset pattern (3:1 KDA:MLA, the last layer MLA)."""
        _positive_int(num_layers, "num_hidden_layers")
        full, kda = layer_pattern(num_layers)
        la = dataclasses.replace(self.linear_attn_config, full_attn_layers=full, kda_layers=kda)
        return self.replace(num_hidden_layers=num_layers, linear_attn_config=la)

    # ---- HF JSON -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict) -> K3Config:
        """Build from an official config.json dict (multimodal wrapper or bare text_config)."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        wrapper = None
        if "text_config" in d:
            wrapper = {k: copy.deepcopy(v) for k, v in d.items() if k != "text_config"}
            d = d["text_config"]
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "wrapper"}
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "linear_attn_config"):
            _check(key in d, key, "is required")
        kw = {k: copy.deepcopy(v) for k, v in d.items() if k in names}
        kw["linear_attn_config"] = LinearAttnConfig.from_hf(d["linear_attn_config"])
        extra = {k: copy.deepcopy(v) for k, v in d.items() if k not in names}
        try:
            return cls(**kw, extra=extra, wrapper=wrapper)
        except TypeError as e:  # a wrong type that the dataclass itself rejects
            raise ValueError(f"bad config: {e}") from e

    def to_hf(self, text_only: bool = False) -> dict:
        """The config.json dict in the release layout (the wrapper around `text_config`, docs/spec.md#config);
        `text_only` gives the bare `text_config`."""
        defaults = {f.name: f.default for f in dataclasses.fields(K3Config)}
        ext = (
            "use_attn_res",
            "use_latent_moe",
            "bias_update",
            "bias_update_rate",
            "rope_theta",
            "mla_latent_norm_eps",
        )
        d = copy.deepcopy(self.extra)
        for f in dataclasses.fields(self):
            if f.name in ("extra", "wrapper"):
                continue
            v = getattr(self, f.name)
            if f.name in ext and v == defaults[f.name]:
                continue
            if f.name == "rope_theta" and self.mla_use_nope:
                continue
            if f.name == "quantization_config" and v is None:
                continue
            d[f.name] = v.to_hf() if f.name == "linear_attn_config" else copy.deepcopy(v)
        d.setdefault("architectures", [TEXT_ARCHITECTURE])
        d = dict(sorted(d.items()))
        if text_only:
            return d
        out = copy.deepcopy(self.wrapper) if self.wrapper is not None else self._default_wrapper()
        # the wrapper repeats these text keys; keep them equal to what the text model stores
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "dtype", "tie_word_embeddings"):
            out[key] = d.get(key)
        out["text_config"] = d
        return dict(sorted(out.items()))

    def _default_wrapper(self) -> dict:
        """The release's top-level keys for a config that was not loaded from a wrapped file."""
        return {
            "architectures": [WRAPPER_ARCHITECTURE],
            "model_type": WRAPPER_MODEL_TYPE,
            "ignore_index": -100,
            # <|media_pad|> (docs/spec_text.md#tokenizer)
            "media_placeholder_token_id": self.vocab_size - 256 + 21,
            "image_placeholder": IMAGE_PLACEHOLDER,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> K3Config:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ValueError(f"config file not found: {p}")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from e
        config = cls.from_hf(data)
        if isinstance(data, dict) and "text_config" not in data:
            warnings.warn(
                f"{p} is a bare text config (no {WRAPPER_ARCHITECTURE} wrapper around text_config); k3 "
                "reads it, but llama.cpp and vLLM need the release layout: rewrite it with "
                f"`k3 export {p.parent} --format hf --out DIR`",
                BareConfigWarning,
                stacklevel=2,
            )
        return config


class BareConfigWarning(UserWarning):
    """A config.json in the pre-release bare layout (text config only) was loaded."""


# ---- presets -------------------------------------------------------------------------------------
def layer_pattern(num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(full_attn_layers, kda_layers), 1-based: 3:1 KDA:MLA, every 4th layer MLA, and the last layer
    always MLA (as in the release)."""
    full = [i for i in range(4, num_layers + 1, 4)]
    if num_layers not in full:
        full.append(num_layers)
    kda = tuple(i for i in range(1, num_layers + 1) if i not in full)
    return tuple(full), kda


def preset(name: str) -> K3Config:
    """A named configuration, read from `k3/presets/NAME.json` (package data):

    k3-nano   < 2M parameters: unit tests (1024 ids leave room for 512 BPE merges)
    k3-mini   ~4.5M: what 10 minutes on 2 CPU cores train best (docs/training.md)
    k3-tiny   ~30M: a bigger CPU model
    k3-small  ~0.5B: a GPU user's first run; MLA at the release's head dims (vLLM's K3 kernels need them)
    k3-full   the release (its config.json verbatim, with the multimodal wrapper)

    The small presets are bare `text_config` files in the preset layer pattern (`layer_pattern`), with the
    256 reserved ids at the top of the vocab as in the release (docs/spec_text.md#tokenizer)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or a config.json path")
    return K3Config.from_hf(json.loads((PRESET_DIR / f"{name}.json").read_text()))


def load_config(name_or_path: str) -> K3Config:
    """A preset name, a config.json file, or a checkpoint directory holding config.json."""
    if name_or_path in PRESETS:
        return preset(name_or_path)
    p = Path(name_or_path)
    if p.exists():
        return K3Config.load(p)
    raise ValueError(f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor an existing path")
