"""k3 vs llama.cpp's kimi-k3 on the same weights, the same threads and the same machine, in one run.

    python bench/vs_llamacpp.py --json out.json --plot vs.png       # k3-tiny + k3-small, 1 and 2 threads
    python bench/vs_llamacpp.py --checkpoint runs/demo --presets ''  # a trained run's weights
    python bench/vs_llamacpp.py --quick                             # a smoke run (minutes)

Weights: each preset with seeded random init (speed does not depend on what the weights are; the
perplexities are then those of an untrained model, compared between formats), or --checkpoint; written
once as k3 checkpoints (f32; mxfp4 = routed experts MXFP4-packed, the rest f32) and as GGUFs (f32, q8_0,
mxfp4) of the same tensors (bench/same_weights.py).

Same file: at the format thread counts k3 also loads each GGUF llama.cpp runs (`gguf:bf16`, `gguf:q8_0`,
`gguf:mxfp4`, `gguf:mxfp4_moe`; k3.export.gguf_read: BF16 stays bf16, MXFP4 experts stay packed, Q8_0
is widened to f32), and each such row compares the two engines on the very same file (--no-same-file
skips them).

llama.cpp (bench/peers/llamacpp.sh builds it) is run through its own C++ tools, no Python in its loop:
`llama-bench -p 512,4096 -n 0` (prefill: the prompt fed in batches, no sampling) and `llama-bench -p 0
-n 256 -d 512` (decode: 256 one-token steps after a 512-token context, whose prefill is not timed), one
repetition per call (after its own warm-up run); `llama-server --parallel N` (continuous batching) for
serving. k3: its engine in a worker process (bench/engine_worker.py: the compiled batch-1 decode step)
and `k3 serve` as a subprocess. Threads: llama.cpp's -t / -tb, k3's OMP_NUM_THREADS and
torch.set_num_threads set equal; with fewer threads than cores both are pinned (taskset) to the same
cores. Each round times k3 and llama.cpp in turn (which goes first alternates); the figure is the
median of the rounds, with min and max beside it.

Serving: one client (k3.serve.loadgen.burst) sends N concurrent streamed greedy completions (P random
prompt tokens, exactly M output tokens: ignore_eos) to each server; a short warm-up round per server
(every slot once) is not counted; every round uses new prompts, the same for both servers. Figures:
output tokens/s, p50 / p99 time to first token.

Roofline (bench/roofline.py): the read bandwidth measured in this run, over the bytes one decode token
must touch in each side's own storage (active weights, KDA state, MLA latents at the mean decode
context); each side's decode is reported as a fraction of its bound.

Perplexity of every format on held-out tokens (the stdlib corpus's validation split), the k3 formats in
k3, the GGUFs in llama.cpp (its bindings' logits), beside the speed of that format.

Goals (2 threads, f32 both sides): prefill >= 2x, decode >= 1.2x, serving throughput >= 2x llama.cpp;
k3-small decode >= 60 % of the roofline. The machine must be otherwise idle: llama.cpp's threads
spin-wait, so other load slows it far more than k3; the load average is printed and kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers.llamacpp import LlamaCppPeer  # noqa: E402
from roofline import gguf_bytes, k3_bytes, read_bandwidth, roofline  # noqa: E402
from same_weights import K3_FORMATS, default_workdir, k3_perplexity, llama_perplexity, prepare  # noqa: E402
from server_process import Server, free_port  # noqa: E402

from k3.serve.loadgen import burst  # noqa: E402

PEER = "llama.cpp kimi-k3"
GOALS = dict(prefill=2.0, decode=1.2, serve_tok_s=2.0, roofline=0.6)
QUICK = dict(
    presets="k3-tiny",
    threads="2",
    reps=1,
    prefill="128,512",
    decode_context=128,
    decode_new=32,
    serve_requests=8,
    serve_prompt=64,
    serve_new=16,
    serve_reps=1,
    ppl_positions=256,
    ppl_ctx=128,
    bandwidth_gib=0.5,
)


LOADS: list[float] = []  # the 1-minute load average at every progress line


def log(msg: str) -> None:
    LOADS.append(os.getloadavg()[0])
    print(f"[{time.strftime('%H:%M:%S')} load {LOADS[-1]:.2f}] {msg}", flush=True)


def cpus_for(threads: int) -> list[int]:
    """The cores a run with `threads` threads is pinned to: the last ones (the first takes more
    interrupts); all of them when threads >= the cores this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-threads:] if threads < len(cpus) else cpus


