"""One set of K3 weights in every format both engines read, and the perplexity each format gives.

    w = prepare("k3-tiny", workdir)            # a preset, seeded random init (or a checkpoint folder)
    w.k3["f32"], w.k3["mxfp4"]                 # k3 checkpoint folders (config, safetensors, tokenizer)
    w.gguf["f32"], w.gguf["bf16"], w.gguf["q8_0"], w.gguf["mxfp4"], w.gguf["mxfp4_moe"]   # the same weights

Formats. k3: `f32` (save_checkpoint) and `mxfp4`, the routed experts MXFP4-packed by
`k3.quant.checkpoint.save_mxfp4_checkpoint` with every other tensor kept F32 (what `k3 quantize IN OUT
--dtype keep` writes), so that it holds the very weights of llama.cpp's `mxfp4` GGUF (its experts are
the same codes, bit for bit; `k3.export.gguf`). GGUFs: `k3.export.gguf.write_gguf` at f32, q8_0, mxfp4
(what `k3 export --format gguf --outtype T` writes).

A preset's weights come from `init_weights(..., seed)` and its tokenizer and held-out text from the
stdlib corpus (`k3.data.prepare_data`, cached); the files are kept under `workdir` keyed by a hash of the
config, the seed and the writer code, and reused while none of them changes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

K3_FORMATS = ("f32", "mxfp4")
GGUF_FORMATS = ("f32", "bf16", "q8_0", "mxfp4", "mxfp4_moe")
# the code whose output lands in the files: a change to any of it invalidates the cached copies
_WRITER_FILES = (
    "export/gguf.py",
    "export/gguf_layout.py",
    "quant/checkpoint.py",
    "ops/mx.py",
    "model/init.py",
    "checkpoint/io.py",
    "checkpoint/adapter.py",
    "tokenizer.py",
)


@dataclass
class Weights:
    name: str  # the preset, or the checkpoint folder
    config: object  # K3Config
    trained: bool  # False: seeded random init
    root: Path
    k3: dict[str, Path] = field(default_factory=dict)
    gguf: dict[str, Path] = field(default_factory=dict)
    heldout: list[int] = field(default_factory=list)  # held-out token ids (never trained on)


def default_workdir() -> Path:
    return Path(os.environ.get("K3_CACHE_DIR") or Path.home() / ".cache" / "k3") / "vs_llamacpp"


def _fingerprint(parts: list[str]) -> str:
    import k3

    h = hashlib.sha256("\n".join(parts).encode())
    pkg = Path(k3.__file__).parent
    for f in _WRITER_FILES:
        h.update((pkg / f).read_bytes())
    return h.hexdigest()[:16]


def _source(name: str, seed: int):
    """(model f32, config, tokenizer, tokenizer dir, held-out ids, trained, fingerprint parts)."""
    from k3.config import PRESETS, preset

    if name in PRESETS:
        from k3.data import prepare_data
        from k3.model.init import init_weights
        from k3.model.transformer import K3ForCausalLM

        config = preset(name)
        data = prepare_data(None, vocab_size=config.vocab_size)
        model = K3ForCausalLM(config)
        init_weights(model, config.initializer_range, config.num_hidden_layers, seed=seed)
        held = [int(t) for t in data.val.tokens]
        parts = [name, json.dumps(config.to_hf(), sort_keys=True), str(seed), data.fingerprint]
        return model.float().eval(), config, data.tokenizer, data.cache_path, held, False, parts
    from k3.data.corpus import load_corpus
    from k3.export.source import load_source
    from k3.tokenizer import K3Tokenizer

    src = load_source(name)
    if src.tokenizer_dir is None:
        raise ValueError(f"--checkpoint {name}: no tokenizer files (tokenizer.json) in it or above it")
    tok = K3Tokenizer.from_dir(src.tokenizer_dir)
    held = [t for d in load_corpus(None, split="val").documents for t in tok.encode(d)]
    stamp = [f"{p.name}:{p.stat().st_mtime_ns}" for p in sorted(src.checkpoint.glob("*.safetensors"))]
    parts = [str(src.checkpoint.resolve()), *stamp]
    return src.model.float().eval(), src.config, tok, src.tokenizer_dir, held, True, parts


def prepare(name: str, workdir: Path, seed: int = 0, log=print) -> Weights:
    """The weights `name` names (a preset or a checkpoint / run folder) in every format, on disk."""
    from k3.checkpoint import save_checkpoint
    from k3.export.gguf import write_gguf
    from k3.quant.checkpoint import save_mxfp4_checkpoint

    model, config, tok, tok_dir, held, trained, parts = _source(name, seed)
    root = Path(workdir) / f"{Path(name).name}-{_fingerprint(parts)}"
    w = Weights(name, config, trained, root, heldout=held)
    w.k3 = {f: root / f"k3-{f}" for f in K3_FORMATS}
    w.gguf = {f: root / f"{f}.gguf" for f in GGUF_FORMATS}
    if (root / "READY").exists():
        state = None
        for f, path in w.gguf.items():  # a format added since the files were written
            if not path.exists():
                state = model.state_dict() if state is None else state
                log(f"{name}: writing {path.name}")
                write_gguf(state, config, tok_dir, path, f)
        return w
    root.mkdir(parents=True, exist_ok=True)
    log(f"{name}: writing the k3 checkpoints and the GGUFs to {root}")
    save_checkpoint(model, config, w.k3["f32"])
    save_mxfp4_checkpoint(model, config, w.k3["mxfp4"], dtype=None)
    for d in w.k3.values():
        tok.save(d)
    state = model.state_dict()
    for f, path in w.gguf.items():
        write_gguf(state, config, tok_dir, path, f)
    (root / "READY").write_text("\n".join(parts) + "\n")
    return w


# ---- perplexity on held-out tokens -----------------------------------------------------------------------
def windows(ids: list[int], ctx: int, positions: int) -> tuple[list[list[int]], list[list[int]]]:
    """Windows of `ctx` tokens over the first `positions` ids, and each window's next-token targets
    (-1 where the window ends: no target inside it). Every window starts from an empty state."""
    ids = ids[:positions]
    wins = [ids[i : i + ctx] for i in range(0, len(ids), ctx)]
    return wins, [w[1:] + [-1] for w in wins]


def perplexity(logits: list[torch.Tensor], targets: list[list[int]]) -> float:
    """exp(mean NLL) of the targets under per-window logits [T, V]."""
    nll, n = 0.0, 0
    for lg, tg in zip(logits, targets, strict=True):
        t = torch.tensor(tg)
        keep = t >= 0
        lp = torch.log_softmax(lg.double(), -1)[keep]
        nll -= lp.gather(1, t[keep, None]).sum().item()
        n += int(keep.sum())
    return math.exp(nll / n)


@torch.no_grad()
def k3_perplexity(model, ids: list[int], ctx: int, positions: int) -> float:
    wins, targets = windows(ids, ctx, positions)
    return perplexity([model(torch.tensor([w])).logits[0] for w in wins], targets)


def llama_perplexity(peer, gguf: Path, ids: list[int], ctx: int, positions: int, threads: int) -> float:
    """The same windows through llama.cpp's bindings (the logits of every position, as
    bench/parity_llamacpp.py reads them)."""
    import numpy as np

    wins, targets = windows(ids, ctx, positions)
    llm = peer.load(gguf, n_ctx=ctx + 8, threads=threads)
    try:
        out = []
        for w in wins:
            llm.reset()
            llm.eval(w)
            out.append(torch.from_numpy(np.array(llm.scores[: len(w)], dtype=np.float64)))
    finally:
        if hasattr(llm, "close"):
            llm.close()
    return perplexity(out, targets)
