"""Real `k3 serve` processes (uvicorn on 127.0.0.1) over a random-init k3-nano checkpoint with a trained
512-id tokenizer. Every process stops by itself after a bounded time even if the test run dies."""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

API_KEY = "sk-test"
# the session-wide server outlives every test that uses it however slow the machine (it still stops by itself)
SESSION_LIFETIME_S = 3600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    import torch

    from k3.checkpoint.io import save_checkpoint
    from k3.config import preset
    from k3.model.init import init_weights
    from k3.model.transformer import K3ForCausalLM
    from k3.tokenizer_train import train_tokenizer

    config = preset("k3-nano").replace(dtype="float32")
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    init_weights(model, 0.5, config.num_hidden_layers, seed=0)
    d = save_checkpoint(model, config, tmp_path_factory.mktemp("ckpt") / "nano")
    train_tokenizer(
        ["the quick brown fox jumps over the lazy dog. " * 40], vocab_size=config.vocab_size
    ).save(d)
    return d


class Server:
    """A `k3 serve` subprocess: `.url`, `.proc`; `stop()` ends it."""

    def __init__(self, checkpoint, *flags: str, lifetime_s: int = 300):
        port = _free_port()
        cmd = [sys.executable, "-m", "k3.serve.cli", str(checkpoint), "--port", str(port),
               "--shutdown-after", str(lifetime_s), *flags]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if self.proc.poll() is not None:
                pytest.fail(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                time.sleep(0.1)
        self.proc.kill()
        pytest.fail("server did not come up in 60 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def server(checkpoint):
    s = Server(checkpoint, "--api-key", API_KEY, "--max-model-len", "1024", "--page-size", "16",
               "--max-num-seqs", "4", "--max-pending", "2", "--max-body-bytes", "20000",
               lifetime_s=SESSION_LIFETIME_S)  # fmt: skip
    yield s.url
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def get_metrics(url: str, key: str | None = API_KEY) -> dict:
    """/metrics parsed by prometheus_client's parser -> {sample name (+ labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


IDLE = ("k3_num_requests_running", "k3_num_requests_waiting", "k3_num_requests_pending",
        "k3_kda_slots_in_use", "k3_mla_pages_in_use", "k3_kda_snapshots_held")  # fmt: skip


def wait_idle(url: str, timeout: float, key: str | None = API_KEY) -> dict:
    """Poll /metrics until every IDLE gauge is 0 (or the timeout) -> the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = get_metrics(url, key)
        if all(m[g] == 0 for g in IDLE) or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


@pytest.fixture(scope="session")
def scrape():
    """scrape(url, key=API_KEY) -> /metrics parsed by prometheus_client (`get_metrics`)."""
    return get_metrics


@pytest.fixture(scope="session")
def idle():
    """idle(url, timeout) -> metrics once every IDLE gauge is 0 (`wait_idle`)."""
    return wait_idle


@pytest.fixture(scope="session")
def launch():
    """launch(checkpoint, *flags) -> a started `Server`."""
    return Server
