"""MXFP4 expert checkpoints: release layout and quantization_config, bit-exact reload, `k3 quantize`."""

import json

import pytest
import torch

from k3.checkpoint.adapter import to_official
from k3.checkpoint.io import load_checkpoint, load_official_tensors, save_checkpoint
from k3.cli import main
from k3.config import K3Config, preset
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM
from k3.ops.mx import FP4_E2M1_VALUES, fake_quant_mx
from k3.quant.checkpoint import (
    export_mxfp4,
    import_mxfp4,
    load_mxfp4_checkpoint,
    mxfp4_quantization_config,
    save_mxfp4_checkpoint,
    with_mxfp4_config,
)

NANO = preset("k3-nano")
E, I, Dl = NANO.num_experts, NANO.moe_intermediate_size, NANO.expert_width
EXPERT = "language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{w}"


@pytest.fixture(scope="module")
def nano():
    model = K3ForCausalLM(NANO)
    init_weights(model, NANO.initializer_range, NANO.num_hidden_layers, seed=0)
    return model.eval()


def moe_layers():
    return [L for L in range(NANO.num_hidden_layers) if NANO.is_moe_layer(L)]


def spec_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """docs/spec.md#mxfp4 literally: W[r, c] = ±mag(nibble) · 2^(scale[r, c // 32] − 127), nibble from byte c
    // 2."""
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    out = torch.empty(rows, cols, dtype=torch.float64)
    for r in range(rows):
        for c in range(cols):
            byte = int(packed[r, c // 2])
            nib = byte & 0xF if c % 2 == 0 else byte >> 4
            mag = FP4_E2M1_VALUES[nib & 7] * 2.0 ** (int(scale[r, c // 32]) - 127)
            out[r, c] = -mag if nib & 8 else mag
    return out


def test_quantization_config_is_the_releases():
    assert mxfp4_quantization_config() == preset("k3-full").quantization_config
    q = with_mxfp4_config(NANO).to_hf()["text_config"]["quantization_config"]  # inside, as released
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    wrapped = with_mxfp4_config(
        K3Config.from_hf({"architectures": ["X"], "text_config": NANO.to_hf(text_only=True)})
    ).to_hf()
    assert "quantization_config" in wrapped["text_config"] and "quantization_config" not in wrapped
    assert NANO.quantization_config is None


def test_export_layout_and_spec_decode(nano):
    official = to_official(nano.state_dict(), NANO)
    out = export_mxfp4(official, NANO)
    for L in moe_layers():
        for e in range(E):
            for w, (rows, cols) in {"w1": (I, Dl), "w3": (I, Dl), "w2": (Dl, I)}.items():
                base = EXPERT.format(L=L, e=e, w=w)
                assert base + ".weight" not in out
                p, s = out[base + ".weight_packed"], out[base + ".weight_scale"]
                assert p.dtype == s.dtype == torch.uint8
                assert p.shape == (rows, cols // 2) and s.shape == (rows, cols // 32)
    untouched = [n for n in official if ".experts." not in n]
    assert all(out[n] is official[n] for n in untouched)
    assert len(out) == len(official) + len(moe_layers()) * E * 3
    base = EXPERT.format(L=1, e=3, w="w2")
    decoded = spec_decode(out[base + ".weight_packed"], out[base + ".weight_scale"])
    assert torch.equal(decoded, fake_quant_mx(official[base + ".weight"], "mxfp4").double())


def test_import_inverts_export(nano):
    official = to_official(nano.state_dict(), NANO)
    packed = export_mxfp4(official, NANO)
    back = import_mxfp4(packed, NANO, dtype=torch.float32)
    assert back.keys() == official.keys()
    base = EXPERT.format(L=2, e=0, w="w1") + ".weight"
    assert back[base].dtype == torch.float32
    assert torch.equal(back[base], fake_quant_mx(official[base], "mxfp4"))
    again = export_mxfp4(import_mxfp4(packed, NANO, dtype=torch.bfloat16), NANO)
    assert all(torch.equal(again[n], packed[n]) for n in packed)  # bit-exact, through BF16


def test_bad_inputs_are_named(nano):
    official = to_official(nano.state_dict(), NANO)
    name = EXPERT.format(L=1, e=0, w="w1") + ".weight"
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        export_mxfp4({**official, name: torch.zeros(I, Dl + 32)}, NANO)
    bad = official[name].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        export_mxfp4({**official, name: bad}, NANO)
    packed = export_mxfp4(official, NANO)
    del packed[name.replace(".weight", ".weight_scale")]
    with pytest.raises(ValueError, match="lacks weight_scale"):
        import_mxfp4(packed, NANO)


def test_save_reload_reexport_bit_exact(nano, tmp_path):
    save_mxfp4_checkpoint(nano, NANO, tmp_path / "a", dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"] == mxfp4_quantization_config()
    stored = load_official_tensors(tmp_path / "a")
    base = EXPERT.format(L=1, e=0, w="w1")
    assert stored[base + ".weight_packed"].dtype == torch.uint8 and base + ".weight" not in stored
    assert stored["language_model.model.embed_tokens.weight"].dtype == torch.bfloat16
    assert stored["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == (
        torch.float32
    )

    # plain loader (experts dequantized to BF16) -> export again
    model, config = load_checkpoint(tmp_path / "a")
    assert config.quantization_config == mxfp4_quantization_config()
    save_mxfp4_checkpoint(model, config, tmp_path / "b")
    # packed loader (file bytes kept) -> export again without re-quantizing
    packed, _ = load_mxfp4_checkpoint(tmp_path / "a", packed=True)
    save_mxfp4_checkpoint(packed, config, tmp_path / "c")
    for d in ("b", "c"):
        again = load_official_tensors(tmp_path / d)
        assert again.keys() == stored.keys()
        for n, t in stored.items():
            assert again[n].dtype == t.dtype and torch.equal(again[n], t), (d, n)
    w = model.model.layers[1].block_sparse_moe.experts.w1
    assert w.dtype == torch.bfloat16
    assert torch.equal(w.float(), fake_quant_mx(nano.model.layers[1].block_sparse_moe.experts.w1, "mxfp4"))


def test_missing_packed_expert_is_named(nano, tmp_path):
    tensors = export_mxfp4(to_official(nano.state_dict(), NANO), NANO)
    missing = EXPERT.format(L=2, e=5, w="w3")
    tensors = {n: t for n, t in tensors.items() if not n.startswith(missing)}
    from safetensors.torch import save_file

    (tmp_path / "x").mkdir()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp_path / "x" / "model.safetensors"))
    with_mxfp4_config(NANO).save(tmp_path / "x" / "config.json")
    with pytest.raises(ValueError, match=r"experts\.w3\.weight_packed.*missing \[5\]"):
        load_mxfp4_checkpoint(tmp_path / "x")


def test_k3_quantize_cli(nano, tmp_path, capsys):
    src, dst = tmp_path / "hp", tmp_path / "q"
    save_checkpoint(
        nano,
        NANO,
        src,
        extra_files={
            "tokenizer.json": '{"model": 1}',
            "tokenizer_config.json": "{}",
            "train_state.json": "{}",
        },
    )
    assert main(["quantize", str(src), str(dst)]) == 0
    assert "quantized 72 routed-expert matrices" in capsys.readouterr().out  # 3 layers x 8 experts x 3
    assert (dst / "tokenizer.json").read_text() == '{"model": 1}' and (dst / "tokenizer_config.json").exists()
    assert not (dst / "train_state.json").exists()  # training state does not travel with the release
    tensors = load_official_tensors(dst)
    assert tensors[EXPERT.format(L=3, e=7, w="w2") + ".weight_scale"].shape == (Dl, I // 32)
    assert tensors["language_model.lm_head.weight"].dtype == torch.bfloat16  # --dtype default
    model, config = load_mxfp4_checkpoint(dst)
    assert config.quantization_config == mxfp4_quantization_config()
    ref = export_mxfp4(to_official(nano.state_dict(), NANO), NANO)
    for n in ref:
        if ".experts." in n:
            assert torch.equal(tensors[n], ref[n]), n  # quantized from the fp32 source, not from BF16
    ids = torch.randint(0, NANO.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids).logits.float()).all()

    assert main(["quantize", str(dst), str(tmp_path / "again")]) == 2  # already quantized
    assert "already MXFP4" in capsys.readouterr().err
    assert main(["quantize", str(src), str(src)]) == 2
    assert main(["quantize", str(tmp_path / "nope"), str(tmp_path / "z")]) == 2
    assert main(["quantize", str(src), str(tmp_path / "f32"), "--dtype", "keep"]) == 0
    assert load_official_tensors(tmp_path / "f32")["language_model.lm_head.weight"].dtype == torch.float32
