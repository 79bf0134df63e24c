"""`k3 ablate`: the K3 recipe against the K2 recipe and every single K3 component swapped back.

Each variant is a TrainConfig change (model switches from k3/config.py, or an optimizer switch); every
variant trains for the same steps on the same batches (same seeds) and is scored by validation bits per
byte. Results: ``<out>/results.jsonl`` (one line per run; an interrupted sweep skips finished runs when
restarted with the same --out), ``<out>/ablations.md`` (mean ± sample std over seeds) and
``<out>/ablations.png``.

| variant            | change from the K3 recipe                                                  |
|--------------------|----------------------------------------------------------------------------|
| K3                 | --                                                                         |
| K2                 | all of the rows below except AdamW: RoPE MLA, sign-update bias, SwiGLU,    |
|                    | plain residual, plain MoE, whole-matrix Muon                               |
| -NoPE              | mla_use_nope=False (RoPE on the MLA rope dims)                             |
| -QB                | bias_update="sign" (DeepSeek-V3 aux-loss-free sign update)                 |
| -SiTU              | hidden_act="silu" (SwiGLU)                                                 |
| -AttnRes           | use_attn_res=False (plain pre-norm residual)                               |
| -LatentMoE         | use_latent_moe=False (experts at full width)                               |
| -PerHeadMuon       | per_head=False (whole-matrix Muon)                                         |
| AdamW              | optimizer="adamw" (AdamW for every parameter)                              |

The default budget is the `k3 train` demo's: k3-mini, 450 steps of 16 x 256 tokens (1.8 M tokens,
what 10 minutes on 2 cores train), 3 seeds, 9 variants = 27 runs, two at a time on one thread each:
about 4 hours on 2 quiet CPU cores. --steps / --seeds / --variants / --preset / --vocab-size / --jobs
scale it (docs/training.md has a 27-minute k3-nano setting).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from k3.train.config import K2_MODEL, TrainConfig

VARIANTS: dict[str, tuple[str, dict, dict]] = {  # name -> (description, model overrides, train overrides)
    "K3": ("the K3 recipe", {}, {}),
    "K2": ("K2 recipe (all swaps below but AdamW)", K2_MODEL, {"per_head": False}),
    "-NoPE": ("RoPE MLA instead of NoPE", {"mla_use_nope": False}, {}),
    "-QB": ("sign-update bias instead of Quantile Balancing", {"bias_update": "sign"}, {}),
    "-SiTU": ("SwiGLU instead of SiTU-GLU", {"hidden_act": "silu"}, {}),
    "-AttnRes": ("plain residual instead of Block AttnRes", {"use_attn_res": False}, {}),
    "-LatentMoE": ("plain MoE instead of LatentMoE", {"use_latent_moe": False}, {}),
    "-PerHeadMuon": ("whole-matrix Muon instead of Per-Head Muon", {}, {"per_head": False}),
    "AdamW": ("AdamW instead of Muon", {}, {"optimizer": "adamw"}),
}


def ablation_base(**changes) -> TrainConfig:
    """The shared recipe of every variant (before its own switches): the `k3 train` demo's model and
    recipe at the demo's token count (450 steps of 16 x 256), each run on one thread."""
    base = TrainConfig(
        preset="k3-mini",
        steps=450,
        minutes=None,
        eval_every=0,
        save_every=0,
        keep=1,
        sample_tokens=0,
        parse_samples=0,
        log_every=50,
        threads=1,
    )
    return base.replace(**changes)


def variant_config(base: TrainConfig, name: str, seed: int, out: Path) -> TrainConfig:
    _, model, train = VARIANTS[name]
    return base.replace(
        model_overrides={**base.model_overrides, **model},
        seed=seed,
        out=str(out / "runs" / f"{name.lstrip('-')}-seed{seed}"),
        **train,
    )


def _done(results_path: Path) -> dict[tuple[str, int], dict]:
    if not results_path.exists():
        return {}
    recs = [json.loads(ln) for ln in results_path.read_text().splitlines() if ln.strip()]
    return {(r["variant"], r["seed"]): r for r in recs}


def _train_one(base: TrainConfig, name: str, seed: int, out: Path) -> dict:
    """One (variant, seed) run -> its result record (runs in a worker process with --jobs > 1)."""
    from k3.train.trainer import Trainer

    t0 = time.perf_counter()
    summary = Trainer(variant_config(base, name, seed, out), quiet=True).run(measure_peak=False)
    keys = ("val_bpb", "val_loss", "tokens", "tok_per_s", "params", "skipped_steps")
    seconds = time.perf_counter() - t0
    return {"variant": name, "seed": seed, **{k: summary[k] for k in keys}, "seconds": seconds}


