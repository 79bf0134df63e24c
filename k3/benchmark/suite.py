"""The benches `k3 bench` runs, and running them: each one is `python bench/NAME.py --json F [args]` in a
subprocess (a fresh interpreter: no bench's threads, allocator or compiled kernels leak into the next),
its output going to a log file, its figures read back from F.

bench/ is not part of the installed package; it is found next to the package of a source checkout
(`pip install -e .`), or given with --bench-dir.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from k3.benchmark.result import load_result

HEARTBEAT_S = 30.0  # seconds between progress lines of a running bench


@dataclass(frozen=True)
class Bench:
    name: str  # bench/<name>.py
    what: str
    quick: tuple[str, ...] = ("--quick",)  # extra arguments under `k3 bench --quick`


BENCHES: tuple[Bench, ...] = (
    Bench("kda", "KDA chunk op vs the transformers kimi_linear torch fallback",
          ("--T", "1024", "--reps", "3", "--hf-reps", "1")),
    Bench("engine", "whole-model prefill / decode / batch throughput vs transformers KimiLinear",
          ("--prompt", "256", "--new", "16", "--batch", "8")),
    Bench("training", "training tokens/s and MFU vs a torch.matmul peak"),
    Bench("prefix_cache", "multi-turn agent session: cache reuse and TTFT vs cache off"),
    Bench("long_context", "chunked-prefill peak memory vs the analytic bound"),
    Bench("vs_llamacpp", "prefill / decode / serving vs llama.cpp's kimi-k3 on the same weights, roofline"),
)  # fmt: skip


@dataclass
class BenchRun:
    """The outcome of one bench: its normalised result, or why it failed."""

    name: str
    command: list[str]
    seconds: float
    returncode: int | None  # None: timed out
    log: Path
    result: dict | None = None
    error: str | None = None
    figures: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


def find_bench_dir(bench_dir: str | Path | None = None) -> Path:
    """The bench/ folder: `bench_dir` if given, else <source checkout>/bench next to the k3 package."""
    if bench_dir is not None:
        path = Path(bench_dir)
        if not path.is_dir():
            raise ValueError(f"--bench-dir: {path} is not a directory")
        return path
    import k3

    path = Path(k3.__file__).resolve().parent.parent / "bench"
    if not path.is_dir():
        raise ValueError(
            f"bench scripts not found at {path}: `k3 bench` runs the scripts of a source checkout's bench/ "
            "folder, which a regular install does not carry; install from the repository with "
            "`pip install -e .` or pass --bench-dir"
        )
    return path


def select(names: str | None, available: tuple[Bench, ...] = BENCHES) -> list[Bench]:
    """`--only a,b` -> those benches in suite order; ValueError naming an unknown one."""
    if not names:
        return list(available)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {b.name for b in available}
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise ValueError(f"--only: unknown bench(es) {unknown or names!r}; known: {', '.join(sorted(known))}")
    return [b for b in available if b.name in wanted]


def run_bench(
    bench: Bench,
    bench_dir: Path,
    out: Path,
    quick: bool = False,
    timeout: float | None = None,
    env: dict | None = None,
    heartbeat: Callable[[float, str], None] | None = None,
) -> BenchRun:
    """Run one bench script; never raises for the bench's own failure (it is recorded in the run).
    `heartbeat(seconds, last log line)` is called every HEARTBEAT_S while it runs (progress)."""
    script = bench_dir / f"{bench.name}.py"
    raw, log = out / "raw" / f"{bench.name}.json", out / "logs" / f"{bench.name}.log"
    raw.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    raw.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), "--json", str(raw), *(bench.quick if quick else ())]
    t0 = time.perf_counter()
    if not script.is_file():
        log.write_text(f"no script {script}\n")
        return BenchRun(bench.name, cmd, 0.0, None, log, error=f"no script {script}")
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

        def tick() -> None:
            if heartbeat is not None:
                heartbeat(time.perf_counter() - t0, _last_line(log))

        code = _wait(proc, t0, timeout, tick)
    run = BenchRun(bench.name, cmd, time.perf_counter() - t0, code, log)
    if code is None:
        run.error = f"timed out after {timeout:g} s"
    elif code != 0:
        run.error = f"exit code {code}: {_last_line(log)}"
    else:
        try:
            run.result = load_result(raw, bench.name)
            run.figures = run.result["figures"]
        except ValueError as e:
            run.error = str(e)
    return run


def _wait(proc: subprocess.Popen, t0: float, timeout: float | None, tick) -> int | None:
    """The exit code, or None after killing a process that ran past `timeout` seconds."""
    while True:
        left = None if timeout is None else timeout - (time.perf_counter() - t0)
        if left is not None and left <= 0:
            proc.kill()
            proc.wait()
            return None
        try:
            return proc.wait(timeout=HEARTBEAT_S if left is None else min(HEARTBEAT_S, left))
        except subprocess.TimeoutExpired:
            if left is None or left > HEARTBEAT_S:
                tick()


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:200] if len(lines) > 1 else "(no output)"
