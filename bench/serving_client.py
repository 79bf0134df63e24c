"""One load client for every OpenAI-compatible server, and the server processes it drives.

    async with Server(cmd, port, log) as url:      # a subprocess, up when /health answers 200
        result = await load(url, prompts, max_tokens=128)

`load` sends every prompt at once as its own streamed, greedy `/v1/completions` request (token-id
prompt, `ignore_eos` and a fixed `max_tokens`, so each server generates exactly that many tokens:
both `k3 serve` and `llama-server` take these fields) and measures, per request, the time to the first
streamed text and the tokens the server reports in its final usage chunk. The figures: output tokens
per second of wall time from the first send to the last token, and TTFT percentiles. The client
(asyncio + httpx) is the same for both servers, so its own cost falls on both alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (its own process group, output to `log`), stopped on exit whatever happens."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict | None = None, start_s: float = 900):
        self.cmd, self.port, self.log, self.env, self.start_s = cmd, port, log, env, start_s
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> str:
        import httpx

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as f:
            f.write("$ " + " ".join(self.cmd) + "\n")
            f.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,
            )
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.start_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode} at start-up; log: {self.log}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.start_s:.0f} s; log: {self.log}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> str:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


async def one(client, url: str, prompt: list[int], max_tokens: int, t_send: float) -> dict:
    """One streamed greedy completion -> {ttft, done, tokens} (seconds since `t_send`)."""
    body = {
        "model": "kimi-k3",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    ttft, tokens, texts = None, None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                texts += 1
                if ttft is None:
                    ttft = time.perf_counter() - t_send
    return dict(ttft=ttft, done=time.perf_counter() - t_send, tokens=tokens if tokens is not None else texts)


def pct(xs: list[float], q: float) -> float:
    """The q-quantile by linear interpolation (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


async def load(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once -> {tok_per_s, ttft_p50_s, ttft_p99_s, wall_s, tokens, requests}. Raises if
    a request fails or a server generated other than `max_tokens` tokens for one."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(client, url, p, max_tokens, t0) for p in prompts))
    wrong = [r["tokens"] for r in res if r["tokens"] != max_tokens]
    if wrong:
        raise RuntimeError(f"{url}: {len(wrong)} requests generated {wrong[:4]} tokens, not {max_tokens}")
    wall = max(r["done"] for r in res)
    ttfts = [r["ttft"] if r["ttft"] is not None else r["done"] for r in res]
    tokens = sum(r["tokens"] for r in res)
    return dict(
        tok_per_s=tokens / wall,
        ttft_p50_s=pct(ttfts, 0.5),
        ttft_p99_s=pct(ttfts, 0.99),
        wall_s=wall,
        tokens=tokens,
        requests=len(res),
    )
