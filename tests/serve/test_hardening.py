"""The server against what a user (or a fuzzer, or a hostile client) can send: one bad request fails
alone, hang-ups free everything, bodies and headers are capped as they arrive, errors carry the headers
HTTP asks for, and the documents (/openapi.json, /metrics) say what the server does."""

import http.client
import json
import select
import socket
import threading
import time
import urllib.parse

import pytest

API_KEY = "sk-test"  # the key conftest's servers take

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def busy(checkpoint, launch):
    """A server for concurrent clients: 16 slots, room for 70 requests in flight."""
    s = launch(checkpoint, "--api-key", API_KEY, "--max-model-len", "512", "--page-size", "16",
               "--num-pages", "640", "--max-num-seqs", "16", "--max-pending", "70",
               "--max-body-bytes", "20000", "--max-header-bytes", "8192")  # fmt: skip
    yield s.url
    s.stop()


def request(url: str, method: str, path: str, body=None, headers=AUTH, timeout: float = 60):
    """-> (status, headers dict (lower-case names), parsed JSON or text)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    hdrs = {k.lower(): v for k, v in r.getheaders()}
    return r.status, hdrs, json.loads(raw) if "json" in hdrs.get("content-type", "") else raw.decode()


def raw_socket(url: str) -> socket.socket:
    u = urllib.parse.urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def http_head(path: str, body_len: int | None, url: str, extra: str = "") -> bytes:
    length = f"Content-Length: {body_len}\r\n" if body_len is not None else "Transfer-Encoding: chunked\r\n"
    host = urllib.parse.urlparse(url).netloc
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\n{length}{extra}\r\n").encode()  # fmt: skip


def completion(prompt="the fox", **kw) -> dict:
    return {"model": "kimi-k3", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


# ---- one request fails alone ----------------------------------------------------------------------------
def test_tiny_temperature_fails_no_neighbour(busy):
    """temperature 1e-300 passes validation; it must neither break sampling nor its batch."""
    bodies = [completion(temperature=1e-300, max_tokens=24), completion("the lazy dog", max_tokens=24),
              completion("quick brown", max_tokens=24)]  # fmt: skip
    out = [None] * 3
    post = lambda i: out.__setitem__(i, request(busy, "POST", "/v1/completions", bodies[i]))
    threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [o[0] for o in out] == [200, 200, 200], [o[2] for o in out]
    greedy = request(busy, "POST", "/v1/completions", completion(max_tokens=24))[2]
    assert out[0][2]["choices"][0]["text"] == greedy["choices"][0]["text"]  # the limit of T -> 0


def test_lone_surrogate_answers_400_in_json(busy):
    body = b'{"model": "kimi-k3", "prompt": "a\\ud800b", "max_tokens": 2}'
    status, hdrs, err = request(busy, "POST", "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == "prompt" and "surrogate" in err["error"]["message"]
    chat = b'{"model": "kimi-k3", "messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 2}'
    status, _, err = request(busy, "POST", "/v1/chat/completions", chat)
    assert status == 400 and err["error"]["param"] == "messages.0.content"
    assert request(busy, "POST", "/v1/completions", completion())[0] == 200  # the server goes on


def test_non_json_numbers_and_content_types(busy):
    assert (
        request(busy, "POST", "/v1/completions", b'{"model": "kimi-k3", "prompt": "a", "seed": NaN}')[0]
        == 400
    )
    form = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}
    assert request(busy, "POST", "/v1/completions", completion(), headers=form)[0] == 415


# ---- hang-ups ---------------------------------------------------------------------------------------------
def test_hangups_free_everything(busy, scrape, idle):
    """20 streaming and 20 non-streaming clients vanish mid-request (running or still queued): within a
    second every slot, page, snapshot and pending place is free, and 16 new concurrent requests all
    complete."""
    socks = []
    for i in range(40):
        body = json.dumps(completion(f"the quick brown fox {i}", max_tokens=480, stream=i % 2 == 0)).encode()
        s = raw_socket(busy)
        s.sendall(http_head("/v1/completions", len(body), busy) + body)
        socks.append(s)
    deadline = time.monotonic() + 20
    m = scrape(busy)
    while (
        m["k3_num_requests_pending"] < 40 or m["k3_kda_slots_in_use"] < 16
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
        m = scrape(busy)
    assert m["k3_num_requests_pending"] == 40 and m["k3_kda_slots_in_use"] == 16
    started = select.select(socks[::2], [], [], 2.0)[0]
    assert started and all(s.recv(64).startswith(b"HTTP/1.1 200") for s in started)  # streams under way
    for s in socks:
        s.close()
    t0 = time.monotonic()
    m = idle(busy, timeout=1.0)
    assert all(m[g] == 0 for g in ("k3_num_requests_pending", "k3_num_requests_running",
               "k3_num_requests_waiting", "k3_kda_slots_in_use", "k3_mla_pages_in_use",
               "k3_kda_snapshots_held")), (m, time.monotonic() - t0)  # fmt: skip
    assert m["k3_aborted_requests_total"] >= 40, m
    out = [None] * 16
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(
        i, request(busy, "POST", "/v1/completions", completion(f"dog {i}", max_tokens=16))[0]))
        for i in range(16)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [200] * 16


def test_non_streaming_hangups_stop_generating(busy, scrape):
    """A non-streaming request whose client hangs up stops at once (it used to generate to the end and
    keep its --max-pending place)."""
    socks = []
    for i in range(8):
        body = json.dumps(completion(f"lazy dog {i}", max_tokens=480)).encode()
        s = raw_socket(busy)
        s.sendall(http_head("/v1/completions", len(body), busy) + body)
        socks.append(s)
    deadline = time.monotonic() + 20
    while scrape(busy)["k3_num_requests_running"] < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    for s in socks:
        s.close()
    deadline = time.monotonic() + 1.0
    while scrape(busy)["k3_num_requests_running"] > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    m = scrape(busy)
    assert m["k3_num_requests_running"] == 0 and m["k3_num_requests_waiting"] == 0
    time.sleep(0.2)
    assert scrape(busy)["k3_generation_tokens_total"] == m["k3_generation_tokens_total"]  # nothing goes on


# ---- caps -------------------------------------------------------------------------------------------------
def test_chunked_body_is_refused_as_it_streams_in(busy):
    """A chunked upload over --max-body-bytes gets 413 while the client is still sending (before, the
    whole body was read first: 400 MB resident before the answer)."""
    s = raw_socket(busy)
    s.sendall(http_head("/v1/completions", None, busy))
    chunk = b'{"model": "kimi-k3", "prompt": "' + b"x" * 8000
    for _ in range(4):  # 32 KB > the 20 KB cap, and no terminating chunk: the body never ends
        s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    s.settimeout(10)
    head = s.recv(4096)
    s.close()
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_header_block_is_capped(busy):
    status, _, err = request(busy, "GET", "/v1/models", headers={**AUTH, "X-Pad": "y" * 20_000})
    assert status == 431 and err["error"]["code"] == 431
    assert request(busy, "GET", "/v1/models")[0] == 200


# ---- what HTTP asks for -----------------------------------------------------------------------------------
def test_error_headers(busy):
    status, hdrs, err = request(busy, "PUT", "/v1/completions", completion())
    assert status == 405 and hdrs["allow"] == "POST" and err["error"]["code"] == 405
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        status, hdrs, err = request(busy, "GET", path, headers={})
        assert status == 401 and hdrs["www-authenticate"] == "Bearer" and err["error"]["type"]
    assert request(busy, "GET", "/health", headers={})[0] == 200


def test_queue_full_answers_503_with_retry_after_and_recovers(server):
    """conftest's shared server holds 2 requests in flight (--max-pending 2)."""
    socks = []
    for _ in range(2):
        body = json.dumps(completion(max_tokens=500, stream=True)).encode()
        s = raw_socket(server)
        s.sendall(http_head("/v1/completions", len(body), server) + body)
        assert s.recv(64).startswith(b"HTTP/1.1 200")
        socks.append(s)
    status, hdrs, err = request(server, "POST", "/v1/completions", completion())
    assert status == 503 and hdrs["retry-after"] == "1" and err["error"]["type"] == "server_overloaded"
    for s in socks:
        s.close()
    deadline = time.monotonic() + 10
    while request(server, "POST", "/v1/completions", completion())[0] == 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert request(server, "POST", "/v1/completions", completion())[0] == 200


