"""Vision configs: the official vision_config round-trips and gives docs/spec.md#parameter-counts's parameter
counts."""

import json
from pathlib import Path

import pytest
import torch

from k3.model.vision import MoonViT, PatchMergerProjector
from k3.vision.config import K3VLConfig, MediaProcConfig, VisionConfig, vision_preset, vl_preset

OFFICIAL = Path(__file__).resolve().parents[2] / "k3" / "presets" / "k3-full.json"


def _official() -> dict:
    return json.loads(OFFICIAL.read_text())


def test_official_vision_config_round_trips():
    d = _official()["vision_config"]
    cfg = VisionConfig.from_hf(d)
    assert cfg.to_hf() == dict(sorted(d.items()))
    assert cfg == vision_preset("moonvit-v2")
    assert cfg.head_dim == 128 and cfg.merge_unit == 28


def test_official_parameter_counts_on_meta():
    cfg = VisionConfig.from_hf(_official())
    with torch.device("meta"):
        tower, proj = MoonViT(cfg), PatchMergerProjector(cfg)
    assert sum(t.numel() for t in tower.state_dict().values()) == 401_214_464
    assert sum(t.numel() for t in proj.state_dict().values()) == 46_144_512
    shapes = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
    assert shapes["patch_embed.proj.weight"] == (1024, 3, 14, 14)
    assert shapes["patch_embed.pos_emb.weight"] == (64, 64, 1024)
    assert shapes["encoder.blocks.26.wqkv.weight"] == (4608, 1024)
    assert shapes["encoder.blocks.26.wo.weight"] == (1024, 1536)
    assert shapes["encoder.blocks.0.mlp.fc0.weight"] == (4096, 1024)
    assert shapes["encoder.final_layernorm.weight"] == (1024,)
    pshapes = {k: tuple(v.shape) for k, v in proj.state_dict().items()}
    assert pshapes == {
        "proj.0.weight": (4096, 4096),
        "proj.2.weight": (7168, 4096),
        "post_norm.weight": (7168,),
    }


def test_full_vl_config_and_pad_id():
    vl = vl_preset("k3-full-vl")
    assert vl.media_pad_id == 163605
    assert vl.to_hf()["vision_config"] == dict(sorted(_official()["vision_config"].items()))


@pytest.mark.parametrize(
    "key,value",
    [("norm_type", "layernorm"), ("merge_kernel_size", [3, 3]), ("attn_bias", True), ("vt_hidden_size", 0)],
)
def test_unsupported_values_raise_naming_the_key(key, value):
    d = _official()["vision_config"] | {key: value}
    with pytest.raises(ValueError, match=key):
        VisionConfig.from_hf(d)


def test_text_width_must_match():
    vl = vl_preset("k3-tiny-vl")
    with pytest.raises(ValueError, match="text_hidden_size"):
        K3VLConfig(vl.text, vl.vision.replace(text_hidden_size=vl.text.hidden_size + 1), vl.media)


def test_media_proc_cfg_round_trip_and_checks():
    d = {"media_proc_cfg": {"in_patch_limit": 4096, "patch_limit_on_one_side": 64, "image_mean": [0.5] * 3}}
    m = MediaProcConfig.from_hf(d)
    assert m.in_patch_limit == 4096 and MediaProcConfig.from_hf(m.to_hf()) == m
    with pytest.raises(ValueError, match="in_patch_limit"):
        MediaProcConfig(in_patch_limit=3)
