"""64 concurrent clients x 5 greedy requests against a live server: no failures, and every answer
equals the same prompt sent alone on the idle server (k3.serve.loadgen; each prompt is asked by five
clients at once, so prefix-cache hits under load are in it). Timings are not asserted: docs/benchmarks.md
has them with their command."""

import asyncio

from k3.serve.loadgen import run

API_KEY = "sk-test"


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
