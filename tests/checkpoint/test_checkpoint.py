"""Checkpoint format: official <-> in-memory adapter, safetensors save/load, sharding, atomicity, errors."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3.checkpoint import adapter, io
from k3.checkpoint.adapter import from_official, pad_a_log, split_multimodal, to_official, unpad_a_log
from k3.checkpoint.io import load_checkpoint, load_official_tensors, load_state_dict_from_dir, save_checkpoint
from k3.config import preset
from k3.params import expected_shapes

NANO = preset("k3-nano")


def fake_state_dict(config, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random tensors with our in-memory names/shapes: the release's F32 tensors in fp32, the rest bf16."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        dtype = torch.float32 if adapter.is_f32_tensor(name) else torch.bfloat16
        if device == "meta":
            out[name] = torch.empty(shape, dtype=dtype, device="meta")
        else:
            out[name] = torch.randn(shape, generator=g).to(dtype)
    return out


def assert_same(a: dict, b: dict) -> None:
    assert list(sorted(a)) == list(sorted(b))
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name  # bit-exact (no NaNs in these tensors)


def nano_model(seed: int = 0):
    from k3.model.init import init_weights
    from k3.model.transformer import K3ForCausalLM

    model = K3ForCausalLM(NANO)
    init_weights(model, NANO.initializer_range, NANO.num_hidden_layers, seed=seed)
    with torch.no_grad():  # non-trivial values everywhere, incl. the zero-initialized queries and bias
        for p in model.state_dict().values():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).to(p.dtype) * 0.01)
    return model


# ---- adapter ------------------------------------------------------------------------------------------
def test_adapter_round_trip_identity():
    sd = fake_state_dict(NANO)
    official = to_official(sd, NANO)
    assert_same(from_official(official, NANO), sd)


def test_official_names_and_shapes():
    c, sd = NANO, fake_state_dict(NANO)
    off = to_official(sd, c)
    E, I, Dl = c.num_experts, c.moe_intermediate_size, c.routed_expert_hidden_size
    assert all(n.startswith("language_model.model.") or n == "language_model.lm_head.weight" for n in off)
    assert not any(n.endswith(("experts.w1", "experts.w2", "experts.w3")) for n in off)
    p = "language_model.model.layers.1.block_sparse_moe.experts."
    assert off[p + "0.w1.weight"].shape == (I, Dl) and off[p + f"{E - 1}.w3.weight"].shape == (I, Dl)
    assert off[p + "3.w2.weight"].shape == (Dl, I)
    assert torch.equal(off[p + "5.w2.weight"], sd["model.layers.1.block_sparse_moe.experts.w2"][5])
    assert off["language_model.model.layers.0.self_attn.A_log"].shape == (128,)  # 2 heads padded to 128
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    assert len(off) == len(sd) - 3 * n_moe + 3 * E * n_moe


def test_full_release_tensor_count_on_meta():
    """docs/spec.md#tensors: 497,220 tensors = text tensors with MXFP4 experts (packed + scale) + 168 vision
    tensors."""
    c = preset("k3-full")
    off = to_official(fake_state_dict(c, device="meta"), c)
    experts = [n for n in off if ".experts." in n]
    assert len(experts) == 92 * 896 * 3
    assert len(off) - len(experts) + 2 * len(experts) + 168 == 497_220
    assert off["language_model.model.layers.0.self_attn.A_log"].shape == (128,)
    assert off["language_model.model.layers.0.self_attn.q_conv1d.weight"].shape == (12288, 1, 4)
    assert off["language_model.model.layers.92.block_sparse_moe.experts.895.w2.weight"].shape == (3584, 3072)
    assert off["language_model.model.layers.91.self_attn.kv_b_proj.weight"].shape == (24576, 512)


def test_a_log_padding_rules():
    a = torch.randn(96)
    padded = pad_a_log(a, 96)
    assert padded.shape == (128,) and torch.equal(padded[:96], a) and not padded[96:].any()
    assert pad_a_log(torch.randn(128), 128).shape == (128,)
    assert pad_a_log(torch.randn(130), 130).shape == (256,)
    with pytest.raises(ValueError, match="A_log"):
        pad_a_log(torch.randn(128), 96)
    for stored in (a, padded, a.reshape(1, 1, 96, 1)):
        assert torch.equal(unpad_a_log(stored, 96), a)
    padded[100] = 3.0  # non-zero padding is dropped, not an error
    assert torch.equal(unpad_a_log(padded, 96), a)
    assert unpad_a_log(torch.randn(100), 96).shape == (100,)  # unknown shape: left for the loader to report


def test_from_official_accepts_legacy_a_log_and_vllm_prefix():
    sd = fake_state_dict(NANO)
    off = to_official(sd, NANO)
    renamed = {}
    for name, t in off.items():
        if name.endswith("layers.0.self_attn.A_log"):
            t = t[:2].reshape(1, 1, 2, 1)
        renamed[name.replace("language_model.model.layers.", "language_model.layers.")] = t
    assert_same(from_official(renamed, NANO), sd)


def test_from_official_accepts_bare_kimi_linear_names():
    sd = fake_state_dict(NANO)
    bare = {n.removeprefix("language_model."): t for n, t in to_official(sd, NANO).items()}
    assert_same(from_official(bare, NANO), sd)


def test_multimodal_tensors_are_kept_aside():
    sd = fake_state_dict(NANO)
    vision = {
        "vision_tower.patch_embed.proj.weight": torch.randn(8, 3, 14, 14),
        "mm_projector.proj.0.weight": torch.randn(4, 4),
    }
    off = to_official(sd | vision, NANO)
    for n in vision:
        assert off[n] is vision[n]
    text, mm = split_multimodal(off)
    assert set(mm) == set(vision) and not set(text) & set(vision)
    assert_same(from_official(off, NANO), sd)


def test_missing_expert_is_named():
    off = to_official(fake_state_dict(NANO), NANO)
    del off["language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(ValueError, match=r"layers\.2\.block_sparse_moe\.experts\.w3.*missing \[5\]"):
        from_official(off, NANO)


def _packed_official(sd, config):
    """The release layout: routed experts as MXFP4 weight_packed / weight_scale (uint8)."""
    from k3.ops.mx import quantize_mx

    out = {}
    for name, t in to_official(sd, config).items():
        if ".experts." in name:
            packed, scale = quantize_mx(t.float(), "mxfp4")
            out[name.replace(".weight", ".weight_packed")] = packed
            out[name.replace(".weight", ".weight_scale")] = scale
        else:
            out[name] = t
    return out


def test_mxfp4_experts_are_dequantized_on_load():
    import k3.ops.mx as mx

    sd = fake_state_dict(NANO)
    off = _packed_official(sd, NANO)
    packed = off["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    assert packed.dtype == torch.uint8
    loaded = from_official(off, NANO)
    name = "model.layers.1.block_sparse_moe.experts.w2"
    assert loaded[name].dtype == torch.bfloat16 and loaded[name].shape == sd[name].shape
    expect = mx.fake_quant_mx(sd[name].float(), "mxfp4")  # dequantize(quantize(w)), exact in bf16
    assert torch.equal(loaded[name].float(), expect)
    rel = (loaded[name].float() - sd[name].float()).norm() / sd[name].float().norm()
    assert 0 < rel < 0.2  # really 4-bit, really close
    del off["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"]
    with pytest.raises(ValueError, match=r"experts\.0\.w1: packed MXFP4 expert lacks weight_scale"):
        from_official(off, NANO)


def test_tied_embeddings_store_one_matrix():
    c = NANO.replace(tie_word_embeddings=True)
    sd = fake_state_dict(c)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    off = to_official(sd, c)
    assert "language_model.lm_head.weight" not in off
    back = from_official(off, c)
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]


# ---- save / load --------------------------------------------------------------------------------------
def test_save_load_round_trip_unsharded(tmp_path):
    sd = fake_state_dict(NANO)
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].float()  # a mix
    out = save_checkpoint(sd, NANO, tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    # the release layout, saying what is stored: BF16 for all but the one FP32 matrix and the F32 tensors
    written = json.loads((out / "config.json").read_text())
    assert written == NANO.replace(dtype="bfloat16").to_hf()
    assert written["architectures"] == ["KimiK3ForConditionalGeneration"] and written["dtype"] == "bfloat16"
    assert written["text_config"]["model_type"] == "kimi_linear"
    assert_same(load_state_dict_from_dir(out), sd)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(to_official(sd, NANO))
        assert f.metadata()["format"] == "pt" and "k3_version" in f.metadata()


def test_save_load_round_trip_sharded(tmp_path):
    sd = fake_state_dict(NANO)
    out = save_checkpoint(sd, NANO, tmp_path / "ckpt", max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    official = to_official(sd, NANO)
    assert set(index["weight_map"]) == set(official)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in official.values())
    for file in files:
        with safe_open(str(out / file), "pt") as f:
            assert {n for n, v in index["weight_map"].items() if v == file} == set(f.keys())
            assert sum(f.get_tensor(k).nbytes for k in f.keys()) <= 100_000 or len(list(f.keys())) == 1
    assert_same(load_state_dict_from_dir(out), sd)


def test_save_with_dtype_keeps_f32_tensors(tmp_path):
    sd = {n: t.float() for n, t in fake_state_dict(NANO).items()}
    out = save_checkpoint(sd, NANO, tmp_path / "ckpt", dtype=torch.bfloat16)
    tensors = load_official_tensors(out)
    f32 = {n for n, t in tensors.items() if t.dtype == torch.float32}
    assert f32 == {
        n
        for n in tensors
        if n.endswith(("conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias"))
    }
    assert len(f32) == 3 * 6 + 3  # 3 KDA layers x (3 convs, A_log, dt_bias, o_norm) + 3 MoE biases
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in f32)


def test_model_round_trip_bit_exact(tmp_path):
    model = nano_model()
    model.model.layers[1].block_sparse_moe.to(torch.bfloat16)  # a bf16 / fp32 mix
    out = save_checkpoint(model, NANO, tmp_path / "ckpt", max_shard_bytes=200_000)
    loaded, config = load_checkpoint(out)
    assert config == NANO
    assert_same(loaded.state_dict(), model.state_dict())
    assert not any(t.is_meta for t in loaded.state_dict().values())
    ids = torch.randint(0, NANO.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loaded.model.layers[1].block_sparse_moe.float()
        model.model.layers[1].block_sparse_moe.float()
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    target = nano_model(seed=1)  # loading into a given model copies into its parameters
    same, _ = load_checkpoint(out, model=target)
    assert same is target
    assert torch.equal(target.lm_head.weight, model.lm_head.weight)


def test_never_unpickles(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("torch.load / pickle must not be used")

    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(torch.serialization, "load", boom)
    monkeypatch.setattr("pickle.load", boom)
    monkeypatch.setattr("pickle.loads", boom)
    sd = fake_state_dict(NANO)
    out = save_checkpoint(sd, NANO, tmp_path / "ckpt", max_shard_bytes=100_000)
    assert_same(load_state_dict_from_dir(out), sd)
    load_checkpoint(out)


def test_mismatch_errors_name_the_tensors(tmp_path):
    sd = fake_state_dict(NANO)
    del sd["model.layers.2.mlp_res_norm.weight"]
    sd["model.layers.0.extra.weight"] = torch.zeros(3)
    sd["model.norm.weight"] = torch.ones(65)
    sd["model.layers.0.self_attn.A_log"] = torch.zeros(2)  # A_log stays valid
    out = save_checkpoint(sd, NANO, tmp_path / "ckpt")
    with pytest.raises(ValueError) as err:
        load_checkpoint(out)
    msg = str(err.value)
    assert "missing 1: [model.layers.2.mlp_res_norm.weight]" in msg
    assert "unexpected 1: [model.layers.0.extra.weight]" in msg
    assert "wrong shape 1: [model.norm.weight (checkpoint [65], model [64])]" in msg
    assert str(out) in msg
    with pytest.raises(ValueError, match="wrong shape") as err:  # shapes are checked even when not strict
        load_checkpoint(out, strict=False)
    assert "missing" not in str(err.value)


def test_long_mismatch_lists_are_truncated(tmp_path):
    sd = {n: t for n, t in fake_state_dict(NANO).items() if not n.startswith("model.layers.1.")}
    with pytest.raises(ValueError, match=r"missing \d+: \[model\..*, \.\.\. and \d+ more\]"):
        load_checkpoint(save_checkpoint(sd, NANO, tmp_path / "ckpt"))


def test_non_strict_load_allows_missing(tmp_path):
    model = nano_model()
    sd = dict(model.state_dict())
    sd.pop("model.layers.3.self_attn.o_proj.weight")
    loaded, _ = load_checkpoint(save_checkpoint(sd, NANO, tmp_path / "ckpt"), strict=False)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not any(t.is_meta for t in loaded.state_dict().values())
    absent = loaded.model.layers[3].self_attn.o_proj.weight  # keeps the model's own init
    assert torch.isfinite(absent).all() and 0 < absent.std() < 0.02


def test_missing_files_and_corrupt_shard(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json in checkpoint directory .*empty"):
        load_checkpoint(tmp_path / "empty")
    NANO.save(tmp_path / "empty" / "config.json")
    with pytest.raises(ValueError, match=r"no safetensors file .*empty"):
        load_checkpoint(tmp_path / "empty")
    out = save_checkpoint(fake_state_dict(NANO), NANO, tmp_path / "ckpt", max_shard_bytes=100_000)
    shard = sorted(out.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"cannot read safetensors file .*{shard.name}"):
        load_checkpoint(out)
    shard.unlink()
    with pytest.raises(ValueError, match="names missing shard files"):
        load_checkpoint(out)


def test_atomic_save_failure_leaves_existing_checkpoint_intact(tmp_path, monkeypatch):
    sd = fake_state_dict(NANO)
    out = save_checkpoint(sd, NANO, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(io, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(fake_state_dict(NANO, seed=1), NANO, out, max_shard_bytes=100_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary or half-written directory left
    calls.clear()
    with pytest.raises(OSError):
        save_checkpoint(sd, NANO, tmp_path / "fresh", max_shard_bytes=100_000)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_save_replaces_existing_checkpoint(tmp_path):
    out = save_checkpoint(fake_state_dict(NANO), NANO, tmp_path / "ckpt", max_shard_bytes=100_000)
    sd = fake_state_dict(NANO, seed=3)
    save_checkpoint(sd, NANO, out, extra_files={"tokenizer.json": "{}", "notes.bin": b"\x00\x01"})
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "notes.bin",
        "tokenizer.json",
    ]  # no stale shards or index
    assert (out / "notes.bin").read_bytes() == b"\x00\x01"
    assert_same(load_state_dict_from_dir(out), sd)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_save_refuses_to_replace_other_directories(tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("do not delete")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        save_checkpoint(fake_state_dict(NANO), NANO, precious)
    assert (precious / "thesis.tex").read_text() == "do not delete"
    with pytest.raises(ValueError, match="extra_files"):
        save_checkpoint(fake_state_dict(NANO), NANO, tmp_path / "c", extra_files={"../x": "y"})
    with pytest.raises(ValueError, match="meta device"):
        save_checkpoint(fake_state_dict(NANO, device="meta"), NANO, tmp_path / "c")
    assert not Path(tmp_path / "c").exists()


def test_bare_text_config_loads_with_a_warning_naming_the_difference(tmp_path):
    from k3.config import BareConfigWarning, K3Config

    out = save_checkpoint(fake_state_dict(NANO), NANO, tmp_path / "ckpt")
    (out / "config.json").write_text(json.dumps(NANO.to_hf(text_only=True)))  # the pre-release layout
    with pytest.warns(BareConfigWarning, match="KimiK3ForConditionalGeneration"):
        model, config = load_checkpoint(out)
    assert config == NANO and sum(p.numel() for p in model.parameters()) > 0
    with pytest.warns(BareConfigWarning):
        assert K3Config.load(out).to_hf()["architectures"] == ["KimiK3ForConditionalGeneration"]
