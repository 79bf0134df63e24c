"""One load client for every OpenAI-compatible server, and the server processes it drives.

    async with Server(cmd, port, log) as url:      # a subprocess, up when /health answers 200
        result = await load(url, prompts, max_tokens=128)

`load` sends every prompt at once as its own streamed, greedy `/v1/completions` request (token-id
prompt, `ignore_eos` and a fixed `max_tokens`, so each server generates exactly that many tokens:
both `k3 serve` and `llama-server` take these fields) and measures, per request, the time to the first
streamed text and the tokens the server reports in its final usage chunk. The figures: output tokens
per second of wall time from the first send to the last token, and TTFT percentiles. The client
(plain asyncio streams) is the same for both servers, so its own cost falls on both alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
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
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:  # refused while starting, a non-200 answer (HTTPError), a timeout
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


class _Stream:
    """One HTTP/1.1 request on its own loopback connection, its body read as it arrives.

    A plain asyncio stream, not an HTTP library: the client shares the machine with the server it
    measures, so its cost per streamed chunk (a few microseconds here, ~90 with httpx) is kept small.
    Handles chunked and Content-Length bodies, and bodies that end with the connection."""

    def __init__(self, url: str):
        m = re.fullmatch(r"http://([^:/]+):(\d+)", url)
        if not m:
            raise ValueError(f"serving client: expected http://host:port, got {url!r}")
        self.host, self.port = m.group(1), int(m.group(2))

    async def post(self, path: str, body: dict):
        """-> (status, async iterator over the body's lines without their line ends)."""
        data = json.dumps(body).encode()
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
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


async def one(url: str, prompt: list[int], max_tokens: int, t_send: float) -> dict:
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
    status, lines = await _Stream(url).post("/v1/completions", body)
    if status != 200:
        text = b"\n".join([line async for line in lines]).decode(errors="replace")
        raise RuntimeError(f"{url}: HTTP {status}: {text[:300]}")
    async for line in lines:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
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
    """All prompts at once -> {tok_per_s, ttft_p50_s, ttft_p99_s, wall_s, tokens, requests, client_cpu_s}.
    Raises if a request fails or a server generated other than `max_tokens` tokens for one.
    client_cpu_s is this process's CPU time over the round: what the client took from the server."""
    t0, c0 = time.perf_counter(), time.process_time()
    res = await asyncio.gather(*(one(url, p, max_tokens, t0) for p in prompts))
    cpu = time.process_time() - c0
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
        client_cpu_s=cpu,
    )
