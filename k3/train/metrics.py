"""What a run reports: metrics.jsonl, loss.png, the live progress bar, FLOPs/MFU and the summary table.

FLOPs per token (training = forward + backward = 3 x forward), documented in docs/training.md:

    6 * N_active_nonembedding                       every matmul weight once per token (x2 fwd, x3 train);
                                                    routed experts count k/E of their weights, the
                                                    input embedding (a lookup) not at all, lm_head fully
  + 6 * H * (Dqk + Dv) * T          per MLA layer    dense q.k and p.v over all T keys of the row (PaLM
                                                    convention: the masked half is counted, as computed)
  + 3 * H * (5*C*K + 3*C*V + 6*K*V) per KDA layer    chunked delta rule with chunk C: A_kk, A_qk (2CK each),
                                                    the UT solve (C(K+V)), A_qk V' (2CV), and three K x V
                                                    state products (W S, Q S, K^T V')

MFU = FLOPs/token * tokens/s / peak, with the peak measured in the same process as the best of a few
square torch.matmul runs in the training dtype (so "100 %" is what this CPU's BLAS reaches on a big GEMM).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from k3.config import K3Config

KDA_CHUNK = 64


# ---- FLOPs and MFU ---------------------------------------------------------------------------------


def active_nonembedding_params(model: nn.Module, config: K3Config) -> int:
    """Matmul weights a token passes through: everything but the embedding, routed experts at k/E."""
    n = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not config.tie_word_embeddings:
            continue
        if p.ndim < 2:  # norms, gate scalars: no matmul
            continue
        frac = config.num_experts_per_token / config.num_experts if ".experts.w" in name else 1.0
        n += int(p.numel() * frac)
    return n


def flops_per_token(model: nn.Module, config: K3Config, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token by term (see the module doc); "total" is their sum."""
    la = config.linear_attn_config
    n_mla = sum(not config.is_kda_layer(i) for i in range(config.num_hidden_layers))
    n_kda = config.num_hidden_layers - n_mla
    H, K, C = la.num_heads, la.head_dim, KDA_CHUNK
    V = K  # KDA heads use head_dim for keys and values
    terms = {
        "dense": 6.0 * active_nonembedding_params(model, config),
        "mla": 6.0 * n_mla * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim) * seq_len,
        "kda": 3.0 * n_kda * H * (5 * C * K + 3 * C * V + 6 * K * V),
    }
    terms["total"] = sum(terms.values())
    return terms


def measure_matmul_peak(
    dtype: torch.dtype = torch.float32, seconds: float = 1.0, sizes: tuple[int, ...] = (512, 1024, 2048)
) -> float:
    """Best FLOP/s of torch.matmul on square [n, n] operands, `seconds` per size, in this process."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.matmul(a, b)  # warm-up
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / len(sizes) or reps < 2:
            torch.matmul(a, b)
            reps += 1
        best = max(best, 2 * n**3 * reps / elapsed)
    return best


# ---- metrics.jsonl and loss.png --------------------------------------------------------------------


class MetricsLog:
    """Append-only JSON lines; every record gets `kind` ("train" | "eval" | "event")."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"kind": kind, **fields}, allow_nan=True) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (a resumed run rewrites them)."""
        if not self.path.exists():
            return
        keep = [
            ln
            for ln in self.path.read_text().splitlines()
            if ln.strip() and json.loads(ln).get("step", 0) <= step
        ]
        self.path.write_text("".join(ln + "\n" for ln in keep))


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def spike_ratio(losses: list[float], warmup: int) -> float:
    """max over steps >= warmup of loss / (lowest loss so far): 1.0 if the loss never rose (NaNs skipped)."""
    low, worst = math.inf, 1.0
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            continue
        if i >= warmup and math.isfinite(low):
            worst = max(worst, loss / low)
        low = min(low, loss)
    return worst


def ema(values: list[float], alpha: float = 0.05) -> list[float]:
    """Exponential moving average, debiased so the first values are not pulled towards 0."""
    out, m, w = [], 0.0, 0.0
    for v in values:
        m, w = (1 - alpha) * m + alpha * v, (1 - alpha) * w + alpha
        out.append(m / w)
    return out