# ---- the documents ----------------------------------------------------------------------------------------
def test_openapi_documents_bodies_statuses_and_media_types(busy):
    status, _, doc = request(busy, "GET", "/openapi.json")
    assert status == 200
    for path in ("/v1/chat/completions", "/v1/completions"):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("Request")
        assert {"200", "400", "401", "404", "413", "415", "422", "500", "503"} <= set(op["responses"])
        ok = op["responses"]["200"]["content"]
        assert "application/json" in ok and "itemSchema" in ok["text/event-stream"]
        assert op["responses"]["503"]["headers"]["Retry-After"]["required"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    schemas = doc["components"]["schemas"]
    assert schemas["ChatCompletion"]["properties"]["choices"] and schemas["ModelList"]["properties"]["data"]
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == ["kimi-k3"]
    assert "ImagePart" not in schemas  # this checkpoint has no vision
    status, hdrs, _ = request(busy, "GET", "/metrics")
    assert status == 200 and hdrs["content-type"].startswith("text/plain")


CASES = [("n", 1.0, 200), ("n", "1", 422), ("max_tokens", 2.0, 200), ("max_tokens", True, 422),
         ("temperature", "0", 422), ("temperature", 0, 200), ("max_tokens", 513, 422)]  # fmt: skip


@pytest.mark.parametrize(("field", "value", "status"), CASES)
def test_validation_follows_json_types(busy, field, value, status):
    assert request(busy, "POST", "/v1/completions", completion(**{field: value}))[0] == status


def test_metrics_parse_as_prometheus_text(busy, scrape):
    request(busy, "POST", "/v1/completions", completion(stream=True))
    request(busy, "POST", "/v1/completions", completion(model="nope"))
    m = scrape(busy)
    assert m["k3_http_requests_total{route=/v1/completions,status=200}"] >= 1
    assert m["k3_http_requests_total{route=/v1/completions,status=404}"] >= 1
    assert m["k3_time_to_first_token_seconds_count"] >= 1 and m["k3_time_per_output_token_seconds_count"] >= 1
    assert m["k3_kda_slots_total"] == 16 and m["k3_mla_pages_total"] == 640
    assert m["k3_mla_pages_cached"] > 0 and 0 <= m["k3_prefix_cache_hit_rate"] <= 1
    assert m["k3_generation_tokens_total"] >= 8 and m["k3_prompt_tokens_total"] > 0


def test_no_request_fetches_a_url(busy):
    """An image part naming a URL on a text-only server is refused, and nothing connects to it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"
    for target in (url, "file:///etc/passwd"):
        content = [{"type": "image_url", "image_url": {"url": target}}, {"type": "text", "text": "hi"}]
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        assert request(busy, "POST", "/v1/chat/completions", body)[0] in (400, 422)
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
