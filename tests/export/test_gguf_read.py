"""k3 reads kimi-k3 GGUFs: the decoders against gguf's own, and `k3 export --format gguf` read back.

For every outtype the exporter writes, the file read back must give the source's config, tokenizer ids
and chat template, and logits equal to the source model's (f32) or to the source with the same rounding
applied to the same tensors by the gguf package's own quantizer (bf16, q8_0, mxfp4). The comparison
with files written by llama.cpp's own quantizer is tests/export/test_llamacpp_quantized.py.
"""

import argparse
import copy
import dataclasses

import gguf
import numpy as np
import pytest
import torch

from k3.checkpoint.adapter import is_f32_tensor
from k3.checkpoint.io import save_checkpoint
from k3.cli import main
from k3.config import preset
from k3.export import gguf as gguf_export
from k3.export.gguf import chat_template, mxfp4_blocks, stored_type
from k3.export.gguf_layout import a_log_from_ssm_a, gguf_tensors, state_from_gguf
from k3.export.gguf_read import is_gguf, load_gguf, read_gguf_config
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM
from k3.ops.mx import fake_quant_mx, quantize_mx
from k3.quant.ggml import decode, mxfp4_to_packed
from k3.quant.packed import PackedRoutedExperts, expert_bytes
from k3.tokenizer import K3Tokenizer
from k3.tokenizer_train import train_tokenizer

Q = gguf.GGMLQuantizationType
OUTTYPES = gguf_export.OUTTYPES
NANO = preset("k3-nano")
# every other branch of the layout: no q LoRA, tied head, no dense layer, no shared expert, no latent
# norm, the softplus KDA gate
VARIANT = dataclasses.replace(
    NANO,
    q_lora_rank=None,
    tie_word_embeddings=True,
    first_k_dense_replace=0,
    num_shared_experts=0,
    latent_moe_use_norm=False,
    linear_attn_config=dataclasses.replace(NANO.linear_attn_config, gate_lower_bound=None),
)
SAMPLE = "def main(argv):\n    return {'x': [1, 2, 3]}  # héllo 世界 <|open|>\n\tprint(argv)\n"
CORPUS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in os.listdir(argv[1]):\n        print(name)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n\n    def norm(self):\n"
    "        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
] * 40


# ---- the decoders against the gguf package's ------------------------------------------------------------
def _bytes(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy())


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q8_0", "Q4_0", "MXFP4"])
def test_decoders_equal_gguf_dequantize_on_quantized_weights(kind):
    x = (np.random.default_rng(0).standard_normal((6, 4, 96)) * 3).astype(np.float32)
    x[0, 0, :32] = 0  # an all-zero block
    raw = x.astype(np.float16) if kind == "F16" else gguf.quants.quantize(x, Q[kind])
    want = x.astype(np.float16).astype(np.float32) if kind == "F16" else gguf.quants.dequantize(raw, Q[kind])
    got = decode(_bytes(raw), kind, x.shape)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got, torch.from_numpy(want.astype(np.float32)))