def plot_losses(metrics_path: Path, out_png: Path, title: str = "", warmup: int = 0) -> None:
    """loss.png. Top: train (per step and smoothed) and val bits per byte against step, with the
    compressors and the unigram model on the validation bytes drawn across (the `baselines` event).
    Bottom: each train loss over the lowest one so far, with the 1.5x spike limit and the first `warmup`
    steps shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [r for r in recs if r["kind"] == "train" and math.isfinite(r["loss"])]
    val = [(r["step"], r["val_bpb"]) for r in recs if r["kind"] == "eval"]
    base = next((r["bpb"] for r in recs if r.get("event") == "baselines"), {})
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(8, 6), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    if train:
        steps = [r["step"] for r in train]
        bpb = [r.get("bpb", r["loss"] / math.log(2)) for r in train]
        ax.plot(steps, bpb, lw=0.5, alpha=0.3, color="tab:blue", label="train (per step)")
        ax.plot(steps, ema(bpb), lw=1.6, color="tab:blue", label="train (smoothed)")
        ratio, low = [], math.inf
        for r in train:
            low = min(low, r["loss"])
            ratio.append(r["loss"] / low)
        ax2.plot(steps, ratio, lw=0.8, color="tab:blue")
        if warmup:
            ax2.axvspan(0, warmup, color="0.9", label="warm-up")
        ax2.axhline(1.5, color="tab:red", ls="--", lw=1, label="1.5x spike limit")
        ax2.set_ylim(0.95, max(1.6, min(3.0, max(ratio[len(ratio) // 10 :] or [1.0]) + 0.05)))
        ax2.set_ylabel("loss / running min")
        ax2.legend(loc="upper right", fontsize=8)
        ax2.grid(alpha=0.3)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", lw=1.8, color="tab:orange", label="val (held-out files)")
    colors = {"gzip -9": "tab:gray", "bz2 -9": "tab:brown", "xz -9e": "tab:red", "unigram": "tab:purple"}
    for name, v in sorted(base.items(), key=lambda kv: -kv[1]):
        ax.axhline(v, ls="--" if name == "xz -9e" else ":", lw=1.3, color=colors.get(name, "black"),
                   label=f"{name} on the val bytes: {v:.3f}")  # fmt: skip
    lows = [v for _, v in val] + list(base.values())
    if lows:
        ax.set_ylim(min(lows) - 0.25, max(base.get("unigram", 0.0), min(lows)) + 1.0)
    ax.set_ylabel("bits / byte")
    ax2.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    tmp = Path(out_png).with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out_png)


# ---- console ---------------------------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "--:--"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ProgressBar:
    """One live line on stderr (redrawn in place on a terminal; a plain line every `every` steps if not)."""

    def __init__(self, every: int = 10, stream=None, width: int = 24):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every, self.width = every, width

    def update(self, step: int, total: int | None, loss: float, tok_s: float, eta: float) -> None:
        if not self.tty and step % self.every and step != total:
            return
        frac = step / total if total else 0.0
        filled = int(self.width * min(frac, 1.0))
        bar = "#" * filled + "-" * (self.width - filled)
        tot = total if total else "?"
        line = f"[{bar}] step {step}/{tot}  loss {loss:.4f}  {tok_s:,.0f} tok/s  ETA {format_duration(eta)}"
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line above the bar (eval results, warnings)."""
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def summary_table(rows: list[tuple[str, str]], title: str = "summary") -> str:
    """A two-column markdown-style table."""
    w = max(len(k) for k, _ in rows)
    v = max(len(str(x)) for _, x in rows)
    lines = [f"| {title:<{w}} | {'':<{v}} |", f"|{'-' * (w + 2)}|{'-' * (v + 2)}|"]
    lines += [f"| {k:<{w}} | {str(x):<{v}} |" for k, x in rows]
    return "\n".join(lines)
