"""Deterministic serving (`EngineConfig.deterministic`, `k3 serve --deterministic`): what it buys and what
it costs, in one run.

    python bench/determinism.py --json docs/results/determinism.json     # ~20 minutes on 2 cores
    python bench/determinism.py --requests 200 --presets k3-tiny          # a quicker look

Distinct answers: one prompt (520 tokens of held-out text, 32 greedy tokens with top-5 logprobs) sent
`--requests` times to a trained k3-nano (`k3 train --preset k3-nano --steps 150`, made once under the
work folder, or --checkpoint), in waves of 8 copies under a random mix of what a server sees: a fresh
engine or a warm prefix cache (a request sharing 64-640 of its tokens first), prefill chunks of 64, 96,
200 or 1,000 tokens, 1 or 2 threads, 0-31 batch mates of random lengths arriving before and after it.
Counted per engine mode: distinct completions (token ids) and distinct answers (ids and logprobs, the
floats compared exactly). Goal of the deterministic mode: 1 and 1.

Cost, on each preset at seeded random init (fp32, bench/same_weights.py's checkpoint, 2 threads): the
workloads of bench/vs_llamacpp.py, both modes in turn, median of `--rounds` alternated rounds:
prefill of a 512- and a 4,096-token prompt in one chunk (tok/s, a warm-up prompt of the same length
first), and 32 concurrent streamed clients of `k3 serve` (256 random prompt tokens, 128 output tokens;
k3.serve.loadgen.burst; output tok/s). Goal: the deterministic mode at >= 0.9x the default.
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

import torch

sys.path.insert(0, str(Path(__file__).parent))

CHUNKS = (64, 96, 200, 1000)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- distinct answers ---------------------------------------------------------------------------------
def trained_nano(workdir: Path) -> Path:
    out = workdir / "determinism-nano"
    if not (out / "summary.json").exists():
        log(f"training k3-nano for 150 steps into {out} (about a minute)")
        cmd = [sys.executable, "-m", "k3.cli", "train", "--preset", "k3-nano", "--steps", "150",
               "--out", str(out), "--sample-tokens", "0", "--threads", "2"]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def held_out(tok, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n spans of lo..hi tokens of the stdlib corpus's validation split."""
    from k3.data.corpus import load_corpus

    ids = [t for d in load_corpus(None, split="val").documents[:40] for t in tok.encode(d)]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        s = rng.randrange(0, len(ids) - k)
        out.append(ids[s : s + k])
    return out


def wave(model, target, others, deterministic: bool, rng: random.Random) -> list[tuple]:
    """8 copies of `target` under one random arrangement -> their answers (ids, logprobs)."""
    from k3.infer.config import EngineConfig
    from k3.infer.engine import Engine
    from k3.infer.sequence import SamplingParams

    chunk = rng.choice(CHUNKS)
    torch.set_num_threads(rng.choice((1, 2)))
    cfg = EngineConfig(page_size=64, num_pages=400, max_model_len=2048, max_num_seqs=32,
                       max_prefill_chunk=chunk, max_num_batched_tokens=max(chunk, 256),
                       deterministic=deterministic)  # fmt: skip
    engine = Engine(model, cfg)
    if rng.random() < 0.5:  # a warm prefix cache: a request sharing the target's first 64-640 tokens
        shared = rng.randint(64, 640)
        engine.generate([target[:shared] + rng.choice(others)], SamplingParams(max_tokens=2))
    mates = rng.sample(others, rng.randint(0, 24))
    arrivals = [("mate", m) for m in mates] + [("target", target)] * 8
    rng.shuffle(arrivals)
    params = SamplingParams(max_tokens=32, logprobs=5)
    mine = []
    for kind, prompt in arrivals:
        if kind == "target":
            mine.append(engine.add_request(prompt, params))
        else:
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 40)))
        for _ in range(rng.randint(0, 2)):  # the next arrival comes a few steps later
            engine.step()
    while engine.has_unfinished:
        engine.step()
    return [(tuple(s.output), tuple((lp, tuple(top)) for lp, top in s.logprobs)) for s in mine]