def pinned(cmd: list[str], threads: int) -> list[str]:
    cpus = cpus_for(threads)
    if len(cpus) == len(os.sched_getaffinity(0)):
        return cmd
    return ["taskset", "-c", ",".join(map(str, cpus)), *cmd]


def thread_env(threads: int) -> dict:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


# ---- llama.cpp: llama-bench --------------------------------------------------------------------------
def llama_bench(peer: LlamaCppPeer, gguf: Path, threads: int, extra: list[str]) -> list[dict]:
    """One llama-bench call (-r 1, JSON output) -> its test records (n_prompt, n_gen, n_depth, avg_ts)."""
    cmd = pinned(
        [str(peer.bin / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *extra],
        threads,
    )
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-800:]}")
    return json.loads(p.stdout)


def llama_round(peer, gguf: Path, threads: int, lengths: list[int], a) -> dict:
    """{"prefill": {n: tok/s}, "decode": tok/s} from two llama-bench calls."""
    pre = llama_bench(peer, gguf, threads, ["-p", ",".join(map(str, lengths)), "-n", "0"])
    dec = llama_bench(peer, gguf, threads, ["-p", "0", "-n", str(a.decode_new), "-d", str(a.decode_context)])
    return dict(prefill={str(t["n_prompt"]): t["avg_ts"] for t in pre}, decode=dec[0]["avg_ts"])


# ---- k3: the engine worker -----------------------------------------------------------------------------
class Worker:
    """bench/engine_worker.py as a pinned subprocess driven one round at a time (stdin / stdout)."""

    def __init__(self, plan: dict[str, tuple[Path, list[int]]], threads: int, a, logfile: Path):
        cmd = [sys.executable, str(HERE / "engine_worker.py"), "--threads", str(threads),
               "--plan", json.dumps({f: [str(d), n] for f, (d, n) in plan.items()}),
               "--decode-context", str(a.decode_context), "--decode-new", str(a.decode_new)]  # fmt: skip
        logfile.parent.mkdir(parents=True, exist_ok=True)
        self.err = logfile.open("w")
        self.proc = subprocess.Popen(
            pinned(cmd, threads),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env={**os.environ, **thread_env(threads)},
        )
        self.logfile = logfile
        self.ready = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise RuntimeError(f"the k3 engine worker exited ({self.proc.wait()}); log: {self.logfile}")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def add(res: dict, keys: tuple, value: float) -> None:
    res.setdefault(keys, []).append(value)


def same_file_formats(a) -> list[str]:
    """k3's runs of llama.cpp's own files (`gguf:T`, T a GGUF outtype), unless --no-same-file."""
    return [] if a.no_same_file else [f"gguf:{t}" for t in ("bf16", "q8_0", "mxfp4", "mxfp4_moe")]


def prefill_lengths(fmt: str, threads: int, a) -> list[int]:
    """Every --prefill length for f32 at the --long-threads counts; else the first (shortest) alone,
    which keeps a full run within minutes: the long prompts cost the most and the goal is set at f32."""
    return a.prefill_list if fmt == "f32" and threads in a.long_threads_list else a.prefill_list[:1]


def k3_path(w, fmt: str):
    """What k3 loads for a format: its own checkpoint folder, or (`gguf:T`) the very GGUF llama.cpp runs."""
    return w.gguf[fmt[5:]] if fmt.startswith("gguf:") else w.k3[fmt]


