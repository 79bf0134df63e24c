"""Vision configuration: `VisionConfig` (the official `vision_config` keys), `MediaProcConfig` (the image
pre-processor, `media_proc_cfg`), `K3VLConfig` (text + vision) and the vision presets.

Field names are the release's keys (docs/spec.md#config `vision_config`, `preprocessor_config.json`), so
`VisionConfig.from_hf(d).to_hf() == d` for the official dict (unknown keys are kept in `extra`).
Only the values the release uses are accepted for the structural switches (`norm_type "rmsnorm"`,
`mlp_type "mlp2"`, `merge_type "sd2_tpool"`, `mm_projector_type "patchmergerv2"`, no biases); anything
else raises ValueError naming the key.

Presets: `vision_preset("moonvit-v2")` is the release tower (0.40 B, docs/spec.md#parameter-counts),
`"moonvit-tiny"` a ~0.18 M tower for CPU tests and the demo. `vl_preset("k3-tiny-vl")` pairs the tiny tower
with the k3-nano text model (vocabulary widened to 1024 ids), `"k3-tiny-vl-t"` with k3-tiny, `"k3-full-vl"` is
the release. This module imports only the stdlib and `k3.config`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from k3.config import IMAGE_PLACEHOLDER, K3Config, load_config

VISION_PRESETS = ("moonvit-v2", "moonvit-tiny")
VL_PRESETS = ("k3-full-vl", "k3-tiny-vl", "k3-tiny-vl-t")
PAD_OFFSET = 21  # <|media_pad|> = reserved base + 21 (163605 in the release, docs/spec_text.md#tokenizer)

# key -> the only value we implement (docs/spec_vision.md)
_FIXED = {
    "norm_type": "rmsnorm",
    "mlp_type": "mlp2",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "pos_emb_type": "divided_fixed",
    "pos_emb_interpolation_mode": "bilinear",
    "activation_func": "gelu_pytorch_tanh",
    "projector_hidden_act": "gelu",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
}


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"vision config key '{key}': {msg}")


def _positive(value: Any, key: str) -> None:
    _check(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        key,
        f"must be a positive integer, got {value!r}",
    )


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT-V2 tower + patch-merger projector. Defaults are the release values (docs/spec.md#config)."""

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536
    norm_type: str = "rmsnorm"
    mlp_type: str = "mlp2"
    activation_func: str = "gelu_pytorch_tanh"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    merge_kernel_size: tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    _attn_implementation: str = "flash_attention_2"
    # k3 extension keys (written by to_hf only when set): RoPE base and vision RMSNorm eps
    # (docs/spec.md#choices: None = the compute dtype's machine epsilon, as the ports do)
    rope_theta: float = 10000.0
    vt_norm_eps: float | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in (
            "patch_size",
            "init_pos_emb_height",
            "init_pos_emb_width",
            "init_pos_emb_time",
            "vt_num_hidden_layers",
            "vt_hidden_size",
            "vt_intermediate_size",
            "vt_num_attention_heads",
            "qkv_hidden_size",
            "mm_hidden_size",
            "text_hidden_size",
        ):
            _positive(getattr(self, key), key)
        for key, want in _FIXED.items():
            _check(getattr(self, key) == want, key, f"only {want!r} is supported, got {getattr(self, key)!r}")
        _check(
            tuple(self.merge_kernel_size) == (2, 2),
            "merge_kernel_size",
            f"only [2, 2] is supported, got {list(self.merge_kernel_size)}",
        )
        _check(
            self.qkv_hidden_size % self.vt_num_attention_heads == 0,
            "qkv_hidden_size",
            f"{self.qkv_hidden_size} not divisible by vt_num_attention_heads={self.vt_num_attention_heads}",
        )
        _check(
            self.head_dim % 4 == 0,
            "qkv_hidden_size",
            f"head dim {self.head_dim} must be a multiple of 4 (2-D RoPE: x and y pairs)",
        )
        _check(
            self.mm_hidden_size == self.vt_hidden_size,
            "mm_hidden_size",
            f"must equal vt_hidden_size={self.vt_hidden_size}, got {self.mm_hidden_size}",
        )
        _check(self.projector_ln_eps > 0, "projector_ln_eps", f"must be > 0, got {self.projector_ln_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_unit(self) -> int:
        """Pixels per side of one LLM token: patch_size * merge (28 in the release)."""
        return self.patch_size * self.merge_kernel_size[0]

    def replace(self, **changes: Any) -> VisionConfig:
        return dataclasses.replace(self, **changes)

    def with_width(self, width: int) -> VisionConfig:
        """A copy `width` wide (hidden, qkv and merger width; MLP 3x; same heads): tower-size ablations."""
        _positive(width, "vt_hidden_size")
        return self.replace(
            vt_hidden_size=width, vt_intermediate_size=3 * width, qkv_hidden_size=width, mm_hidden_size=width
        )

    def to_hf(self) -> dict:
        d = copy.deepcopy(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            if f.name in ("rope_theta", "vt_norm_eps") and v == f.default:
                continue
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return dict(sorted(d.items()))

    @classmethod
    def from_hf(cls, d: dict) -> VisionConfig:
        """From the `vision_config` dict, or a whole multimodal config.json holding one."""
        _check(isinstance(d, dict), "vision_config", f"must be an object, got {type(d).__name__}")
        if "vision_config" in d:
            d = d["vision_config"]
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kw = {k: copy.deepcopy(v) for k, v in d.items() if k in names}
        if "merge_kernel_size" in kw:
            _check(isinstance(kw["merge_kernel_size"], list | tuple), "merge_kernel_size", "must be a list")
            kw["merge_kernel_size"] = tuple(kw["merge_kernel_size"])
        try:
            return cls(**kw, extra={k: copy.deepcopy(v) for k, v in d.items() if k not in names})
        except TypeError as e:
            raise ValueError(f"bad vision_config: {e}") from e


@dataclass(frozen=True)
class MediaProcConfig:
    """Image pre-processing (`media_proc_cfg`, docs/spec.md#config, docs/spec_vision.md#preprocessing).
    Release values by default."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    in_patch_limit_each_frame: int = 16384
    sample_fps: float = 8.0
    temporal_merge_kernel_size: int = 4
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
            _positive(getattr(self, key), key)
        m = self.merge_kernel_size
        _check(
            self.in_patch_limit >= m * m,
            "in_patch_limit",
            f"must allow at least one {m}x{m} merge unit, got {self.in_patch_limit}",
        )
        _check(
            self.patch_limit_on_one_side >= m,
            "patch_limit_on_one_side",
            f"must be >= merge_kernel_size={m}, got {self.patch_limit_on_one_side}",
        )
        _check(self.fixed_output_tokens is None, "fixed_output_tokens", "only null is supported")
        for key in ("image_mean", "image_std"):
            _check(len(getattr(self, key)) == 3, key, "must hold 3 values (RGB)")
        _check(all(s > 0 for s in self.image_std), "image_std", "values must be > 0")

    def replace(self, **changes: Any) -> MediaProcConfig:
        return dataclasses.replace(self, **changes)

    def to_hf(self) -> dict:
        d = copy.deepcopy(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra":
                v = getattr(self, f.name)
                d[f.name] = list(v) if isinstance(v, tuple) else v
        return dict(sorted(d.items()))

    @classmethod
    def from_hf(cls, d: dict) -> MediaProcConfig:
        """From `media_proc_cfg`, or a preprocessor_config.json dict holding one."""
        _check(isinstance(d, dict), "media_proc_cfg", f"must be an object, got {type(d).__name__}")
        if "media_proc_cfg" in d:
            d = d["media_proc_cfg"]
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kw = {k: copy.deepcopy(v) for k, v in d.items() if k in names}
        for key in ("image_mean", "image_std"):
            if key in kw:
                kw[key] = tuple(kw[key])
        try:
            return cls(**kw, extra={k: copy.deepcopy(v) for k, v in d.items() if k not in names})
        except TypeError as e:
            raise ValueError(f"bad media_proc_cfg: {e}") from e


@dataclass(frozen=True)
class K3VLConfig:
    """A K3 vision-language model: text model + vision tower/projector + image pre-processing."""

    text: K3Config
    vision: VisionConfig
    media: MediaProcConfig = MediaProcConfig()

    def __post_init__(self) -> None:
        _check(
            self.vision.text_hidden_size == self.text.hidden_size,
            "text_hidden_size",
            f"{self.vision.text_hidden_size} != text_config.hidden_size={self.text.hidden_size}",
        )
        _check(
            self.media.patch_size == self.vision.patch_size,
            "patch_size",
            f"media_proc_cfg.patch_size={self.media.patch_size} != vision_config.patch_size",
        )
        _check(
            self.media.merge_kernel_size == self.vision.merge_kernel_size[0],
            "merge_kernel_size",
            "media_proc_cfg and vision_config disagree",
        )

    @property
    def media_pad_id(self) -> int:
        """`media_placeholder_token_id`: <|media_pad|> (163605 in the release)."""
        wrapper = self.text.wrapper or {}
        return wrapper.get("media_placeholder_token_id", self.text.vocab_size - 256 + PAD_OFFSET)

    @classmethod
    def from_hf(cls, d: dict, media: dict | None = None) -> K3VLConfig:
        """From a multimodal config.json dict (and optionally the preprocessor's `media_proc_cfg`)."""
        _check(isinstance(d, dict) and "vision_config" in d, "vision_config", "is required")
        return cls(
            K3Config.from_hf(d),
            VisionConfig.from_hf(d["vision_config"]),
            MediaProcConfig.from_hf(media) if media is not None else MediaProcConfig(),
        )

    def to_hf(self) -> dict:
        """The multimodal config.json dict (the text config wrapped, `vision_config` from `self.vision`)."""
        out = self.text.to_hf()  # the release wrapper around text_config
        out["vision_config"] = self.vision.to_hf()
        out.setdefault("media_placeholder_token_id", self.media_pad_id)
        out.setdefault("image_placeholder", IMAGE_PLACEHOLDER)
        return dict(sorted(out.items()))


def vision_preset(name: str, text_hidden_size: int | None = None) -> VisionConfig:
    """`moonvit-v2` (the release, docs/spec.md#config) or `moonvit-tiny` (CPU tests and demo)."""
    if name == "moonvit-v2":
        cfg = VisionConfig()
    elif name == "moonvit-tiny":
        cfg = VisionConfig(
            init_pos_emb_height=16,
            init_pos_emb_width=16,
            vt_num_hidden_layers=3,
            vt_hidden_size=64,
            vt_intermediate_size=192,
            vt_num_attention_heads=2,
            qkv_hidden_size=64,
            mm_hidden_size=64,
            text_hidden_size=64,
            _attn_implementation="sdpa",
        )
    else:
        raise ValueError(f"unknown vision preset {name!r}; choose one of {', '.join(VISION_PRESETS)}")
    return cfg if text_hidden_size is None else cfg.replace(text_hidden_size=text_hidden_size)


def vl_preset(name: str) -> K3VLConfig:
    """`k3-full-vl` (the release), `k3-tiny-vl` (tiny tower + k3-nano) or `k3-tiny-vl-t` (+ k3-tiny)."""
    if name == "k3-full-vl":
        text = load_config("k3-full")
        vision = VisionConfig.from_hf(text.wrapper["vision_config"])
        return K3VLConfig(text, vision)
    if name in ("k3-tiny-vl", "k3-tiny-vl-t"):
        text = load_config("k3-nano" if name == "k3-tiny-vl" else "k3-tiny")
        if name == "k3-tiny-vl":  # 1024 ids: room for BPE merges of the chat markup (shorter sequences)
            text = text.replace(vocab_size=1024, bos_token_id=768, eos_token_id=770, pad_token_id=1023)
        media = MediaProcConfig(in_patch_limit=1024, patch_limit_on_one_side=48)
        return K3VLConfig(text, vision_preset("moonvit-tiny", text.hidden_size), media)
    raise ValueError(f"unknown VL preset {name!r}; choose one of {', '.join(VL_PRESETS)}")
