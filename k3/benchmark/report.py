"""What `k3 bench` writes: bench.json (every result + the machine), bench.md (the table) and the plots.

bench.md has one row per figure: bench | figure | value | peer / limit | ratio | goal | met. A bench that
failed gets one row saying how (exit code, timeout, unreadable JSON) instead of its figures.

Plots (matplotlib, Agg): ratios.png -- every figure's ratio with its goal, log scale; and one PNG per
entry of a result's optional "plots" list, which a bench fills with the curves it wants drawn:

    "plots": [{"name": "memory", "title": ..., "xlabel": ..., "ylabel": ..., "logx": true, "logy": false,
               "series": [{"label": "measured", "x": [...], "y": [...], "style": "o-"}, ...]}]
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import subprocess
from pathlib import Path

from k3.benchmark.suite import BenchRun

COLUMNS = ("bench", "figure", "value", "peer / limit", "ratio", "goal", "met")


# ---- the machine ----------------------------------------------------------------------------------


def machine_info(repo: Path | None = None, threads: int | None = None) -> dict:
    """CPU model, cores, threads, memory, torch/python versions, date, git commit of `repo`. `threads`:
    the OMP_NUM_THREADS the benches get, when it is set for them rather than inherited."""
    import torch

    cpu = _cpuinfo()
    info = {
        "cpu": cpu.get("model name", platform.processor() or platform.machine()),
        "logical_cores": os.cpu_count(),
        "physical_cores": cpu.get("physical_cores"),
        "torch_threads": threads or torch.get_num_threads(),
        "omp_num_threads": str(threads) if threads else os.environ.get("OMP_NUM_THREADS"),
        "memory_gib": _mem_gib(),
        "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if repo is not None:
        info["git_commit"] = _git_commit(repo)
    return info


def _cpuinfo() -> dict:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out, cores = {}, set()
    phys = core = None
    for line in text.splitlines():
        key, _, val = (s.strip() for s in line.partition(":"))
        if key == "model name":
            out.setdefault("model name", val)
        elif key == "physical id":
            phys = val
        elif key == "core id":
            core = val
        elif not key and core is not None:
            cores.add((phys, core))
            phys = core = None
    if core is not None:
        cores.add((phys, core))
    out["physical_cores"] = len(cores) or None
    return out


def _mem_gib() -> float | None:
    try:
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        return None


def _git_commit(repo: Path) -> str | None:
    try:
        cmd = ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def describe_machine(m: dict) -> str:
    cores = f"{m['logical_cores']} logical cores" + (
        f" ({m['physical_cores']} physical)" if m.get("physical_cores") else ""
    )
    threads = f"{m['torch_threads']} torch threads" + (
        f" (OMP_NUM_THREADS={m['omp_num_threads']})" if m.get("omp_num_threads") else ""
    )
    parts = [m["cpu"], cores, threads]
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']} GiB RAM")
    if m.get("cuda"):
        parts.append(m["cuda"])
    parts += [f"torch {m['torch']}", f"python {m['python']}"]
    if m.get("load_average") is not None:
        parts.append(f"load average {m['load_average']} at the start")
    text = ", ".join(parts) + f"; {m['date']}"
    return text + (f", commit {m['git_commit']}" if m.get("git_commit") else "")


# ---- bench.json / bench.md ------------------------------------------------------------------------


def suite_json(runs: list[BenchRun], machine: dict, command: str, quick: bool) -> dict:
    return {
        "command": command,
        "quick": quick,
        "machine": machine,
        "ok": all(r.ok for r in runs),
        "benches": [
            {
                "name": r.name,
                "ok": r.ok,
                "error": r.error,
                "seconds": round(r.seconds, 2),
                "returncode": r.returncode,
                "command": r.command,
                "log": str(r.log),
                "result": r.result,
            }
            for r in runs
        ],
    }


def fmt_number(x) -> str:
    """3 significant digits, thousands separators for big numbers; '' for None."""
    if x is None:
        return ""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return str(x)
    if not math.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) >= 1e7 or abs(x) < 1e-3):
        return f"{x:.3g}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def _with_unit(x, unit: str) -> str:
    s = fmt_number(x)
    return f"{s} {unit}".strip() if s and unit else s


def figure_row(bench: str, f: dict) -> list[str]:
    peer = f.get("peer") or ""
    pv = _with_unit(f.get("peer_value"), f.get("peer_unit", f.get("unit", "")))
    peer_cell = f"{peer}: {pv}" if peer and pv else (peer or pv)
    ratio = f.get("ratio")
    goal = f.get("goal")
    goal_cell = ""
    if goal is not None:
        op = f.get("goal_op", ">=")
        goal_cell = f"within {fmt_number(100 * goal)} % of 1" if op == "~" else f"{op} {fmt_number(goal)}"
    met = {True: "yes", False: "**no**", None: ""}[f.get("goal_met")]
    ratio_cell = f"{fmt_number(ratio)}" if ratio is not None else ""
    value = _with_unit(f.get("value"), f.get("unit", ""))
    return [bench, str(f["figure"]), value, peer_cell, ratio_cell, goal_cell, met]


def markdown_table(runs: list[BenchRun]) -> str:
    rows = [list(COLUMNS), ["---"] * len(COLUMNS)]
    for r in runs:
        if not r.ok:
            rows.append([r.name, f"**FAILED** ({r.error}; log: {r.log.name})", "", "", "", "", ""])
            continue
        if not r.figures:
            rows.append([r.name, "(no figures reported)", "", "", "", "", ""])
        rows += [figure_row(r.name, f) for f in r.figures]
    return "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows)


def markdown_report(runs: list[BenchRun], machine: dict, command: str) -> str:
    failed = [r.name for r in runs if not r.ok]
    missed = [f"{r.name}: {f['figure']}" for r in runs for f in r.figures if f.get("goal_met") is False]
    lines = [
        "# k3 bench",
        "",
        f"command: `{command}`  ",
        f"machine: {describe_machine(machine)}",
        "",
        markdown_table(runs),
        "",
        "ratio: the figure against its peer or limit measured in the same run (see docs/benchmarks.md); "
        "goal: what the ratio should reach.",
    ]
    if failed:
        lines.append(f"\nFAILED: {', '.join(failed)} (see logs/).")
    if missed:
        lines.append(f"\nGoals not met: {'; '.join(missed)}.")
    times = ", ".join(f"{r.name} {r.seconds:.0f} s" for r in runs)
    lines.append(f"\nwall time per bench: {times}.")
    return "\n".join(lines) + "\n"


# ---- plots ----------------------------------------------------------------------------------------


def pyplot():
    try:
        import matplotlib
    except ImportError as e:  # a core dependency, but say what to do if it went missing
        raise ValueError("k3 bench needs matplotlib for its plots: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ratios(runs: list[BenchRun], path: Path) -> Path | None:
    """Horizontal bars: each figure's ratio (green: goal met, red: missed, grey: no goal), goal ticks."""
    items = [(f"{r.name}: {f['figure']}", f) for r in runs for f in r.figures if _positive(f.get("ratio"))]
    if not items:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(items) + 1.4), dpi=110)
    colors = {True: "tab:green", False: "tab:red", None: "tab:gray"}
    for i, (_, f) in enumerate(items):
        ax.barh(i, f["ratio"], color=colors[f.get("goal_met")], alpha=0.8)
        goal, op = f.get("goal"), f.get("goal_op", ">=")
        if goal is not None and op == "~":
            ax.plot([1 - goal, 1 + goal], [i, i], "k-", lw=3, alpha=0.6)
        elif _positive(goal):
            ax.plot([goal], [i], "k|", ms=18, mew=2)
        ax.text(f["ratio"], i, f" {fmt_number(f['ratio'])}", va="center", fontsize=8)
    ax.set_yticks(range(len(items)), [n if len(n) < 60 else n[:57] + "..." for n, _ in items], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.6)
    ax.set_xlabel("ratio vs peer / limit (log scale); black tick: goal")
    ax.set_title("k3 bench: ratios against peers measured in the same run")
    ax.grid(axis="x", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_curves(bench: str, spec: dict, path: Path) -> Path | None:
    """One of a result's "plots" entries (see the module doc)."""
    series = [s for s in spec.get("series", []) if s.get("x") and s.get("y")]
    if not series:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for s in series:
        ax.plot(s["x"], s["y"], s.get("style", "o-"), label=s.get("label", ""), lw=1.4, ms=4)
    if spec.get("logx"):
        ax.set_xscale("log")
    if spec.get("logy"):
        ax.set_yscale("log")
    ax.set_xlabel(spec.get("xlabel", ""))
    ax.set_ylabel(spec.get("ylabel", ""))
    ax.set_title(spec.get("title", bench))
    ax.grid(alpha=0.3, which="both")
    if any(s.get("label") for s in series):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _positive(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def write_outputs(runs: list[BenchRun], machine: dict, command: str, quick: bool, out: Path) -> list[Path]:
    """bench.json, bench.md and the plots under `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    p = out / "bench.json"
    p.write_text(json.dumps(suite_json(runs, machine, command, quick), indent=2) + "\n")
    written.append(p)
    p = out / "bench.md"
    p.write_text(markdown_report(runs, machine, command))
    written.append(p)
    if (p := plot_ratios(runs, out / "ratios.png")) is not None:
        written.append(p)
    for r in runs:
        for i, spec in enumerate((r.result or {}).get("plots") or []):
            name = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(spec.get("name", i)))
            if (p := plot_curves(r.name, spec, out / f"{r.name}_{name}.png")) is not None:
                written.append(p)
    return written