def time_engines(w, threads: int, formats: tuple[list, list], peer, a, res: dict) -> dict:
    """Prefill and decode, k3 and llama.cpp alternated, `a.reps` rounds; samples into res."""
    k3_formats, llama_formats = formats
    plan = {f: (k3_path(w, f), prefill_lengths(f, threads, a)) for f in k3_formats}
    worker = Worker(plan, threads, a, a.workdir / "logs" / f"worker-{threads}t.log")
    try:
        log(f"  k3 engines ready: {worker.ready['ready']}")
        for r in range(a.reps):
            sides = ["k3", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "k3"]
            for side in sides:
                rounds = (
                    worker.run()
                    if side == "k3"
                    else {
                        f: llama_round(peer, w.gguf[f], threads, prefill_lengths(f, threads, a), a)
                        for f in llama_formats
                    }
                )
                for fmt, m in rounds.items():
                    for n, v in m["prefill"].items():
                        add(res, (threads, side, fmt, f"prefill{n}"), v)
                    add(res, (threads, side, fmt, "decode"), m["decode"])
            log(f"  round {r + 1}/{a.reps}: " + summary(res, threads))
        return worker.ready["ready"]
    finally:
        worker.close()


def summary(res: dict, threads: int) -> str:
    def last(side, fmt, metric):
        v = res.get((threads, side, fmt, metric))
        return f"{v[-1]:.0f}" if v else "-"

    return ", ".join(
        f"{m} k3 {last('k3', 'f32', m)} / llama.cpp {last('llama.cpp', 'f32', m)}"
        for m in sorted({k[3] for k in res if k[0] == threads})
    )


# ---- serving ------------------------------------------------------------------------------------------
def servers(w, threads: int, fmt: tuple[str, str], peer, a) -> dict[str, Server]:
    n, ctx = a.serve_requests, a.serve_prompt + a.serve_new + 64
    k3_cmd = [
        sys.executable,
        "-m",
        "k3.serve.cli",
        str(w.k3[fmt[0]]),
        "--host",
        "127.0.0.1",
        "--max-num-seqs",
        str(n),
        "--max-model-len",
        str(ctx),
        "--num-pages",
        str(n * -(-ctx // 64) + 8),
        "--no-prefix-cache",
        "--max-pending",
        str(2 * n),
    ] + (["--compile"] if a.serve_compile else [])
    llama_cmd = [
        str(peer.bin / "llama-server"),
        "-m",
        str(w.gguf[fmt[1]]),
        "--host",
        "127.0.0.1",
        "--parallel",
        str(n),
        "-c",
        str(n * ctx),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--no-webui",
    ]
    logs = a.workdir / "logs"
    kp, lp = free_port(), free_port()
    return {
        "k3": Server(
            pinned([*k3_cmd, "--port", str(kp)], threads),
            kp,
            logs / f"k3-serve-{threads}t.log",
            env=thread_env(threads),
        ),
        "llama.cpp": Server(
            pinned([*llama_cmd, "--port", str(lp)], threads), lp, logs / f"llama-server-{threads}t.log"
        ),
    }


def serve_prompts(a, vocab: int, r: int) -> list[list[int]]:
    rng = random.Random(1_000_003 * (r + 1) + a.seed)
    return [[rng.randrange(vocab - 256) for _ in range(a.serve_prompt)] for _ in range(a.serve_requests)]


def time_serving(w, threads: int, fmt: tuple[str, str], peer, a, res: dict, errors: list) -> None:
    srv = servers(w, threads, fmt, peer, a)
    try:
        urls = {}
        for side, s in srv.items():
            t0 = time.perf_counter()
            try:
                urls[side] = s.start()
            except RuntimeError as e:
                if side != "k3" or "--compile" not in s.cmd:
                    raise
                note = f"k3 serve --compile failed to start ({e}); serving without --compile"
                log("  " + note)
                errors.append(note)
                s.cmd.remove("--compile")
                urls[side] = s.start()
            log(f"  {side} server up in {time.perf_counter() - t0:.0f} s")
        vocab = w.config.vocab_size
        for url in urls.values():  # warm-up (every slot, short), not counted
            asyncio.run(burst(url, [p[:16] for p in serve_prompts(a, vocab, -1)], 8))
        for r in range(a.serve_reps):
            prompts = serve_prompts(a, vocab, r)
            for side in ["k3", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "k3"]:
                out = asyncio.run(burst(urls[side], prompts, a.serve_new))
                for m in ("tok_per_s", "ttft_p50_s", "ttft_p99_s"):
                    add(res, (threads, side, fmt[0] if side == "k3" else fmt[1], f"serve_{m}"), out[m])
            log(
                f"  serving round {r + 1}/{a.serve_reps}: output tok/s k3 "
                f"{res[(threads, 'k3', fmt[0], 'serve_tok_per_s')][-1]:.0f} / llama.cpp "
                f"{res[(threads, 'llama.cpp', fmt[1], 'serve_tok_per_s')][-1]:.0f}"
            )
    finally:
        for s in srv.values():
            s.stop()


# ---- perplexity and roofline ----------------------------------------------------------------------------
def perplexities(w, peer, a) -> dict[str, dict[str, float]]:
    import torch

    from k3.checkpoint import load_checkpoint
    from k3.export.gguf_read import load_gguf
    from k3.quant.checkpoint import load_mxfp4_checkpoint

    torch.set_num_threads(max(a.threads_list))
    out = {"k3": {}, "llama.cpp": {}}
    for fmt in [*K3_FORMATS, *same_file_formats(a)]:
        if fmt.startswith("gguf:"):
            model = load_gguf(k3_path(w, fmt)).model
        else:
            model = load_checkpoint(w.k3[fmt])[0] if fmt == "f32" else load_mxfp4_checkpoint(w.k3[fmt])[0]
        out["k3"][fmt] = k3_perplexity(model.eval(), w.heldout, a.ppl_ctx, a.ppl_positions)
        del model
    for fmt, path in w.gguf.items():
        out["llama.cpp"][fmt] = llama_perplexity(
            peer, path, w.heldout, a.ppl_ctx, a.ppl_positions, max(a.threads_list)
        )
    return out


def bytes_per_token(w, a) -> dict[str, dict[str, dict]]:
    """side -> format -> bytes one decode token touches (roofline.py), at the mean decode context."""
    import torch

    from k3.model.transformer import K3ForCausalLM
    from k3.quant.packed import pack_model_experts

    ctx = a.decode_context + a.decode_new // 2
    with torch.device("meta"):
        dense = K3ForCausalLM(w.config)
        packed = pack_model_experts(K3ForCausalLM(w.config))
    return {
        "k3": {"f32": k3_bytes(dense, w.config, ctx), "mxfp4": k3_bytes(packed, w.config, ctx)},
        "llama.cpp": {f: gguf_bytes(p, w.config, ctx) for f, p in w.gguf.items()},
    }


# ---- figures, table, plot --------------------------------------------------------------------------------
def stats(xs: list[float] | None) -> dict | None:
    if not xs:
        return None
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs), n=len(xs), samples=xs)


