"""Parity with llama.cpp's kimi-k3 on the same weights: tokens, logits, perplexity, greedy continuations.

    python bench/parity_llamacpp.py --checkpoint RUN_DIR [--outtypes f32,bf16,q8_0,mxfp4] [--json F]

The checkpoint is exported with `k3 export --format gguf` (k3.export) at each outtype and run in the
llama.cpp peer (bench/peers/llamacpp.sh builds it). On held-out text (the stdlib's validation split,
files never trained on, or --data):

(a) tokenization: our tokenizer vs llama.cpp's tokenizer of the GGUF, document by document;
(b) logits at every position of --positions tokens (windows of --ctx, each from an empty state), k3 in
    fp32 vs the f32 GGUF: max |diff|, mean KL(k3 || llama.cpp), top-1 agreement;
(c) perplexity on both sides;
(d) greedy continuations of --prompts prompts, --new tokens each, compared token for token;
(e) the bf16 / q8_0 / mxfp4 GGUFs against k3 at the matching precision: matrices rounded to BF16
    (bf16), k3 fp32 (q8_0, which k3 has no counterpart of), MXFP4 routed experts (mxfp4).

Router near-ties. At each position k3's router margin is the gap between the k-th and (k+1)-th
selection scores (sigmoid + bias), minimised over the MoE layers. Where it is below --margin, a rounding
difference of ~1e-6 may make the two engines pick different experts, which moves the logits by far more
than rounding: those positions are counted apart, and max |diff| is also reported over the others.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.llamacpp import LlamaCppPeer  # noqa: E402

from k3.benchmark.result import figure, write_result  # noqa: E402
from k3.data.corpus import load_corpus  # noqa: E402
from k3.export.gguf import write_gguf  # noqa: E402
from k3.export.source import load_source  # noqa: E402
from k3.model.generate import generate  # noqa: E402
from k3.model.moe import Router  # noqa: E402
from k3.ops.mx import dequantize_mx, quantize_mx  # noqa: E402
from k3.tokenizer import K3Tokenizer  # noqa: E402

OUTTYPES = ("f32", "bf16", "q8_0", "mxfp4")


def held_out(data: str | None, split: str, max_docs: int) -> list[str]:
    """Held-out documents, longest first so a few fill the logits budget: the validation split of the
    corpus (never trained on), or all of --data when it is a separate held-out folder (--data-split all)."""
    docs = list(load_corpus(data, split=split).documents)
    return sorted(docs, key=len, reverse=True)[:max_docs]


# ---- k3 side ----------------------------------------------------------------------------------------
class RouterMargins:
    """Forward hooks on every Router: the per-position selection margin, minimised over MoE layers."""

    def __init__(self, model: torch.nn.Module):
        self.margin: torch.Tensor | None = None  # [T]
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Router)]

    def _hook(self, module: Router, inputs, output) -> None:
        h = inputs[0].reshape(-1, inputs[0].shape[-1])
        scores = torch.sigmoid(torch.nn.functional.linear(h.float(), module.weight.float()))
        top = (scores + module.e_score_correction_bias.float()).topk(module.top_k + 1, dim=-1).values
        gap = top[:, -2] - top[:, -1]
        self.margin = gap if self.margin is None else torch.minimum(self.margin, gap)

    def take(self) -> torch.Tensor:
        m, self.margin = self.margin, None
        return m

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def k3_logits(model, windows: list[list[int]], margins: RouterMargins | None = None):
    """(logits [N, V] float64 over all windows, router margins [N] or None)."""
    out, gaps = [], []
    for w in windows:
        out.append(model(torch.tensor([w])).logits[0].double())
        if margins is not None:
            gaps.append(margins.take())
    return torch.cat(out), (torch.cat(gaps) if margins is not None else None)


def matched_precision(model: torch.nn.Module, outtype: str) -> torch.nn.Module:
    """k3's counterpart of a GGUF outtype: the same rounding applied to the same tensors, fp32 compute."""
    import copy

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if outtype == "bf16" and p.ndim >= 2 and not name.endswith("gate.weight"):
                p.copy_(p.to(torch.bfloat16).float())
            elif outtype == "mxfp4" and ".experts.w" in name:
                p.copy_(dequantize_mx(*quantize_mx(p, "mxfp4"), "mxfp4", torch.float32))
    return twin


# ---- llama.cpp side ---------------------------------------------------------------------------------
def llama_logits(llm, windows: list[list[int]]) -> torch.Tensor:
    out = []
    for w in windows:
        llm.reset()
        llm.eval(w)
        out.append(torch.from_numpy(np.array(llm.scores[: len(w)], dtype=np.float64)))
    return torch.cat(out)


