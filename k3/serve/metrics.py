"""`/metrics`: the server's counters, gauges and latency histograms in the Prometheus text format (0.0.4).

HTTP side (this module, updated on the event loop): requests by route and status, time to first token,
time per output token after the first, request latency. Engine side (`AsyncEngine.metrics`, a copy the
engine thread refreshes after every step): tokens in and out, running / waiting / pending requests,
KDA slots and MLA pages in use, cached pages and snapshots, prefix-cache hits, preemptions, aborted and
failed requests. Idle means: 0 running, waiting and pending requests, 0 KDA slots in use, 0 MLA pages
in use by requests and 0 snapshots held by requests (the prefix cache keeps its own pages and snapshots).
"""

from __future__ import annotations

import bisect
from collections import Counter

# latency buckets in seconds (upper bounds; +Inf is implied)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json")


class Histogram:
    """Cumulative-bucket histogram of observations (seconds)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cum += c
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        return [*out, f"{name}_sum {self.sum!r}", f"{name}_count {cum}"]


class ServerMetrics:
    def __init__(self):
        self.http = Counter()  # (route, status) -> responses
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    def count_response(self, path: str, status: int) -> None:
        route = path if path in ROUTES else ("/" if path == "/" or path.startswith("/static/") else "other")
        self.http[(route, status)] += 1

    def observe_request(self, start: float, first: float | None, end: float, tokens: int) -> None:
        """One finished generation: arrival, first token and last token times (perf_counter seconds)."""
        self.latency.observe(end - start)
        if first is not None:
            self.ttft.observe(first - start)
            if tokens > 1:
                self.tpot.observe((end - first) / (tokens - 1))

    def text(self, engine: dict) -> str:
        """The exposition: HTTP metrics, then the engine's counters and gauges (`AsyncEngine.metrics`)."""
        out = ["# HELP k3_http_requests_total HTTP responses by route and status code.",
               "# TYPE k3_http_requests_total counter"]  # fmt: skip
        for (route, status), n in sorted(self.http.items()):
            out.append(f'k3_http_requests_total{{route="{route}",status="{status}"}} {n}')
        for name, h, help_ in (
            ("k3_time_to_first_token_seconds", self.ttft, "Request arrival to its first output token."),
            ("k3_time_per_output_token_seconds", self.tpot, "Mean time per output token after the first."),
            ("k3_request_latency_seconds", self.latency, "Request arrival to its last output token."),
        ):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *h.lines(name)]
        e = engine
        queried = e["prefix_cache_queried_tokens"]
        rows = [
            ("k3_requests_total", "counter", e["requests"], "Requests the engine accepted."),
            ("k3_prompt_tokens_total", "counter", e["prompt_tokens"], "Prompt tokens of accepted requests."),
            ("k3_generation_tokens_total", "counter", e["generated_tokens"], "Output tokens generated."),
            ("k3_aborted_requests_total", "counter", e["aborted_requests"], "Requests aborted (hang-ups)."),
            ("k3_failed_requests_total", "counter", e["failed_requests"], "Requests that failed alone."),
            ("k3_preemptions_total", "counter", e["preemptions"], "Sequences preempted for memory."),
            ("k3_prefix_cache_queried_tokens_total", "counter", queried, "Prompt tokens looked up."),
            ("k3_prefix_cache_hit_tokens_total", "counter", e["prefix_cache_hit_tokens"],
             "Prompt tokens served from the prefix cache."),
            ("k3_prefix_cache_hit_rate", "gauge", e["prefix_cache_hit_tokens"] / queried if queried else 0.0,
             "Hit tokens / queried tokens since start."),
            ("k3_num_requests_running", "gauge", e["running"], "Sequences in the running batch."),
            ("k3_num_requests_waiting", "gauge", e["waiting"], "Sequences waiting for a slot or pages."),
            ("k3_num_requests_pending", "gauge", e["pending"], "Requests in flight (of --max-pending)."),
            ("k3_kda_slots_in_use", "gauge", e["kda_slots_in_use"], "KDA state slots held by sequences."),
            ("k3_kda_slots_total", "gauge", e["kda_slots_total"], "KDA state slots (--max-num-seqs)."),
            ("k3_mla_pages_in_use", "gauge", e["mla_pages_in_use"], "MLA pages held by sequences."),
            ("k3_mla_pages_cached", "gauge", e["mla_pages_cached"], "MLA pages only the prefix cache holds."),
            ("k3_mla_pages_free", "gauge", e["mla_pages_free"], "Free MLA pages."),
            ("k3_mla_pages_total", "gauge", e["mla_pages_total"], "MLA pages (--num-pages)."),
            ("k3_kda_snapshots_cached", "gauge", e["kda_snapshots_cached"], "KDA snapshots in the cache."),
            ("k3_kda_snapshot_bytes", "gauge", e["kda_snapshot_bytes"], "Bytes of cached KDA snapshots."),
            ("k3_kda_snapshots_held", "gauge", e["kda_snapshots_held"],
             "KDA snapshots sequences hold until they register them."),
        ]  # fmt: skip
        for name, kind, value, help_ in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(out) + "\n"
