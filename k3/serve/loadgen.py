"""`python -m k3.serve.loadgen URL`: C concurrent clients x R requests each against a running `k3 serve`.

Each client sends its requests one after another (asyncio + httpx), greedy by default, and the run
reports failures, latency percentiles (p50 / p99 of whole requests and of the time to the first
streamed token) and throughput (requests/s, output tokens/s). With `--check-alone` every distinct
prompt is first sent alone on the idle server and each loaded answer must equal its alone answer
(batch invariance of greedy decoding). Prompts are token-id lists drawn from a seeded generator, so
runs repeat exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time


def prompts(n: int, vocab: int = 256, seed: int = 0, lo: int = 8, hi: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def one(client, url: str, key: str | None, prompt: list[int], max_tokens: int, model: str) -> dict:
    """One streamed greedy completion -> {text, tokens, latency, ttft, status}."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0, ttft, text, tokens = time.perf_counter(), None, "", 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "error": r.text[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 500, "error": chunk["error"]["message"]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = ttft or time.perf_counter() - t0
                text += chunk["choices"][0]["text"]
    return {"status": 200, "text": text, "tokens": tokens, "latency": time.perf_counter() - t0, "ttft": ttft}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def run(url: str, clients: int, requests: int, max_tokens: int = 16, key: str | None = None,
              model: str = "kimi-k3", check_alone: bool = False, seed: int = 0) -> dict:  # fmt: skip
    """The load run -> {failures, mismatches, p50_s, p99_s, ttft_p50_s, ttft_p99_s, req_per_s,
    tok_per_s, wall_s, results}. Client c's request r uses prompt (c + r) % clients, so every prompt
    is asked R times by different clients at once (prefix-cache hits under load included)."""
    import httpx

    pool = prompts(clients, seed=seed)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        alone = {}
        if check_alone:
            for i, p in enumerate(pool):
                alone[i] = await one(client, url, key, p, max_tokens, model)

        async def worker(c: int) -> tuple[list, list]:
            ids = [(c + r) % clients for r in range(requests)]
            return ids, [await one(client, url, key, pool[i], max_tokens, model) for i in ids]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(worker(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    results = [(i, res) for ids, outs in done for i, res in zip(ids, outs, strict=True)]
    ok = [res for _, res in results if res["status"] == 200]
    mismatches = [i for i, res in results if check_alone and res.get("text") != alone[i].get("text")]
    lat, ttft = [r["latency"] for r in ok], [r["ttft"] for r in ok if r["ttft"] is not None]
    return {"failures": len(results) - len(ok), "mismatches": len(mismatches), "requests": len(results),
            "p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99), "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99), "req_per_s": len(ok) / wall,
            "tok_per_s": sum(r["tokens"] for r in ok) / wall, "wall_s": wall,
            "errors": sorted({r.get("error", "") for _, r in results if r["status"] != 200})[:5]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3.serve.loadgen", description=__doc__.splitlines()[0])
    p.add_argument("url", help="server, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests", type=int, default=5, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default="kimi-k3")
    p.add_argument("--check-alone", action="store_true", help="compare with each prompt sent alone")
    args = p.parse_args(argv)
    head = ("clients", "requests", "failures", "differ from alone", "p50 s", "p99 s", "TTFT p50 s", "req/s",
            "tok/s")  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    bad = 0
    for c in args.clients:
        m = asyncio.run(run(args.url, c, args.requests, args.max_tokens, args.api_key, args.model,
                            args.check_alone))  # fmt: skip
        diff = m["mismatches"] if args.check_alone else "-"
        row = (c, m["requests"], m["failures"], diff, f"{m['p50_s']:.3f}", f"{m['p99_s']:.3f}",
               f"{m['ttft_p50_s']:.3f}", f"{m['req_per_s']:.1f}", f"{m['tok_per_s']:.0f}")  # fmt: skip
        print("| " + " | ".join(map(str, row)) + " |", flush=True)
        bad += m["failures"] + m["mismatches"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