def distinct_answers(ckpt: Path, requests: int, seed: int) -> dict:
    from k3.checkpoint.io import load_checkpoint
    from k3.tokenizer import K3Tokenizer

    model, _ = load_checkpoint(ckpt)
    model = model.float().eval()
    tok = K3Tokenizer.from_dir(ckpt)
    (target,) = held_out(tok, 1, 520, 520, seed)
    others = held_out(tok, 64, 5, 400, seed + 1)
    out = {}
    for deterministic in (True, False):
        rng, answers, t0 = random.Random(seed), [], time.perf_counter()
        while len(answers) < requests:
            answers += wave(model, target, others, deterministic, rng)
        answers = answers[:requests]
        name = "deterministic" if deterministic else "default"
        out[name] = {
            "requests": len(answers),
            "distinct_completions": len({a[0] for a in answers}),
            "distinct_answers": len(set(answers)),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        log(f"{name}: {out[name]}")
    return out


# ---- cost ---------------------------------------------------------------------------------------------
def prefill_rates(ckpt: Path, lengths: list[int], rounds: int, seed: int) -> dict:
    """{mode: {n: [tok/s per round]}}, the two modes' engines alternating within each round."""
    from k3.infer.config import EngineConfig
    from k3.infer.sequence import SamplingParams
    from k3.serve.cli import load_engine

    engines = {}
    for det in (False, True):
        cfg = EngineConfig(max_model_len=max(lengths) + 64, num_pages=-(-(max(lengths) + 64) // 64) * 2 + 8,
                           max_prefill_chunk=max(lengths), max_num_batched_tokens=max(lengths),
                           enable_prefix_cache=False, deterministic=det)  # fmt: skip
        engines["deterministic" if det else "default"] = load_engine(str(ckpt), cfg, "cpu")
    vocab = next(iter(engines.values())).model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    res: dict = {m: {n: [] for n in lengths} for m in engines}
    for r in range(rounds):
        for mode in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            for n in lengths:
                p = torch.randint(0, vocab - 256, (n,), generator=g).tolist()
                engines[mode].generate([p], SamplingParams(max_tokens=1))  # warm-up of the same length
                t0 = time.perf_counter()
                engines[mode].generate([p[::-1]], SamplingParams(max_tokens=1))
                res[mode][n].append(n / (time.perf_counter() - t0))
        log(f"  prefill round {r + 1}: " + ", ".join(f"{m} {res[m]}" for m in res))
    return res


def serving_rates(ckpt: Path, vocab: int, rounds: int, seed: int, clients: int = 32) -> dict:
    from server_process import Server, free_port

    from k3.serve.loadgen import burst

    res: dict = {"default": [], "deterministic": []}
    servers = {}
    for mode in res:
        port = free_port()
        cmd = [sys.executable, "-m", "k3.serve.cli", str(ckpt), "--port", str(port), "--max-num-seqs",
               str(clients), "--max-model-len", "448", "--num-pages", str(clients * 7 + 8),
               "--no-prefix-cache", "--max-pending", str(2 * clients)]  # fmt: skip
        if mode == "deterministic":
            cmd.append("--deterministic")
        servers[mode] = Server(cmd, port, ckpt.parent / f"serve-{mode}.log", env={"OMP_NUM_THREADS": "2"})
    try:
        urls = {m: s.start() for m, s in servers.items()}
        for url in urls.values():
            asyncio.run(burst(url, [[7, 8, 9]] * clients, 8))
        for r in range(rounds):
            rng = random.Random(seed * 1000 + r)
            prompts = [[rng.randrange(vocab - 256) for _ in range(256)] for _ in range(clients)]
            for mode in list(urls) if r % 2 == 0 else list(urls)[::-1]:
                res[mode].append(asyncio.run(burst(urls[mode], prompts, 128))["tok_per_s"])
            log(f"  serving round {r + 1}: {res}")
    finally:
        for s in servers.values():
            s.stop()
    return res


def ratio(default: list[float], deterministic: list[float]) -> dict:
    a, b = statistics.median(default), statistics.median(deterministic)
    return {"default_tok_s": round(a, 1), "deterministic_tok_s": round(b, 1), "ratio": round(b / a, 3)}


def cost(preset: str, workdir: Path, rounds: int, seed: int) -> dict:
    from same_weights import prepare

    torch.set_num_threads(2)
    w = prepare(preset, workdir, log=log)
    ckpt = w.k3["f32"]
    log(f"{preset}: prefill")
    pre = prefill_rates(ckpt, [512, 4096], rounds, seed)
    log(f"{preset}: serving")
    srv = serving_rates(ckpt, w.config.vocab_size, rounds, seed)
    out = {f"prefill_{n}": ratio(pre["default"][n], pre["deterministic"][n]) for n in (512, 4096)}
    out["serve_32"] = ratio(srv["default"], srv["deterministic"])
    return out


def docs_results(raw: dict) -> dict:
    """The run in docs/results' form (k3.benchmark.docs_figures): provenance, figures and the table."""
    m = raw["machine"]
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    machine = (f"{m['logical_cores']}-core {m['cpu']} ({isa}); torch {m.get('torch')}; load average "
               f"{raw['load_before']:.2f} at the start, {raw['load_after']:.2f} at the end")  # fmt: skip
    figs = {}
    for mode, d in raw["distinct"].items():
        figs[f"{mode}_completions"] = {"value": d["distinct_completions"], "fmt": "{:,}"}
        figs[f"{mode}_answers"] = {"value": d["distinct_answers"], "fmt": "{:,}"}
    figs["requests"] = {"value": raw["distinct"]["deterministic"]["requests"], "fmt": "{:,}"}
    rows = []
    names = {"prefill_512": "prefill, 512-token prompt", "prefill_4096": "prefill, 4,096-token prompt",
             "serve_32": "serving, 32 clients (output)"}  # fmt: skip
    for preset, c in raw["cost"].items():
        for key, label in names.items():
            tag = f"{preset}_{key}".replace("-", "_")
            figs[tag + "_ratio"] = {"value": c[key]["ratio"], "fmt": "{:.2f}x"}
            figs[tag + "_default"] = {"value": c[key]["default_tok_s"], "fmt": "{:,.0f}"}
            figs[tag + "_det"] = {"value": c[key]["deterministic_tok_s"], "fmt": "{:,.0f}"}
            rows.append([preset, label, f"{{{tag}_default}}", f"{{{tag}_det}}", f"{{{tag}_ratio}}"])
    header = ["preset", "workload", "default tok/s", "deterministic tok/s", "ratio"]
    return {
        "command": raw["command"], "commit": m.get("git_commit"), "machine": machine,
        "date": str(m.get("date"))[:10], "figures": figs,
        "tables": {"cost": {"header": header, "rows": rows}}, "raw": raw,
    }  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="copies of the prompt (distinct answers)")
    p.add_argument("--checkpoint", default=None, help="a trained run for the distinct-answers part")
    p.add_argument("--presets", default="k3-tiny,k3-small", help="comma-separated presets for the cost")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="default: ~/.cache/k3/bench")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    a = p.parse_args(argv)
    from same_weights import default_workdir

    from k3.benchmark.report import machine_info

    workdir = a.workdir or default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = Path(a.checkpoint) if a.checkpoint else trained_nano(workdir)
    log(f"distinct answers over {a.requests} requests ({ckpt})")
    result = {
        "command": "python bench/determinism.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(Path(__file__).parent.parent, threads=2),
        "load_before": os.getloadavg()[0],
        "distinct": distinct_answers(ckpt, a.requests, a.seed),
        "cost": {},
    }
    for preset in [x for x in a.presets.split(",") if x]:
        result["cost"][preset] = cost(preset, workdir, a.rounds, a.seed)
        log(f"{preset}: {result['cost'][preset]}")
    result["load_after"] = os.getloadavg()[0]
    result["seconds"] = round(time.perf_counter() - t0)
    print(json.dumps(result, indent=1))
    if a.json:  # docs/results' form, the raw figures under "raw"
        a.json.write_text(json.dumps(docs_results(result), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