def llama_greedy(llm, prompt: list[int], new: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    ids = []
    for _ in range(new):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        ids.append(nxt)
        llm.eval([nxt])
    return ids


# ---- comparisons --------------------------------------------------------------------------------------
def compare(ours: torch.Tensor, theirs: torch.Tensor, targets: torch.Tensor) -> dict:
    """Logit statistics of two [N, V] float64 tensors; targets [N] (-1: no next token in the window)."""
    lp, lq = torch.log_softmax(ours, -1), torch.log_softmax(theirs, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    valid = targets >= 0
    nll = lambda lg: -lg[valid].gather(1, targets[valid, None]).mean().item()  # noqa: E731
    diff = (ours - theirs).abs().amax(-1)
    return dict(
        positions=int(ours.shape[0]),
        max_abs_diff=diff.max().item(),
        median_abs_diff=diff.median().item(),
        mean_kl=kl.mean().item(),
        max_kl=kl.max().item(),
        top1=(ours.argmax(-1) == theirs.argmax(-1)).double().mean().item(),
        ppl_k3=math.exp(nll(lp)),
        ppl_llama=math.exp(nll(lq)),
        per_position_diff=diff,
    )


def windows_of(ids: list[int], ctx: int, positions: int) -> tuple[list[list[int]], torch.Tensor]:
    """Windows of `ctx` tokens covering the first `positions` ids, and next-token targets per position."""
    ids = ids[:positions]
    wins = [ids[i : i + ctx] for i in range(0, len(ids), ctx)]
    targets = [t for w in wins for t in (w[1:] + [-1])]
    return wins, torch.tensor(targets)


def tokenization(tok: K3Tokenizer, llm, docs: list[str]) -> dict:
    bad, first = 0, None
    total = 0
    for i, doc in enumerate(docs):
        ours = tok.encode(doc)
        theirs = llm.tokenize(doc.encode(), add_bos=False, special=False)
        total += len(ours)
        if ours != theirs:
            bad += 1
            if first is None:
                at = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
                first = dict(doc=i, token=at, ours=ours[at : at + 5] if at is not None else None)
    return dict(documents=len(docs), tokens=total, mismatched_documents=bad, first_mismatch=first)


def greedy(model, llm, tok: K3Tokenizer, docs: list[str], n_prompts: int, new: int, margins) -> dict:
    results = []
    for doc in docs[:n_prompts]:
        prompt = tok.encode(doc)[:32]
        ours = generate(model, torch.tensor([prompt]), new)[0, len(prompt) :].tolist()
        margins.take()
        theirs = llama_greedy(llm, prompt, new)
        at = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        entry = dict(identical=at is None, diverges_at=at)
        if at is not None:  # was the first differing pick a router near-tie on k3's side?
            with torch.no_grad():
                model(torch.tensor([prompt + ours[:at]]))
            entry["margin_at_divergence"] = margins.take()[-1].item()
        results.append(entry)
    return dict(prompts=len(results), identical=sum(r["identical"] for r in results), runs=results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="run folder or checkpoint directory")
    ap.add_argument("--outtypes", default="f32,bf16,q8_0,mxfp4")
    ap.add_argument("--data", default=None, help="held-out text (default: the stdlib's validation split)")
    ap.add_argument("--data-split", choices=("val", "all"), default="val", help="'all': --data is held out")
    ap.add_argument("--docs", type=int, default=40, help="held-out documents for the tokenization check")
    ap.add_argument("--positions", type=int, default=1536, help="positions compared in (b), (c), (e)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per logits window")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=128, help="greedy tokens per prompt")
    ap.add_argument("--margin", type=float, default=1e-4, help="router near-tie threshold")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    outtypes = [t for t in a.outtypes.split(",") if t]
    bad = [t for t in outtypes if t not in OUTTYPES]
    if bad or "f32" not in outtypes:
        raise SystemExit(f"--outtypes: choose from {', '.join(OUTTYPES)}, f32 included (got {a.outtypes})")
    torch.set_num_threads(a.threads)
    peer = LlamaCppPeer.find()
    src = load_source(a.checkpoint)
    model, config = src.model.float().eval(), src.config
    tok = K3Tokenizer.from_dir(src.tokenizer_dir)
    docs = held_out(a.data, a.data_split, a.docs)
    ids = [t for d in docs for t in tok.encode(d)]
    wins, targets = windows_of(ids, a.ctx, a.positions)
    margins = RouterMargins(model)
    ours, margin = k3_logits(model, wins, margins)
    near_tie = margin <= a.margin
    report: dict = dict(checkpoint=str(src.checkpoint), peer=peer.describe(), outtypes={})
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for outtype in outtypes:
            t0 = time.perf_counter()
            path = write_gguf(
                model.state_dict(), config, src.tokenizer_dir, Path(tmp) / f"m-{outtype}.gguf", outtype
            )
            llm = peer.load(path, n_ctx=max(a.ctx, 32 + a.new) + 8, threads=a.threads)
            theirs = llama_logits(llm, wins)
            if outtype == "f32":
                ref = ours
                report["tokenization"] = tokenization(tok, llm, docs)
                report["greedy"] = greedy(model, llm, tok, docs, a.prompts, a.new, margins)
            else:
                ref, _ = k3_logits(matched_precision(model, outtype), wins)
            stats = compare(ref, theirs, targets)
            diff = stats.pop("per_position_diff")
            stats["near_tie_positions"] = int(near_tie.sum())
            stats["max_abs_diff_clear_margin"] = diff[~near_tie].max().item() if (~near_tie).any() else 0.0
            stats["gguf_mb"] = path.stat().st_size / 2**20
            stats["seconds"] = time.perf_counter() - t0
            report["outtypes"][outtype] = stats
            del llm
            print(f"{outtype:6s} " + " ".join(f"{k}={_fmt(v)}" for k, v in stats.items()), flush=True)
            figures.append(figure(f"{outtype}: top-1 agreement", stats["top1"], peer="llama.cpp kimi-k3"))
            figures.append(figure(f"{outtype}: mean KL", stats["mean_kl"], "nats"))
    margins.close()
    t, g = report["tokenization"], report["greedy"]
    print(
        f"tokenization: {t['documents'] - t['mismatched_documents']}/{t['documents']} documents identical "
        f"({t['tokens']} tokens); greedy: {g['identical']}/{g['prompts']} continuations identical"
    )
    figures.append(
        figure(
            "tokenization: identical documents",
            t["documents"] - t["mismatched_documents"],
            peer="documents",
            peer_value=t["documents"],
        )
    )
    figures.append(
        figure("greedy continuations identical", g["identical"], peer="prompts", peer_value=g["prompts"])
    )
    if a.json:
        params = {k: v for k, v in vars(a).items() if k != "json"}
        write_result(a.json, "parity_llamacpp", figures, params, report=report)
    return 0


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
