"""A real `k3 serve` process (uvicorn on 127.0.0.1) over a random-init k3-nano checkpoint with a trained
512-id tokenizer. The process stops by itself after a bounded time even if the test run dies."""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

API_KEY = "sk-test"


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
    from k3.tokenizer import train_tokenizer

    config = preset("k3-nano").replace(dtype="float32")
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    init_weights(model, 0.5, config.num_hidden_layers, seed=0)
    d = save_checkpoint(model, config, tmp_path_factory.mktemp("ckpt") / "nano")
    train_tokenizer(["the quick brown fox jumps over the lazy dog. " * 40], vocab_size=512).save(d)
    return d


@pytest.fixture(scope="session")
def server(checkpoint):
    port = _free_port()
    cmd = [sys.executable, "-m", "k3.serve.cli", str(checkpoint), "--port", str(port), "--api-key", API_KEY,
           "--max-model-len", "1024", "--page-size", "16", "--max-num-seqs", "4", "--max-pending", "2",
           "--max-body-bytes", "20000", "--shutdown-after", "300"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("server did not come up in 60 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
