"""Files made by llama.cpp's own quantizer load in k3 and give llama.cpp's logits on them.

A k3-nano is exported as an f32 GGUF (`k3 export`), then `llama-quantize` writes its Q8_0 and
MXFP4_MOE files. k3 reads each file (MXFP4 experts packed, the rest decoded to f32) and scores the same
token windows as llama.cpp running that same file (and the f32 file it came from).
"""

import subprocess

import numpy as np
import pytest
import torch

from k3.checkpoint.io import save_checkpoint
from k3.cli import main
from k3.config import preset
from k3.export.gguf_read import load_gguf
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM
from k3.tokenizer_train import train_tokenizer

NANO = preset("k3-nano")
CORPUS = ["def main(argv):\n    for name in argv:\n        print(name.upper())\n    return 0\n"] * 60
CTX, WINDOWS = 96, 4


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory, llamacpp):
    d = tmp_path_factory.mktemp("quantized")
    train_tokenizer(CORPUS, vocab_size=NANO.vocab_size).save(d / "tok")
    model = K3ForCausalLM(NANO)
    init_weights(model, 0.5, NANO.num_hidden_layers, seed=7)  # large init: input-dependent logits
    files = {f: d / "tok" / f for f in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(model, NANO, d / "ckpt", extra_files=files)
    assert main(["export", str(d / "ckpt"), "--out", str(d / "f32.gguf"), "--format", "gguf"]) == 0
    return d / "f32.gguf"


def _quantize(llamacpp, src, ftype):
    out = src.with_name(f"{ftype.lower()}.gguf")
    cmd = [str(llamacpp.bin / "llama-quantize"), str(src), str(out), ftype, "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return out


@pytest.mark.parametrize("ftype", ["Q8_0", "MXFP4_MOE"])
def test_llama_quantize_output_loads_and_matches_llamacpp(llamacpp, f32_gguf, ftype):
    from parity_llamacpp import compare, llama_logits

    path = _quantize(llamacpp, f32_gguf, ftype)
    ck = load_gguf(path)
    types = set(ck.tensor_types.values())
    assert "Q8_0" in types, ck.tensor_types
    moe = list(range(NANO.first_k_dense_replace, NANO.num_hidden_layers))
    assert ck.packed_layers == (moe if ftype == "MXFP4_MOE" else [])
    ids = torch.randint(0, NANO.vocab_size - 256, (WINDOWS, CTX), generator=torch.Generator().manual_seed(0))
    wins = ids.tolist()
    targets = torch.cat([torch.cat([w[1:], torch.tensor([-1])]) for w in ids])
    with torch.no_grad():
        ours = torch.cat([ck.model(w[None]).logits[0].double() for w in ids])
    theirs = llama_logits(llamacpp.load(path, n_ctx=CTX + 8, threads=2), wins)
    their_f32 = llama_logits(llamacpp.load(f32_gguf, n_ctx=CTX + 8, threads=2), wins)
    same_file = compare(ours, theirs, targets)
    quantizing = compare(their_f32, theirs, targets)
    # The same stored weights on both sides: what differs is llama.cpp quantizing its activations (Q8
    # blocks), which the large init makes visible. That must cost less than llama.cpp's own step from the
    # f32 file to this one (weights and activations); a misread tensor would cost far more.
    for s in (same_file, quantizing):
        s.pop("per_position_diff")
    assert same_file["mean_kl"] < 0.5 * quantizing["mean_kl"], (same_file, quantizing)
    assert same_file["top1"] > quantizing["top1"], (same_file, quantizing)


@pytest.mark.parametrize(("ftype", "outtype"), [("Q8_0", "q8_0"), ("MXFP4_MOE", "mxfp4_moe")])
def test_k3_export_writes_llama_quantize_bytes(llamacpp, f32_gguf, ftype, outtype):
    """Every tensor of `k3 export --outtype mxfp4_moe` has the type and bytes llama-quantize gives the f32
    export; for q8_0, every tensor whose input width is whole 32-blocks (k3's q8_0 keeps the others F32,
    as llama.cpp's converter does; llama-quantize stores them F16)."""
    import gguf

    src = f32_gguf.parent / "ckpt"
    ours_path = f32_gguf.with_name(f"k3-{outtype}.gguf")
    args = ["export", str(src), "--out", str(ours_path), "--format", "gguf", "--outtype", outtype]
    assert main(args) == 0
    theirs = {t.name: t for t in gguf.GGUFReader(_quantize(llamacpp, f32_gguf, ftype)).tensors}
    ours = gguf.GGUFReader(ours_path).tensors
    assert {t.name for t in ours} == set(theirs)
    # llama-quantize drops trailing unit dimensions from the shapes it writes (the conv [1, C, 1, W] comes
    # back [C, 1, W]): the same ggml tensor, so the bytes are compared flat
    compared = [t for t in ours if not (outtype == "q8_0" and int(t.shape[0]) % 32)]
    for t in compared:
        assert t.tensor_type == theirs[t.name].tensor_type, t.name
        mine, other = np.asarray(t.data).reshape(-1), np.asarray(theirs[t.name].data).reshape(-1)
        assert mine.tobytes() == other.tobytes(), t.name
    assert len(compared) >= len(ours) // 2