@pytest.mark.parametrize("kind", ["BF16", "Q8_0", "Q4_0", "MXFP4"])
def test_decoders_equal_gguf_dequantize_on_arbitrary_bytes(kind):
    """Every code and scale, not only what a quantizer writes (MXFP4: every scale byte but 255)."""
    per, size = {"BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "MXFP4": (32, 17)}[kind]
    rows, n = 64, 128
    raw = np.random.default_rng(1).integers(0, 256, (rows, n // per * size), dtype=np.uint8)
    if kind == "MXFP4":
        raw.reshape(rows, -1, size)[..., 0] = np.arange(rows * n // per).reshape(rows, -1) % 255
    elif kind in ("Q8_0", "Q4_0"):  # finite fp16 scales (exponent bits not all ones)
        raw.reshape(rows, -1, size)[..., 1] &= 0x7B
    with np.errstate(over="ignore"):  # MXFP4: scale 254 times 6 is past fp32's range (inf, as ours)
        want = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).astype(np.float32))
    got = decode(torch.from_numpy(raw.reshape(-1).copy()), kind, (rows, n))
    # equal values, NaN where gguf has NaN (MXFP4's code 8 is -0 in k3 and +0 in ggml: equal values)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_mxfp4_blocks_repack_to_k3_codes_without_decoding():
    w = torch.randn(3, 8, 64)
    packed, scales = mxfp4_to_packed(mxfp4_blocks(w).reshape(-1), (3, 8, 64))
    want_packed, want_scales = quantize_mx(w, "mxfp4")
    assert torch.equal(packed, want_packed) and torch.equal(scales, want_scales)


def test_decode_refuses_a_wrong_byte_count_and_a_partial_block():
    with pytest.raises(ValueError, match="needs 68 bytes"):
        decode(torch.zeros(67, dtype=torch.uint8), "Q8_0", (2, 32))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        decode(torch.zeros(34, dtype=torch.uint8), "Q8_0", (1, 48))


def test_a_log_comes_back_bit_exact():
    a_log = torch.empty(4096).uniform_(-8, 8)
    assert torch.equal(-torch.exp(a_log_from_ssm_a(-torch.exp(a_log))), -torch.exp(a_log))


# ---- round trips through `k3 export --format gguf` -------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(CORPUS, vocab_size=NANO.vocab_size).save(d)
    return d


def _source(config, tokenizer_dir, out, seed):
    torch.manual_seed(seed)
    model = K3ForCausalLM(config).eval()
    init_weights(model, 0.5, config.num_hidden_layers, seed=seed)  # large init: input-dependent tokens
    with torch.no_grad():  # router biases and AttnRes gains away from their init values
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("_res_proj.weight"):
                p.add_(torch.randn(p.shape) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
    files = {f: tokenizer_dir / f for f in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(model, config, out, extra_files=files)
    return model


@pytest.fixture(scope="module", params=["nano", "variant"])
def source(request, tokenizer_dir, tmp_path_factory):
    config = NANO if request.param == "nano" else VARIANT
    d = tmp_path_factory.mktemp(request.param)
    model = _source(config, tokenizer_dir, d / "ckpt", seed=len(request.param))
    files = {}
    for outtype in OUTTYPES:
        files[outtype] = d / f"{outtype}.gguf"
        args = ["export", str(d / "ckpt"), "--out", str(files[outtype]), "--format", "gguf"]
        assert main([*args, "--outtype", outtype]) == 0
    return model, config, files


def _rounded_twin(model, config, outtype):
    """The source with each GGUF tensor rounded as `outtype` stores it: by the gguf package's own
    quantizer and dequantizer (numpy), mapped back to our state_dict; MXFP4 experts by k3's quantizer,
    whose codes the exporter writes."""
    tensors = gguf_tensors(model.state_dict(), config)
    for name, t in tensors.items():
        kind = stored_type(name, t, outtype)
        if kind == "mxfp4" and outtype == "mxfp4":
            tensors[name] = fake_quant_mx(t.float(), "mxfp4")
        elif kind != "f32":
            q = Q[kind.upper()]
            back = gguf.quants.dequantize(gguf.quants.quantize(t.float().numpy(), q), q)
            tensors[name] = torch.from_numpy(back.astype(np.float32)).reshape(t.shape)
    twin = copy.deepcopy(model)
    twin.load_state_dict(state_from_gguf(tensors, config))
    return twin


def _ids(n=2, t=40):
    return torch.randint(0, NANO.vocab_size - 256, (n, t), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_export_reads_back_config_tokenizer_template_and_logits(source, tokenizer_dir, outtype):
    model, config, files = source
    assert is_gguf(files[outtype])
    ck = load_gguf(files[outtype])
    assert read_gguf_config(files[outtype]).replace(quantization_config=None) == config
    assert ck.config.replace(quantization_config=None, dtype=config.dtype) == config
    # a BF16 file loads as a bf16 model (exact: no f32 copy); every other outtype as float32
    assert ck.config.dtype == ("bfloat16" if outtype == "bf16" else "float32")
    assert ck.model.lm_head.weight.dtype == getattr(torch, ck.config.dtype)
    ours = K3Tokenizer.from_dir(tokenizer_dir)
    assert ck.tokenizer.encode(SAMPLE) == ours.encode(SAMPLE)
    assert ck.tokenizer.encode(SAMPLE, allow_special=True) == ours.encode(SAMPLE, allow_special=True)
    assert ck.tokenizer.decode(ck.tokenizer.encode(SAMPLE)) == SAMPLE
    assert ck.tokenizer.eos_id == ours.eos_id and ck.tokenizer.reserved == ours.reserved
    assert ck.chat_template == chat_template(tokenizer_dir) and ck.chat_template
    ref = model if outtype == "f32" else _rounded_twin(model, config, outtype)
    dense = load_gguf(files[outtype], packed_experts=False, dtype=torch.float32).model  # packed: next test
    with torch.no_grad():
        got, want = dense(_ids()).logits, ref(_ids()).logits
    assert torch.equal(got, want)
    if outtype != "f32":  # the rounding is real: the source itself differs
        with torch.no_grad():
            assert not torch.equal(got, model(_ids()).logits)


def test_mxfp4_experts_stay_packed_with_the_codes_of_k3_quantize(source):
    model, config, files = source
    ck = load_gguf(files["mxfp4"])
    moe = [i for i in range(config.num_hidden_layers) if i >= config.first_k_dense_replace]
    assert ck.packed_layers == moe
    held = expert_bytes(ck.model)
    assert held["dense"] == 0 and held["packed"] * 3 < held["bf16_equivalent"]  # no decoded copy
    for i in moe:
        packed = ck.model.model.layers[i].block_sparse_moe.experts
        assert isinstance(packed, PackedRoutedExperts)
        src = model.model.layers[i].block_sparse_moe.experts
        for w in ("w1", "w2", "w3"):
            codes, scales = quantize_mx(getattr(src, w).detach(), "mxfp4")
            assert torch.equal(getattr(packed, w).weight_packed, codes)
            assert torch.equal(getattr(packed, w).weight_scale, scales)
    dense = load_gguf(files["mxfp4"], packed_experts=False)
    assert dense.packed_layers == [] and dense.config.quantization_config is None
    with torch.no_grad():  # the packed experts' grouped GEMMs round differently from the dense ones
        torch.testing.assert_close(ck.model(_ids()).logits, dense.model(_ids()).logits, rtol=0, atol=1e-4)


def _greedy(engine, prompts, n=12):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [s.output for s in engine.generate(prompts, params)]


@pytest.mark.parametrize("outtype", ["f32", "mxfp4"])
def test_engine_on_the_gguf_generates_the_source_tokens(source, outtype):
    model, config, files = source
    cfg = EngineConfig(page_size=16, prefix_unit=16, num_pages=32, max_num_seqs=2, max_model_len=128)
    engine = Engine.from_checkpoint(str(files[outtype]), cfg)
    assert engine.tokenizer is not None and engine.eos_token_id == engine.tokenizer.eos_id
    ref = model if outtype == "f32" else _rounded_twin(model, config, outtype)
    prompts = [p.tolist() for p in _ids(2, 20)]
    got = _greedy(engine, prompts)
    ref_engine = Engine(copy.deepcopy(ref), copy.deepcopy(cfg))
    want = _greedy(ref_engine, prompts)
    assert got == want and len(set(map(tuple, got))) == 2
    # the GGUF's model takes the same decode path (the native whole-model step where it is built)
    assert (engine.runner.decode.native is None) == (ref_engine.runner.decode.native is None)


def test_unknown_tensor_types_are_refused_by_name(tokenizer_dir, tmp_path, monkeypatch):
    """A type k3 does not decode (Q4_1 here): the error names it and the tensors stored in it."""
    model = K3ForCausalLM(NANO)
    encode = gguf_export._encode

    def some_q4_1(g, name, t, outtype):
        if name in ("blk.0.attn_q.weight", "blk.3.attn_output.weight"):
            return gguf.quants.quantize(t.float().numpy(), Q.Q4_1), Q.Q4_1
        return encode(g, name, t, outtype)

    monkeypatch.setattr(gguf_export, "_encode", some_q4_1)
    path = gguf_export.write_gguf(model.state_dict(), NANO, tokenizer_dir, tmp_path / "q41.gguf")
    with pytest.raises(ValueError, match=r"Q4_1: \[blk\.0\.attn_q\.weight, blk\.3\.attn_output\.weight\]"):
        load_gguf(path)


def test_other_files_are_refused(tokenizer_dir, tmp_path):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(not_gguf)
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'llama' is not 'kimi-k3'"):
        load_gguf(tmp_path / "llama.gguf")


# ---- the commands -------------------------------------------------------------------------------------
def test_generate_eval_and_serve_open_a_gguf(source, tmp_path, capsys):
    from k3.serve.cli import add_arguments, build_engine

    _, config, files = source
    path = str(files["q8_0"])
    capsys.readouterr()
    assert main(["generate", path, "--prompt", "def main(", "--max-tokens", "6", "--quiet"]) == 0
    assert capsys.readouterr().out.strip()
    data = tmp_path / "data"
    data.mkdir()
    for i, text in enumerate(CORPUS[:6]):
        (data / f"m{i}.py").write_text(text * 3)
    assert main(["eval", path, "--data", str(data), "--seq-len", "32", "--batch-size", "2", "--json"]) == 0
    assert '"val_bpb"' in capsys.readouterr().out
    p = argparse.ArgumentParser(prog="k3 serve")
    add_arguments(p)
    engine = build_engine(p.parse_args([path, "--max-model-len", "128", "--page-size", "16"]))
    assert engine.tokenizer is not None and engine.model.config == load_gguf(path).config


def _llama_quantize_type(name: str, t: torch.Tensor, ftype: str) -> str:
    """The type llama.cpp's quantizer picks for a kimi-k3 tensor (src/llama-quant.cpp, read for this
    test): F32 for 1-D tensors, norms, the router and the convs; MXFP4_MOE: MXFP4 for 3-D tensors with
    more than one matrix, else Q8_0; a width that is not whole 32-blocks falls back to F16."""
    skip = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d")
    if t.ndim < 2 or not name.endswith("weight") or any(s in name for s in skip):
        return "F32"
    kind = "MXFP4" if ftype == "MXFP4_MOE" and t.ndim == 3 and t.shape[0] > 1 else "Q8_0"
    return kind if t.shape[-1] % 32 == 0 else "F16"


@pytest.mark.parametrize("ftype", ["Q8_0", "MXFP4_MOE"])
def test_files_typed_as_llamacpp_quantizes_them(source, tokenizer_dir, tmp_path, monkeypatch, ftype):
    """Mixed types in one file, each tensor encoded by the gguf package as llama.cpp's quantizer would
    store it (F16 fallbacks, MXFP4 MLA blocks): k3 decodes each as gguf does."""
    model, config, files = source
    tensors = gguf_tensors(model.state_dict(), config)
    kinds = {n: _llama_quantize_type(n, t, ftype) for n, t in tensors.items()}

    def as_llamacpp(g, name, t, outtype):
        kind = kinds[name]
        if kind == "F32":
            return t.float().contiguous().numpy(), None
        if kind == "F16":
            return t.float().numpy().astype(np.float16), None
        return gguf.quants.quantize(t.float().contiguous().numpy(), Q[kind]), Q[kind]

    monkeypatch.setattr(gguf_export, "_encode", as_llamacpp)
    path = gguf_export.write_gguf(model.state_dict(), config, tokenizer_dir, tmp_path / "m.gguf")
    ck = load_gguf(path, packed_experts=False)
    assert ck.tensor_types == kinds
    assert {"F32", "F16", "Q8_0"} <= set(kinds.values())
    for name, t in tensors.items():
        if kinds[name] == "F16":
            tensors[name] = t.half().float()
        elif kinds[name] != "F32":
            q = Q[kinds[name]]
            tensors[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q), q))
    twin = copy.deepcopy(model)
    twin.load_state_dict(state_from_gguf(tensors, config))
    with torch.no_grad():
        assert torch.equal(ck.model(_ids()).logits, twin(_ids()).logits)
    if ftype == "MXFP4_MOE":
        assert load_gguf(path).packed_layers == list(range(config.first_k_dense_replace, 4))
        # `k3 export --outtype mxfp4_moe` writes the same types and bytes
        ours = gguf.GGUFReader(files["mxfp4_moe"])
        theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
        for t in ours.tensors:
            assert t.tensor_type == theirs[t.name].tensor_type, t.name
            assert np.array_equal(t.data, theirs[t.name].data), t.name


def test_a_bf16_file_loads_in_bf16_without_rounding(source):
    _, _, files = source
    f32 = load_gguf(files["bf16"]).model.state_dict()
    bf16 = load_gguf(files["bf16"], dtype=torch.bfloat16)
    assert bf16.config.dtype == "bfloat16"
    for name, t in bf16.model.state_dict().items():
        assert t.dtype == (torch.float32 if is_f32_tensor(name) else torch.bfloat16), name
        if t.ndim >= 2 and not name.endswith(("gate.weight", "_res_proj.weight")):  # stored as BF16
            assert torch.equal(t.float(), f32[name]), name
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_gguf(files["bf16"], dtype=torch.int8)


def test_a_bf16_file_runs_in_the_native_step_with_the_bits_of_its_f32_decoding(source):
    """A BF16 GGUF loads as a bf16 model (its F32 vectors and router kept F32) that the engine runs in
    the C step, every row: tokens and logprobs equal the same file decoded to f32, bit for bit."""
    _, _, files = source
    cfg = dict(page_size=16, prefix_unit=16, num_pages=24, max_model_len=256, max_num_seqs=2)
    bf16 = Engine.from_checkpoint(str(files["bf16"]), EngineConfig(**cfg))
    assert bf16.model.lm_head.weight.dtype == torch.bfloat16 and bf16.runner.exact
    f32 = Engine(load_gguf(files["bf16"], dtype=torch.float32).model, EngineConfig(**cfg, deterministic=True))
    params = SamplingParams(max_tokens=8, logprobs=3, ignore_eos=True)
    prompts = [_ids()[0].tolist(), _ids()[1].tolist()[:9]]
    got = [(s.output, s.logprobs) for s in bf16.generate(prompts, params)]
    assert got == [(s.output, s.logprobs) for s in f32.generate(prompts, params)]


@pytest.mark.parametrize("outtype", ["q8_0", "mxfp4_moe"])
def test_an_8_bit_file_keeps_its_blocks_and_runs_in_the_native_step(source, outtype):
    """Q8_0 linear layers stay Q8_0 blocks (a quarter of the f32 bytes) and the engine runs them in the C
    step, every row: tokens and logprobs equal the same file widened to f32, bit for bit."""
    from k3.quant.q8 import Q8Linear

    _, _, files = source
    cfg = dict(page_size=16, prefix_unit=16, num_pages=24, max_model_len=256, max_num_seqs=2)
    q8 = Engine.from_checkpoint(str(files[outtype]), EngineConfig(**cfg))
    held = [m for m in q8.model.modules() if isinstance(m, Q8Linear)]
    assert held and all(m.codes.dtype == torch.int8 for m in held) and q8.runner.exact
    f32 = Engine(load_gguf(files[outtype], keep_q8=False).model, EngineConfig(**cfg, deterministic=True))
    assert not any(isinstance(m, Q8Linear) for m in f32.model.modules())
    params = SamplingParams(max_tokens=8, logprobs=3, ignore_eos=True)
    prompts = [_ids()[0].tolist(), _ids()[1].tolist()[:9]]
    got = [(s.output, s.logprobs) for s in q8.generate(prompts, params)]
    assert got == [(s.output, s.logprobs) for s in f32.generate(prompts, params)]