def run_ablation(
    base: TrainConfig, variants: list[str], seeds: list[int], out: Path, jobs: int = 1, log=print
) -> list[dict]:
    """Train every (variant, seed) not already in results.jsonl, `jobs` at a time; returns all records."""
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = _done(results_path)
    todo = [(n, s) for s in seeds for n in variants if (n, s) not in done]

    def record(rec: dict) -> None:
        with results_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        done[(rec["variant"], rec["seed"])] = rec
        name, seed, bpb, sec = rec["variant"], rec["seed"], rec["val_bpb"], rec["seconds"]
        log(f"{name:>13} seed {seed}: val bpb {bpb:.4f}  ({sec:.0f} s)")

    if jobs <= 1:
        for n, s in todo:
            record(_train_one(base, n, s, out))
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_train_one, base, n, s, out) for n, s in todo]
            for fut in as_completed(futures):
                record(fut.result())
    return [done[(n, s)] for n in variants for s in seeds if (n, s) in done]


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def _paired_delta(rs: list[dict], ref: dict[int, float]) -> str:
    """Mean ± std over seeds of (variant - K3) at the same seed: the seeds share data order, so this
    removes the seed-to-seed spread that both runs have in common."""
    deltas = [r["val_bpb"] - ref[r["seed"]] for r in rs if r["seed"] in ref]
    if not deltas:
        return "—"
    mean, std = _stats(deltas)
    return f"{mean:+.4f} ± {std:.4f}" if not math.isnan(std) else f"{mean:+.4f}"


def results_table(results: list[dict], variants: list[str]) -> str:
    """Markdown table: variant, change, val bpb mean ± std, paired Δ vs K3 (mean ± std), seeds, params."""
    by = {n: [r for r in results if r["variant"] == n] for n in variants}
    ref = {r["seed"]: r["val_bpb"] for r in results if r["variant"] == "K3"}
    lines = [
        "| variant | change | val bpb (mean ± std) | Δ vs K3, same seed (mean ± std) | seeds | params |",
        "|---|---|---|---|---|---|",
    ]
    for n in variants:
        rs = by[n]
        if not rs:
            continue
        mean, std = _stats([r["val_bpb"] for r in rs])
        delta = "—" if n == "K3" else _paired_delta(rs, ref)
        lines.append(
            f"| {n} | {VARIANTS[n][0]} | {mean:.4f} ± {std:.4f} | {delta} | {len(rs)} | "
            f"{rs[0]['params'] / 1e6:.2f} M |"
        )
    return "\n".join(lines)


def plot_results(results: list[dict], variants: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in variants if any(r["variant"] == n for r in results)]
    stats = [_stats([r["val_bpb"] for r in results if r["variant"] == n]) for n in names]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    ax.bar(
        names,
        [m for m, _ in stats],
        yerr=[0 if math.isnan(s) else s for _, s in stats],
        capsize=4,
        color=["tab:green" if n == "K3" else "tab:gray" for n in names],
    )
    lo = min(m for m, _ in stats)
    ax.set_ylim(lo * 0.97, max(m for m, _ in stats) * 1.02)
    ax.set_ylabel("val bits / byte (lower is better)")
    ax.tick_params(axis="x", rotation=30)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- CLI -------------------------------------------------------------------------------------------


def add_ablate_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Train K3 recipe variants at equal tokens and seeds; write a table and a plot."
    p.add_argument("--out", default=None, help="output directory (default runs/ablate-<timestamp>)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--preset", default=None, help="model preset (default k3-mini)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--data", default=None, help="corpus (default: the stdlib)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 450)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each (default 2)")


def run_from_args(args: argparse.Namespace) -> int:
    from datetime import datetime

    keys = ("preset", "vocab_size", "data", "steps", "seq_len", "batch_size", "lr")
    base = ablation_base(**{k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    if args.jobs < 1:
        raise ValueError(f"jobs: must be >= 1, got {args.jobs}")
    out = Path(args.out or f"runs/ablate-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    results = run_ablation(base, args.variants, args.seeds, out, jobs=args.jobs)
    table = results_table(results, args.variants)
    setup = (
        f"{base.preset} (vocab {base.model_config().vocab_size}), {base.steps} steps x {base.batch_size} x "
        f"{base.seq_len} tokens, seeds {args.seeds}, data {base.data or 'stdlib'}"
    )
    (out / "ablations.md").write_text(f"# Ablations\n\n{setup}\n\n{table}\n")
    plot_results(results, args.variants, out / "ablations.png")
    print(f"{setup}\n\n{table}\n\nwrote {out / 'ablations.md'} and {out / 'ablations.png'}")
    return 0
