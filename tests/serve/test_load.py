"""k3.serve.loadgen, the one load client of tests, docs and benches. `burst` (the llama.cpp comparison's
load) against a live `k3 serve` (every request streamed to its last token, HTTP errors raised with the
server's message) and against a loopback stub answering in each HTTP/1.1 body framing (chunked,
Content-Length, ended by close); `run` with 64 concurrent clients x 5 greedy requests against a live
server: no failures, and every answer equals the same prompt sent alone on the idle server (each prompt
is asked by five clients at once, so prefix-cache hits under load are in it). Timings are not asserted:
docs/benchmarks.md has them with their command."""

import asyncio
import json

import pytest

from k3.serve.loadgen import burst, pct, run

API_KEY = "sk-test"


def test_load_streams_every_token_of_every_request(checkpoint, launch):
    s = launch(checkpoint, "--max-model-len", "256", "--page-size", "16", "--max-num-seqs", "4")
    try:
        out = asyncio.run(burst(s.url, [[5, 6, 7, 8], [9, 10], [11, 12, 13]], max_tokens=6))
        with pytest.raises(RuntimeError, match="HTTP 422.*token ids must be in"):
            asyncio.run(burst(s.url, [[10**9]], max_tokens=2))
    finally:
        s.stop()
    assert out["requests"] == 3 and out["tokens"] == 18
    assert 0 < out["ttft_p50_s"] <= out["ttft_p99_s"] <= out["wall_s"]
    assert out["tok_per_s"] == pytest.approx(18 / out["wall_s"]) and out["client_cpu_s"] >= 0


EVENTS = [{"choices": [{"text": t}]} for t in "abc"] + [{"choices": [], "usage": {"completion_tokens": 3}}]
SSE = "".join(f"data: {json.dumps(e)}\n\n" for e in EVENTS) + "data: [DONE]\n\n"


def _reply(framing: str) -> bytes:
    body = SSE.encode()
    if framing == "chunked":  # split mid-line: lines must be joined across chunks
        parts = [body[i : i + 7] for i in range(0, len(body), 7)]
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
        return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + payload
    if framing == "length":
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    return b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
def test_stream_reads_each_body_framing(framing):
    async def main():
        seen = []

        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            fields = dict(h.lower().split(b": ", 1) for h in head.split(b"\r\n")[1:] if h)
            length = int(fields[b"content-length"])
            seen.append(json.loads(await reader.readexactly(length)))
            writer.write(_reply(framing))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            out = await burst(f"http://127.0.0.1:{port}", [[1, 2]], max_tokens=3)
        return out, seen

    out, seen = asyncio.run(asyncio.wait_for(main(), 30))
    assert out["tokens"] == 3 and out["requests"] == 1
    assert seen[0]["prompt"] == [1, 2] and seen[0]["stream"] is True and seen[0]["max_tokens"] == 3


def test_percentiles_interpolate_between_ranks():
    assert pct([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5 and pct([1.0], 0.99) == 1.0 and pct([5.0, 1.0], 1.0) == 5.0


def test_64_clients_x_5_greedy_equal_alone(checkpoint, launch, idle):
    s = launch(checkpoint, "--api-key", API_KEY, "--max-model-len", "512", "--page-size", "16",
               "--num-pages", "640", "--max-num-seqs", "16", "--max-pending", "70")  # fmt: skip
    try:
        m = asyncio.run(run(s.url, clients=64, requests=5, max_tokens=16, key=API_KEY, check_alone=True))
        after = idle(s.url, timeout=5)
    finally:
        s.stop()
    assert m["requests"] == 320 and m["failures"] == 0, m["errors"]
    assert m["mismatches"] == 0
    assert m["tok_per_s"] > 0 and after["k3_kda_slots_in_use"] == 0
