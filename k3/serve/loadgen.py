"""The load client of every OpenAI-compatible server (`k3 serve`, llama-server): tests, docs and benches.

    python -m k3.serve.loadgen URL      C concurrent clients x R requests each against a running server

Every request is one streamed, greedy `/v1/completions` (a token-id prompt, `ignore_eos` and a fixed
`max_tokens`, fields both `k3 serve` and `llama-server` take) on its own loopback connection, read by a
plain asyncio stream: the client shares the machine with the server it measures, so its cost per
streamed chunk stays at a few microseconds (an HTTP library took ~90). Two shapes of load:

* `run`: C clients, each sending R requests one after another; failures, latency percentiles (whole
  requests and time to the first streamed token) and throughput. With `check_alone` every distinct
  prompt is first sent alone on the idle server and each loaded answer must equal its alone answer
  (batch invariance of greedy decoding). Prompts come from a seeded generator, so runs repeat exactly.
* `burst`: every prompt at once (bench/vs_llamacpp.py); output tokens per second of wall time from the
  first send to the last token, and TTFT percentiles; a failed request raises.
Percentiles interpolate linearly between ranks (numpy's default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time


def prompts(n: int, vocab: int = 256, seed: int = 0, lo: int = 8, hi: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class Stream:
    """One HTTP/1.1 request on its own loopback connection, its body read as it arrives.

    A plain asyncio stream, not an HTTP library: the client shares the machine with the server it
    measures, so its cost per streamed chunk (a few microseconds here, ~90 with httpx) is kept small.
    Handles chunked and Content-Length bodies, and bodies that end with the connection."""

    def __init__(self, url: str):
        m = re.fullmatch(r"http://([^:/]+):(\d+)", url)
        if not m:
            raise ValueError(f"serving client: expected http://host:port, got {url!r}")
        self.host, self.port = m.group(1), int(m.group(2))

    async def post(self, path: str, body: dict, key: str | None = None):
        """-> (status, async iterator over the body's lines without their line ends)."""
        data = json.dumps(body).encode()
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"{auth}Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        self.writer.write(head.encode() + data)
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        return status, self._lines(headers)

    async def _body(self, headers: dict):
        """The body in pieces as they arrive."""
        r = self.reader
        if "chunked" in headers.get("transfer-encoding", ""):
            while (size := int((await r.readline()).split(b";")[0], 16)) > 0:
                yield await r.readexactly(size)
                await r.readexactly(2)
        elif "content-length" in headers:
            yield await r.readexactly(int(headers["content-length"]))
        else:
            while piece := await r.read(65536):
                yield piece

    async def _lines(self, headers: dict):
        rest = b""
        try:
            async for piece in self._body(headers):
                *lines, rest = (rest + piece).split(b"\n")
                for line in lines:
                    yield line.rstrip(b"\r")
            if rest:
                yield rest
        finally:
            self.writer.close()


async def one(
    url: str, prompt: list[int], max_tokens: int, key: str | None = None, model: str = "kimi-k3", t_send=None
) -> dict:
    """One streamed greedy completion -> {status, text, tokens, ttft, latency} (seconds since `t_send`,
    default now), or {status, error} for an HTTP error or an error event. `tokens` is the server's usage
    count, else the number of text chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter() if t_send is None else t_send
    ttft, tokens, texts, text = None, None, 0, []
    status, lines = await Stream(url).post("/v1/completions", body, key)
    if status != 200:
        raw = b"\n".join([line async for line in lines]).decode(errors="replace")
        return {"status": status, "error": f"HTTP {status}: {raw[:300]}"}
    async for line in lines:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return {"status": 500, "error": str(chunk["error"].get("message", chunk["error"]))}
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            texts += 1
            text.append(chunk["choices"][0]["text"])
            if ttft is None:
                ttft = time.perf_counter() - t0
    latency = time.perf_counter() - t0
    count = tokens if tokens is not None else texts
    return {"status": 200, "text": "".join(text), "tokens": count, "ttft": ttft, "latency": latency}


def pct(xs: list[float], q: float) -> float:
    """The q-quantile by linear interpolation (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


async def burst(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once -> {tok_per_s, ttft_p50_s, ttft_p99_s, wall_s, tokens, requests, client_cpu_s}.
    Raises if a request fails or a server generated other than `max_tokens` tokens for one.
    client_cpu_s is this process's CPU time over the round: what the client took from the server."""
    t0, c0 = time.perf_counter(), time.process_time()
    res = await asyncio.gather(*(one(url, p, max_tokens, t_send=t0) for p in prompts))
    cpu = time.process_time() - c0
    failed = [r["error"] for r in res if r["status"] != 200]
    if failed:
        raise RuntimeError(f"{url}: {failed[0]}")
    wrong = [r["tokens"] for r in res if r["tokens"] != max_tokens]
    if wrong:
        raise RuntimeError(f"{url}: {len(wrong)} requests generated {wrong[:4]} tokens, not {max_tokens}")
    wall = max(r["latency"] for r in res)
    ttfts = [r["ttft"] if r["ttft"] is not None else r["latency"] for r in res]
    tokens = sum(r["tokens"] for r in res)
    return dict(
        tok_per_s=tokens / wall,
        ttft_p50_s=pct(ttfts, 0.5),
        ttft_p99_s=pct(ttfts, 0.99),
        wall_s=wall,
        tokens=tokens,
        requests=len(res),
        client_cpu_s=cpu,
    )


async def run(url: str, clients: int, requests: int, max_tokens: int = 16, key: str | None = None,
              model: str = "kimi-k3", check_alone: bool = False, seed: int = 0) -> dict:  # fmt: skip
    """The load run -> {failures, mismatches, p50_s, p99_s, ttft_p50_s, ttft_p99_s, req_per_s,
    tok_per_s, wall_s, errors}. Client c's request r uses prompt (c + r) % clients, so every prompt
    is asked R times by different clients at once (prefix-cache hits under load included)."""
    pool = prompts(clients, seed=seed)
    alone = {}
    if check_alone:
        for i, p in enumerate(pool):
            alone[i] = await one(url, p, max_tokens, key, model)

    async def worker(c: int) -> tuple[list, list]:
        ids = [(c + r) % clients for r in range(requests)]
        return ids, [await one(url, pool[i], max_tokens, key, model) for i in ids]

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
