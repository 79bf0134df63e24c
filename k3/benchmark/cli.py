"""`k3 bench`: run the benchmark suite and write bench.json, bench.md and plots.

    k3 bench                                   # every bench, full settings (tens of minutes on a CPU)
    k3 bench --quick --only prefix_cache,training --out runs/bench-quick

Each bench runs as `python bench/NAME.py --json OUT/raw/NAME.json [--quick]` with its output in
OUT/logs/NAME.log; a bench that fails is a FAILED row in the table and makes the exit code 1.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from k3.benchmark.report import describe_machine, machine_info, pyplot, write_outputs
from k3.benchmark.suite import BENCHES, find_bench_dir, run_bench, select


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(b.name for b in BENCHES)
    p.description = (
        f"Run the benchmark suite ({names}; each bench a subprocess) and write OUT/bench.json, OUT/bench.md "
        "and plots. A failed bench is a FAILED row and makes the exit code 1. See docs/benchmarks.md."
    )
    p.add_argument("--only", metavar="NAMES", help=f"comma-separated subset of: {names}")
    p.add_argument("--quick", action="store_true", help="small settings: a smoke run, not figures to quote")
    p.add_argument("--out", metavar="DIR", help="output folder (default: runs/bench-<date>-<time>)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the benches (default: inherited)")
    p.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds per bench before it fails (default 3600)"
    )
    p.add_argument("--bench-dir", metavar="DIR", help="the bench/ scripts folder (default: the checkout's)")
    p.add_argument("--list", action="store_true", help="list the benches and exit")


def run(args: argparse.Namespace) -> int:
    if args.list:
        for b in BENCHES:
            print(f"{b.name:14s} {b.what}")
        return 0
    benches = select(args.only)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {args.threads}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout: must be > 0, got {args.timeout}")
    bench_dir = find_bench_dir(args.bench_dir)
    pyplot()  # fail before the benches, not after them, if matplotlib is missing
    out = Path(args.out) if args.out else Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)} if args.threads else {}
    command = _command_line(args, out)
    machine = machine_info(bench_dir.parent, threads=args.threads)
    print(f"machine: {describe_machine(machine)}")
    print(f"output: {out}")
    runs = []
    for i, bench in enumerate(benches, 1):
        print(f"[{i}/{len(benches)}] {bench.name}: {bench.what} ...", flush=True)
        tick = lambda s, line, b=bench.name: print(f"      {b}: {s:.0f} s ... {line[:100]}", flush=True)
        r = run_bench(bench, bench_dir, out, quick=args.quick, timeout=args.timeout, env=env, heartbeat=tick)
        status = "ok" if r.ok else f"FAILED: {r.error}"
        print(f"[{i}/{len(benches)}] {bench.name}: {status} ({r.seconds:.0f} s, log {r.log})", flush=True)
        runs.append(r)
    written = write_outputs(runs, machine, command, args.quick, out)
    print((out / "bench.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written))
    failed = [r.name for r in runs if not r.ok]
    if failed:
        print(f"k3 bench: {len(failed)} bench(es) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _command_line(args: argparse.Namespace, out: Path) -> str:
    """The equivalent `k3 bench ...` line (for the report)."""
    parts = ["k3", "bench"]
    if args.only:
        parts += ["--only", args.only]
    if args.quick:
        parts.append("--quick")
    if args.threads:
        parts += ["--threads", str(args.threads)]
    if args.timeout != 3600.0:
        parts += ["--timeout", f"{args.timeout:g}"]
    if args.bench_dir:
        parts += ["--bench-dir", args.bench_dir]
    return shlex.join([*parts, "--out", str(out)])