METRIC_NAMES = {
    "decode": "decode tok/s (batch 1)",
    "serve_tok_per_s": "serving output tok/s",
    "serve_ttft_p50_s": "serving TTFT p50",
    "serve_ttft_p99_s": "serving TTFT p99",
}


def metric_name(m: str, a) -> str:
    if m.startswith("prefill"):
        return f"prefill tok/s ({m[7:]}-token prompt, batch 1)"
    if m == "decode":
        return f"decode tok/s (batch 1, after {a.decode_context} tokens, {a.decode_new} new)"
    if m.startswith("serve"):
        base = METRIC_NAMES[m]
        return f"{base} ({a.serve_requests} concurrent, {a.serve_prompt} + {a.serve_new} tokens)"
    return m


def figures_for(name: str, res: dict, a, ppl: dict, roof: dict, bw: dict) -> list[dict]:
    """The `k3 bench` figure rows of one weights set."""
    from k3.benchmark.result import figure

    rows = []
    pairs = [("f32", "f32")] + [("mxfp4", f) for f in ("q8_0", "mxfp4")]
    pairs += [(f, f[5:]) for f in same_file_formats(a)]  # both engines on the very same GGUF
    metrics = sorted({k[3] for k in res}, key=lambda m: (not m.startswith("prefill"), m != "decode", m))
    for threads in a.threads_list:
        for k3f, lf in pairs:
            for m in metrics:
                ks, ls = (
                    stats(res.get((threads, "k3", k3f, m))),
                    stats(res.get((threads, "llama.cpp", lf, m))),
                )
                if ks is None or ls is None:
                    continue
                lower_better = "ttft" in m
                ratio = ls["median"] / ks["median"] if lower_better else ks["median"] / ls["median"]
                goal = None
                if threads == 2 and k3f == lf == "f32":
                    goal = GOALS.get("prefill" if m.startswith("prefill") else m.replace("_per_s", "_s"))
                rows.append(
                    figure(
                        f"{name}, {threads}t, k3 {k3f} vs llama.cpp {lf}: {metric_name(m, a)}"
                        + (" (ratio: llama.cpp / k3)" if lower_better else ""),
                        ks["median"],
                        "s" if lower_better else "tok/s",
                        peer=f"{PEER} {lf}",
                        peer_value=ls["median"],
                        ratio=ratio,
                        goal=goal,
                        preset=name,
                        threads=threads,
                        metric=m,
                        k3_format=k3f,
                        peer_format=lf,
                        k3=ks,
                        llama_cpp=ls,
                        ppl_k3=ppl["k3"].get(k3f),
                        ppl_llama_cpp=ppl["llama.cpp"].get(lf),
                    )
                )
        for side, fmts in (("k3", K3_FORMATS), ("llama.cpp", ("f32", "q8_0", "mxfp4"))):
            for f in fmts:
                dec = stats(res.get((threads, side, f, "decode")))
                if dec is None:
                    continue
                bound = roofline(roof[side][f], bw["best"][threads])
                goal = GOALS["roofline"] if (side == "k3" and threads == 2 and "small" in name) else None
                rows.append(
                    figure(
                        f"{name}, {threads}t, {side} {f}: decode vs the bandwidth roofline "
                        f"({sum(roof[side][f].values()) / 1e6:.1f} MB/token, {bw['best'][threads]:.1f} GB/s)",
                        dec["median"],
                        "tok/s",
                        peer="roofline: bandwidth / bytes per token",
                        peer_value=bound,
                        ratio=dec["median"] / bound,
                        goal=goal,
                        preset=name,
                        threads=threads,
                        metric="roofline",
                        side=side,
                        format=f,
                        bytes_per_token=roof[side][f],
                    )
                )
    return rows


