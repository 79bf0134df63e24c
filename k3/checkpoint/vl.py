"""Save / load a K3 vision-language checkpoint in the official layout (docs/spec.md#tensors):
`language_model.*`, `vision_tower.*`, `mm_projector.*` tensors, a multimodal config.json (`text_config` +
`vision_config`), `preprocessor_config.json` (`media_proc_cfg`) and the tokenizer files beside them.

The text part goes through `k3.checkpoint` (to_official / from_official); the vision tensors are written
and read unchanged (their in-memory names are the official ones).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from k3.checkpoint.adapter import PREFIX, from_official, split_multimodal
from k3.checkpoint.io import load_official_tensors, save_checkpoint
from k3.model.multimodal import K3VLForCausalLM
from k3.vision.config import IMAGE_PLACEHOLDER, K3VLConfig

PREPROCESSOR_NAME = "preprocessor_config.json"


def _wrapped_text_config(config: K3VLConfig):
    wrapper = {k: v for k, v in config.text.to_hf().items() if k != "text_config"}
    wrapper["vision_config"] = config.vision.to_hf()
    wrapper.setdefault("media_placeholder_token_id", config.media_pad_id)
    wrapper.setdefault("image_placeholder", IMAGE_PLACEHOLDER)
    return config.text.replace(wrapper=wrapper)


def save_vl_checkpoint(model: K3VLForCausalLM, out_dir: str | Path, tokenizer=None) -> Path:
    """Write `model` (+ its tokenizer) to `out_dir` atomically; returns the directory."""
    state = {}
    for name, t in model.state_dict().items():
        state[name[len(PREFIX) :] if name.startswith(PREFIX) else name] = t
    media = json.dumps({"media_proc_cfg": model.config.media.to_hf()}, indent=2, sort_keys=True) + "\n"
    out = save_checkpoint(
        state, _wrapped_text_config(model.config), out_dir, extra_files={PREPROCESSOR_NAME: media}
    )
    if tokenizer is not None:
        tokenizer.save(out)
    return out


def load_vl_config(ckpt_dir: str | Path) -> K3VLConfig:
    d = Path(ckpt_dir)
    cfg = json.loads((d / "config.json").read_text())
    pre = d / PREPROCESSOR_NAME
    media = json.loads(pre.read_text()) if pre.exists() else None
    return K3VLConfig.from_hf(cfg, media)


def load_vl_checkpoint(ckpt_dir: str | Path, device: str | torch.device = "cpu") -> K3VLForCausalLM:
    """Build K3VLForCausalLM from `ckpt_dir` and load every tensor (strict)."""
    config = load_vl_config(ckpt_dir)
    tensors = load_official_tensors(ckpt_dir, device=device)
    text, mm = split_multimodal(tensors)
    state = {PREFIX + k: v for k, v in from_official(text, config.text).items()} | mm
    model = K3VLForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{ckpt_dir}: missing tensors {missing[:10]}, unexpected {unexpected[:10]}")
    return model.to(device)
