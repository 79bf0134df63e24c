"""The 10-minute demo (`k3 train`, the README's first command) on several seeds, as docs/results/demo.json.

    python bench/demo.py --seeds 0,1,2 --out runs/demo --json docs/results/demo.json    # ~35 min, 2 cores
    python bench/demo.py --collect runs/demo/seed0,runs/demo/seed1 --json out.json       # finished runs

Each seed runs `k3 train --seed S --out OUT/seedS` in a subprocess, timed from start to exit (the
whole command: set-up, 10 minutes of training, final evaluation, samples, plots). The figures come from
each run's summary.json: val bits per byte on the whole held-out split, steps and tokens, tokens/s and
MFU against the matmul peak the run measured, the parse fraction of the sampled code and the
compressors' bits per byte on the same bytes. Goals (docs/training.md): every seed <= 1.42 bits/byte,
median <= 1.38, parse fraction >= 85 %, whole command <= 10 min 45 s. Run it on an otherwise idle
machine: the runs are bounded by time, so anything sharing the cores costs them steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOALS = {"bpb_max": 1.42, "bpb_median": 1.38, "parse_min": 0.85, "wall_max_s": 645.0}


def run_seed(seed: int, out: Path, extra: list[str]) -> float:
    """`k3 train --seed seed --out out` with its output in out.log; returns the wall seconds."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "k3", "train", "--seed", str(seed), "--out", str(out), *extra]
    t0 = time.perf_counter()
    with open(f"{out}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"seed {seed}: `{' '.join(cmd)}` exited with {rc} (see {out}.log)")
    (out / "wall_seconds.txt").write_text(f"{wall:.1f}\n")
    return wall


def seed_figures(run: Path) -> dict:
    """What the docs quote of one finished run (its summary.json and wall_seconds.txt)."""
    s = json.loads((run / "summary.json").read_text())
    wall = run / "wall_seconds.txt"
    return {
        "bpb": s["val_bpb"],
        "steps": s["steps"],
        "tokens": s["tokens"],
        "tok_s": s["tok_per_s"],
        "mfu": s["mfu"],
        "peak_gflops": s["peak_flops"] / 1e9,
        "parse": s["parse_fraction"],
        "parsed": s["parsed_blocks"],
        "sampled": s["sampled_blocks"],
        "spike": s["spike_ratio"],
        "wall_s": float(wall.read_text()) if wall.is_file() else None,
        "baselines": s["baselines_bpb"],
        "val_bytes": s["val_bytes"],
    }


def docs_results(runs: dict[int, dict], command: str, machine: dict) -> dict:
    """docs/results' form (k3.benchmark.docs_figures): provenance, per-seed figures and the table."""
    figs, cols = {}, sorted(runs)
    fmt = {"bpb": "{:.3f}", "steps": "{:,}", "tokens": "{:,}", "tok_s": "{:,.0f}", "mfu": "{:.1%}",
           "peak_gflops": "{:.0f}", "parse": "{:.0%}", "parsed": "{:,}", "sampled": "{:,}", "spike": "{:.2f}",
           "wall_s": "{:.0f}"}  # fmt: skip
    for seed, r in runs.items():
        for key, f in fmt.items():
            if r[key] is not None:
                figs[f"{key}_seed{seed}"] = {"value": r[key], "fmt": f}
        m, s = divmod(round(r["wall_s"] or 0), 60)
        figs[f"wall_seed{seed}"] = {"value": f"{m}:{s:02d}", "fmt": "{}"}
    bpbs = [runs[s]["bpb"] for s in cols]
    figs["bpb_median"] = {"value": statistics.median(bpbs), "fmt": "{:.3f}"}
    figs["bpb_max"] = {"value": max(bpbs), "fmt": "{:.3f}"}
    base = runs[cols[0]]["baselines"]
    for name, key in (("gzip -9", "gzip"), ("bz2 -9", "bz2"), ("xz -9e", "xz"), ("unigram", "unigram")):
        figs[key] = {"value": base[name], "fmt": "{:.3f}"}
    figs["val_bytes"] = {"value": runs[cols[0]]["val_bytes"], "fmt": "{:,}"}
    row = lambda label, key: [label, *(f"{{{key}_seed{s}}}" for s in cols)]  # noqa: E731
    rows = [
        row("steps", "steps"),
        row("tokens (16 × 256 per step)", "tokens"),
        row("tokens / s", "tok_s"),
        row("MFU (against the matmul peak of the same run)", "mfu"),
        row("matmul peak, GFLOP/s", "peak_gflops"),
        row("**val bits / byte** (every held-out byte)", "bpb"),
        row("sampled top-level blocks that parse", "parse"),
        row("max train loss after warm-up / running min", "spike"),
        row("wall time of the whole command (m:ss)", "wall"),
    ]
    cpu = machine.get("cpu", "?")
    return {
        "command": command,
        "commit": machine.get("git_commit"),
        "machine": f"{machine.get('logical_cores')}-core {cpu}, 2 threads, CPython {machine.get('python')}",
        "date": str(machine.get("date"))[:10],
        "goals": GOALS,
        "figures": figs,
        "tables": {"main": {"header": ["", *(f"seed {s}" for s in cols)], "rows": rows}},
        "raw": {str(s): r for s, r in runs.items()},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds to run")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="folder of the runs (OUT/seedS)")
    p.add_argument("--collect", default=None, help="comma-separated finished run folders instead of running")
    p.add_argument("--json", type=Path, default=None, help="write docs/results' form here")
    a, extra = p.parse_known_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from k3.benchmark.report import machine_info

    machine = machine_info(Path(__file__).resolve().parent.parent, threads=2)
    runs: dict[int, dict] = {}
    if a.collect:
        for folder in a.collect.split(","):
            run = Path(folder)
            seed = json.loads((run / "train_config.json").read_text()).get("seed", len(runs))
            runs[seed] = seed_figures(run)
        command = "k3 train --seed S (collected: " + a.collect + ")"
    else:
        for seed in (int(s) for s in a.seeds.split(",")):
            load = os.getloadavg()[0]
            wall = run_seed(seed, a.out / f"seed{seed}", extra)
            runs[seed] = seed_figures(a.out / f"seed{seed}")
            print(
                f"seed {seed}: {runs[seed]['bpb']:.4f} bits/byte, {wall:.0f} s (load {load:.2f} at the start)"
            )
        command = "; ".join(f"k3 train --seed {s}" for s in runs)
    bpbs = [r["bpb"] for r in runs.values()]
    print(f"bits/byte: {', '.join(f'{b:.4f}' for b in bpbs)}; median {statistics.median(bpbs):.4f}")
    if a.json:
        a.json.write_text(json.dumps(docs_results(runs, command, machine), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