def fmt_num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_stats(s: dict) -> str:
    return f"{fmt_num(s['median'])} [{fmt_num(s['min'])}-{fmt_num(s['max'])}]"


def print_table(rows: list[dict], ppl: dict[str, dict], trained: dict[str, bool]) -> None:
    from k3.benchmark.result import goal_met

    for name in dict.fromkeys(r["preset"] for r in rows):
        how = "trained weights" if trained[name] else "seeded random init (speed does not depend on training)"
        print(f"\n== {name}: {how}")
        print(
            f"{'threads':>7}  {'figure':46s} {'k3 median [min-max]':>24s} {'llama.cpp med. [min-max]':>27s} "
            f"{'ratio':>7s} {'goal':>6s} met"
        )
        for r in (r for r in rows if r["preset"] == name and r["metric"] != "roofline"):
            label = f"{r['metric']} k3 {r['k3_format']} / {r['peer_format']}"
            met = goal_met(r)
            print(
                f"{r['threads']:>7}  {label:46s} {fmt_stats(r['k3']):>24s} {fmt_stats(r['llama_cpp']):>27s} "
                f"{r['ratio']:7.2f} {'>=' + str(r['goal']) if r['goal'] else '':>6s} "
                f"{'' if met is None else ('yes' if met else 'NO')}"
            )
        print(
            "perplexity on held-out tokens: "
            + "; ".join(
                f"{side} " + ", ".join(f"{f} {v:.4g}" for f, v in ppl[name][side].items())
                for side in ppl[name]
            )
        )
        print(f"{'threads':>7}  {'decode vs roofline':46s} {'tok/s':>8s} {'bound':>8s} {'fraction':>8s}")
        for r in (r for r in rows if r["preset"] == name and r["metric"] == "roofline"):
            mb = sum(r["bytes_per_token"].values()) / 1e6
            label = f"{r['side']} {r['format']} ({mb:.1f} MB/token)"
            print(
                f"{r['threads']:>7}  {label:46s} {fmt_num(r['value']):>8s} {fmt_num(r['peer_value']):>8s} "
                f"{r['ratio']:8.1%}" + (f"  goal >= {r['goal']:.0%}" if r["goal"] else "")
            )


