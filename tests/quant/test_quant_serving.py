"""Loading MXFP4 checkpoints for use: an FP32 one (`k3 quantize --dtype keep`) loads as one FP32 model
(`k3 eval`, the engine), and `k3 serve` / `k3 chat` keep the experts packed unless --dequantize."""

import argparse
import json

import pytest
import torch

from k3.checkpoint.io import load_checkpoint, load_official_tensors
from k3.cli import main
from k3.infer.sequence import SamplingParams
from k3.model.init import init_weights
from k3.model.moe import RoutedExperts
from k3.ops.mx import dequantize_mx, fake_quant_mx
from k3.quant.checkpoint import save_mxfp4_checkpoint
from k3.quant.packed import PackedRoutedExperts, expert_bytes
from k3.serve.cli import add_arguments, build_engine
from k3.train.cli import _load

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _quantize(src, out, *extra):
    assert main(["quantize", str(src), str(out), *extra]) == 0
    return out


def test_fp32_mxfp4_checkpoint_loads_as_one_fp32_model_for_eval(plain_run, tmp_path, capsys):
    q = _quantize(plain_run, tmp_path / "q", "--dtype", "keep")
    model, config = load_checkpoint(q)
    dtypes = {t.dtype for t in model.state_dict().values() if t.is_floating_point()}
    assert dtypes == {torch.float32}  # the experts too: no BF16/FP32 mix
    stored = load_official_tensors(q)
    name = "language_model.model.layers.{L}.block_sparse_moe.experts.3.w2.weight_{p}"
    L = next(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    w2 = dequantize_mx(stored[name.format(L=L, p="packed")], stored[name.format(L=L, p="scale")], "mxfp4")
    assert torch.equal(model.model.layers[L].block_sparse_moe.experts.w2[3], w2)

    # k3 eval's loader: the quantized model is exactly the FP32 run with fake-quantized expert weights
    qmodel, _, _, tc = _load(str(q))
    ref, _, _, _ = _load(str(plain_run))
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, RoutedExperts):
                for w in (m.w1, m.w2, m.w3):
                    w.copy_(fake_quant_mx(w, "mxfp4"))
    ids = torch.randint(0, config.vocab_size - 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(qmodel(ids).logits, ref(ids).logits)
    assert tc is not None and tc.seq_len == 64  # the run's eval settings came along
    capsys.readouterr()
    assert main(["eval", str(q), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["tokens"] > 0 and 0 < res["val_bpb"] < 20


def _engine(ckpt, *flags):
    p = argparse.ArgumentParser(prog="k3 serve")
    add_arguments(p)
    args = p.parse_args(
        [str(ckpt), "--max-model-len", "256", "--page-size", "16", "--max-num-seqs", "2", *flags]
    )
    return build_engine(args)


@pytest.mark.parametrize("dtype", ["keep", "bfloat16"])
def test_serve_loads_mxfp4_packed_with_the_tokens_of_dequantize(plain_run, tmp_path, dtype):
    model, config = load_checkpoint(plain_run)
    init_weights(model, 0.5, config.num_hidden_layers, seed=1)  # large init: input-dependent greedy tokens
    q = tmp_path / "q"
    save_mxfp4_checkpoint(
        model, config, q, dtype=None if dtype == "keep" else torch.bfloat16,
        extra_files={f: plain_run / f for f in TOKENIZER_FILES},
    )  # fmt: skip
    packed, dense = _engine(q), _engine(q, "--dequantize")
    assert any(isinstance(m, PackedRoutedExperts) for m in packed.model.modules())
    assert not any(isinstance(m, PackedRoutedExperts) for m in dense.model.modules())
    experts = [m for m in dense.model.modules() if isinstance(m, RoutedExperts)]
    want = torch.float32 if dtype == "keep" else torch.bfloat16  # the dtype of the other weights
    assert {w.dtype for m in experts for w in (m.w1, m.w2, m.w3)} == {want}
    assert dense.model.model.embed_tokens.weight.dtype == want
    b = expert_bytes(packed.model)
    assert b["dense"] == 0 and b["packed"] * 16 == b["bf16_equivalent"] * 4.25  # 4.25 bits per weight

    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [packed.tokenizer.encode("def total(items):"), packed.tokenizer.encode("x = [1, 2")]
    out_packed = [s.output for s in packed.generate(prompts, greedy)]
    out_dense = [s.output for s in dense.generate(prompts, greedy)]
    assert out_packed == out_dense and all(len(o) == 8 for o in out_packed)
    assert out_packed[0] != out_packed[1]  # not a degenerate constant output


def test_serve_plain_checkpoint_unchanged(plain_run):
    engine = _engine(plain_run, "--dequantize")  # no effect on a high-precision checkpoint
    assert not any(isinstance(m, PackedRoutedExperts) for m in engine.model.modules())
