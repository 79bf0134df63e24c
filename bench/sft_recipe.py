"""The SFT half of the recipe, measured: fine-tune a pretrained run on the embedded stdlib task and score
the F32 model and its MXFP4 release as agents through `k3 serve`, for several seeds and variants.

    k3 train --out runs/demo                                  # the 10-minute pretraining demo
    python bench/sft_recipe.py runs/demo --out runs/sft-recipe --results docs/results/sft.json

Variants (each with `k3 sft`'s defaults otherwise):
    qat          the default: QAT (MXFP4 experts, MXFP8 activations) from the first step
    ptq          `--qat none`: trained in F32, quantized only after training (post-training quantization)
    empty        `--no-preserve-thinking`: earlier turns' thinking rendered empty (evaluated the same way)

For each run: `k3 sft`, `k3 eval-agent RUN`, `k3 quantize RUN RUN-mxfp4`, `k3 eval-agent RUN-mxfp4`; every
command's output is kept in OUT/logs/. The results file holds each run's figures and a table (docs/sft.md
quotes it through k3.benchmark.docs_figures). Runs already evaluated in OUT are read, not redone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

VARIANTS = {
    "qat": ([], []),
    "ptq": (["--qat", "none"], []),
    "empty": (["--no-preserve-thinking"], ["--no-preserve-thinking"]),
}
SCORES = ("valid_json", "right_call", "correct")
LABELS = {
    "qat": "QAT from step 0 (default)",
    "ptq": "no QAT, quantized after",
    "empty": "earlier thinking empty",
}


def run(cmd: list[str], log: Path) -> float:
    """Run `cmd` with its output in `log`; -> seconds. A failure names the command and its log."""
    t0 = time.perf_counter()
    print(f"$ {' '.join(cmd)}", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"{cmd[0]} {cmd[1]} failed (exit {rc}); see {log}")
    dt = time.perf_counter() - t0
    print(f"  {dt:.0f} s", flush=True)
    return dt


def one(pre: str, out: Path, variant: str, seed: int, extra: list[str], conversations: int) -> dict:
    """Fine-tune, quantize and evaluate one (variant, seed); -> its figures (cached in its folder)."""
    name = f"{variant}-s{seed}"
    ckpt, rel, logs = out / name, out / f"{name}-mxfp4", out / "logs"
    done = out / f"{name}.json"
    if done.is_file():
        return json.loads(done.read_text())
    logs.mkdir(parents=True, exist_ok=True)
    sft_flags, eval_flags = VARIANTS[variant]
    k3 = [sys.executable, "-m", "k3.cli"]
    sft_s = run(
        [*k3, "sft", pre, "--out", str(ckpt), "--seed", str(seed), *sft_flags, *extra],
        logs / f"{name}-sft.log",
    )
    evals = {}
    for tag, path in (("f32", ckpt), ("mxfp4", rel)):
        if tag == "mxfp4":
            run([*k3, "quantize", str(ckpt), str(rel)], logs / f"{name}-quantize.log")
        scores = out / f"{name}-{tag}-agent.json"
        run([*k3, "eval-agent", str(path), "--conversations", str(conversations), "--json", str(scores),
             *eval_flags], logs / f"{name}-{tag}-eval.log")  # fmt: skip
        evals[tag] = {k: v for k, v in json.loads(scores.read_text()).items() if k != "transcripts"}
    summary = json.loads((ckpt / "summary.json").read_text())
    rec = {"variant": variant, "seed": seed, "sft_seconds": sft_s, "steps": summary.get("steps"),
           "heldout_loss": summary.get("val_loss"), **evals}  # fmt: skip
    done.write_text(json.dumps(rec, indent=1))
    return rec


def machine() -> str:
    model = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    load = os.getloadavg()[0]
    return f"{os.cpu_count()}-core {model}, CPython {platform.python_version()}, load {load:.1f} at the end"


def results(recs: list[dict], command: str) -> dict:
    """The results file: one figure per (run, score) and the table docs/sft.md shows."""
    figures, rows = {}, []
    for r in recs:
        key = f"{r['variant']}_s{r['seed']}"
        figures[f"{key}_minutes"] = {"value": r["sft_seconds"] / 60, "fmt": "{:.1f}"}
        figures[f"{key}_steps"] = {"value": r["steps"]}
        for tag in ("f32", "mxfp4"):
            for s in SCORES:
                figures[f"{key}_{tag}_{s}"] = {"value": 100 * r[tag][s], "fmt": "{:.1f} %"}
            model = "F32" if tag == "f32" else "MXFP4 release"
            cells = [f"{{{key}_{tag}_{s}}}" for s in SCORES]
            rows.append(
                [
                    LABELS[r["variant"]],
                    str(r["seed"]),
                    model,
                    f"{{{key}_steps}}, {{{key}_minutes}} min",
                    *cells,
                ]
            )
    qat = [r for r in recs if r["variant"] == "qat"]
    for tag in ("f32", "mxfp4"):
        for s in SCORES:
            if qat:
                figures[f"qat_median_{tag}_{s}"] = {
                    "value": 100 * statistics.median(r[tag][s] for r in qat),
                    "fmt": "{:.1f} %",
                }
    header = ["variant", "seed", "model", "SFT steps, wall", "valid tool-call JSON", "right function + args",
              "answered correctly"]  # fmt: skip
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "command": command,
        "commit": commit or "?",
        "machine": machine(),
        "date": date.today().isoformat(),
        "figures": figures,
        "tables": {"runs": {"header": header, "rows": rows}},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pretrained", help="the pretrained run (k3 train --out DIR)")
    p.add_argument("--out", required=True, help="folder for the runs, their scores and logs")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the default variant")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--variant-seeds", type=int, nargs="+", default=[0], help="seeds of the other variants")
    p.add_argument("--conversations", type=int, default=100, help="held-out conversations per evaluation")
    p.add_argument("--results", help="write the results file here (e.g. docs/results/sft.json)")
    p.add_argument("--threads", type=int, default=2, help="`k3 sft --threads` (default 2)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recs = []
    for v in args.variants:
        for seed in args.seeds if v == "qat" else args.variant_seeds:
            rec = one(args.pretrained, out, v, seed, ["--threads", str(args.threads)], args.conversations)
            f32, mx = rec["f32"], rec["mxfp4"]
            print(f"{v} seed {seed}: {rec['steps']} steps in {rec['sft_seconds'] / 60:.1f} min; "
                  + "; ".join(f"{t}: JSON {d['valid_json']:.1%}, call {d['right_call']:.1%}, "
                              f"answered {d['correct']:.1%}" for t, d in (("F32", f32), ("MXFP4", mx))),
                  flush=True)  # fmt: skip
            recs.append(rec)
    if args.results:
        seeds = " ".join(map(str, args.seeds))
        command = (
            f"python bench/sft_recipe.py PRETRAINED --out OUT --seeds {seeds} "
            f"--variants {' '.join(args.variants)} --threads {args.threads} "
            f"--conversations {args.conversations}"
        )
        Path(args.results).write_text(json.dumps(results(recs, command), indent=1) + "\n")
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