def plot(rows: list[dict], path: Path, title: str) -> None:
    """One bar per k3-vs-llama.cpp row: the ratio (log scale), its goal as a tick, both values as text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from k3.benchmark.result import goal_met

    rows = [r for r in rows if r["metric"] != "roofline"]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.6))
    ys = range(len(rows))[::-1]
    colors = [{True: "tab:green", False: "tab:red", None: "tab:gray"}[goal_met(r)] for r in rows]
    ax.barh(list(ys), [r["ratio"] - 1 for r in rows], left=1, color=colors, height=0.7)
    for y, r in zip(ys, rows, strict=True):
        if r["goal"]:
            ax.plot([r["goal"], r["goal"]], [y - 0.4, y + 0.4], color="black", lw=1.5)
        unit = "s" if r["unit"] == "s" else ""
        ax.text(
            r["ratio"] * 1.03,
            y,
            f" {fmt_num(r['value'])}{unit} vs {fmt_num(r['peer_value'])}{unit}",
            va="center",
            fontsize=7,
        )
    labels = [
        f"{r['preset']} {r['threads']}t {r['k3_format']}/{r['peer_format']} {r['metric']}" for r in rows
    ]
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.set_xscale("log")
    lo = min([1.0, *(r["ratio"] for r in rows), *(r["goal"] for r in rows if r["goal"])])
    hi = max([1.0, *(r["ratio"] for r in rows), *(r["goal"] for r in rows if r["goal"])])
    ax.set_xlim(lo / 1.3, hi * 2.2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xlabel("k3 / llama.cpp (TTFT: llama.cpp / k3); > 1: k3 faster; black tick: goal")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="k3-tiny,k3-small", help="comma-separated presets (random init)")
    p.add_argument("--checkpoint", action="append", default=[], help="a run / checkpoint folder (repeatable)")
    p.add_argument("--threads", default="1,2", help="thread counts, each run on both sides")
    p.add_argument("--format-threads", default="2", help="thread counts at which the non-f32 formats run")
    p.add_argument("--serve-threads", default="1,2", help="thread counts of the serving runs")
    p.add_argument(
        "--reps", type=int, default=3, help="rounds of prefill / decode (k3, llama.cpp alternated)"
    )
    p.add_argument("--prefill", default="512,4096", help="prompt lengths of the prefill figures")
    p.add_argument(
        "--long-threads", default="2", help="thread counts at which f32 runs every --prefill length"
    )
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-new", type=int, default=256)
    p.add_argument("--serve-requests", type=int, default=32)
    p.add_argument("--serve-prompt", type=int, default=256)
    p.add_argument("--serve-new", type=int, default=128)
    p.add_argument("--serve-reps", type=int, default=3)
    p.add_argument(
        "--serve-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="k3 serve --compile (the fused prefill activations and the batch-1 decode step)",
    )
    p.add_argument("--no-serve", action="store_true", help="skip the serving figures")
    p.add_argument(
        "--no-same-file", action="store_true", help="skip k3's runs of the GGUF files themselves (gguf:T)"
    )
    p.add_argument("--ppl-positions", type=int, default=1024, help="held-out tokens scored per format")
    p.add_argument("--ppl-ctx", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--bandwidth-gib", type=float, default=2.0, help="buffer of the read-bandwidth kernel")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workdir", type=Path, default=None, help="weights and logs (default: ~/.cache/k3/vs_llamacpp)"
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: " + json.dumps(QUICK))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:  # small settings for whatever was not given on the command line
        for k, v in QUICK.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
        for k in ("format_threads", "serve_threads", "long_threads"):
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, a.threads)
    a.workdir = a.workdir or default_workdir()
    ints = lambda s: [int(x) for x in str(s).split(",") if x]  # noqa: E731
    a.prefill_list, a.long_threads_list = sorted(ints(a.prefill)), ints(a.long_threads)
    a.threads_list, a.format_threads_list, a.serve_threads_list = (
        ints(a.threads),
        ints(a.format_threads),
        ints(a.serve_threads),
    )
    a.names = [*[x for x in a.presets.split(",") if x], *a.checkpoint]
    if not a.names:
        p.error("nothing to run: give --presets or --checkpoint")
    if any(t < 1 for t in a.threads_list) or not set(a.format_threads_list) <= set(a.threads_list):
        p.error("--threads must be >= 1 and include every --format-threads")
    return a


def run_one(name: str, peer, a, bw: dict) -> tuple[list[dict], dict, dict, bool]:
    w = prepare(name, a.workdir / "weights", a.seed, log=log)
    res: dict = {}
    info, errors = {}, []
    for threads in a.threads_list:
        formats = (
            ([*K3_FORMATS, *same_file_formats(a)], list(w.gguf))
            if threads in a.format_threads_list
            else (["f32"], ["f32"])
        )
        log(f"{name}, {threads} thread(s): prefill / decode, formats k3 {formats[0]} llama.cpp {formats[1]}")
        ready = info[f"engine_{threads}t"] = time_engines(w, threads, formats, peer, a, res)
        errors += [f"{threads}t k3 {f}: {r['error']}" for f, r in ready.items() if "error" in r]
        if not a.no_serve and threads in a.serve_threads_list:
            log(f"{name}, {threads} thread(s): serving")
            try:
                time_serving(w, threads, ("f32", "f32"), peer, a, res, errors)
            except RuntimeError as e:  # recorded and reported; the other figures still count
                log(f"  serving FAILED: {e}")
                errors.append(f"{threads}t serving: {e}")
    log(f"{name}: perplexity of every format on {a.ppl_positions} held-out tokens")
    ppl = perplexities(w, peer, a)
    roof = bytes_per_token(w, a)
    rows = figures_for(Path(name).name, res, a, ppl, roof, bw)
    raw = {"|".join(map(str, k)): v for k, v in res.items()}
    return (
        rows,
        dict(ppl=ppl, bytes_per_token=roof, samples=raw, **info, errors=errors, root=str(w.root)),
        ppl,
        w.trained,
    )


def main(argv=None) -> int:
    from k3.benchmark.report import machine_info
    from k3.benchmark.result import write_result

    a = parse_args(argv)
    peer = LlamaCppPeer.find()
    load0 = os.getloadavg()
    log(f"{peer.describe()}; cores {sorted(os.sched_getaffinity(0))}")
    if load0[0] > 0.7:
        log("warning: the machine is busy; llama.cpp's spin-waiting threads lose more to other load than k3")
    bw = read_bandwidth(tuple(a.threads_list), gib=a.bandwidth_gib)
    log(
        "read bandwidth GB/s: "
        + ", ".join(f"{t} thread(s) {g:.1f}" for t, g in bw["best"].items())
        + f" (C kernel {bw['c']}, numpy {bw['numpy']:.1f})"
    )
    rows, reports, ppls, trained = [], {}, {}, {}
    t0 = time.perf_counter()
    for name in a.names:
        r, report, ppl, was_trained = run_one(name, peer, a, bw)
        key = Path(name).name
        rows += r
        reports[key], ppls[key], trained[key] = report, ppl, was_trained
    bw_end = read_bandwidth(tuple(a.threads_list), gib=a.bandwidth_gib)
    load1 = os.getloadavg()
    print_table(rows, ppls, trained)
    for key, report in reports.items():
        for err in report["errors"]:
            print(f"FAILED {key} {err}")
    print(
        "\nread bandwidth GB/s, start / end: "
        + ", ".join(f"{t}t {bw['best'][t]:.1f} / {bw_end['best'][t]:.1f}" for t in a.threads_list)
        + f"; load average start {load0[0]:.2f}, end {load1[0]:.2f}, max {max(LOADS):.2f}"
        + f"; {time.perf_counter() - t0:.0f} s"
    )
    title = (
        f"k3 vs {peer.describe()}\n"
        + ", ".join(a.names)
        + f"; load {load0[0]:.2f} -> {load1[0]:.2f} (max {max(LOADS):.2f})"
    )
    if a.plot:
        plot(rows, a.plot, title)
        print(f"plot: {a.plot}")
    if a.json:
        params = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k not in ("json", "plot")
        }
        write_result(
            a.json,
            "vs_llamacpp",
            rows,
            params,
            peer=peer.describe(),
            bandwidth=bw,
            bandwidth_end=bw_end,
            load_average=dict(start=load0, end=load1, during=LOADS),
            models=reports,
            machine=machine_info(HERE.parent),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
