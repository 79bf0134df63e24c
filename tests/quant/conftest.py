"""Shared fixtures of the quantization tests."""

import json
import random

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # tiny ops: threads only contend
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _k3_cache(tmp_path_factory, monkeypatch):
    """Tokenizer / token caches in this test run's temporary directory, never ~/.cache."""
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "k3-cache"))


@pytest.fixture(scope="session")
def qat_corpus(tmp_path_factory):
    """~25 KB of Python-like JSON-lines documents for k3-nano training runs."""
    root = tmp_path_factory.mktemp("qat-corpus")
    rng = random.Random(0)
    with (root / "corpus.jsonl").open("w") as f:
        for i in range(400):
            a, b = rng.choice(["x", "y", "total"]), rng.choice(["n", "items", "value"])
            text = f"def {a}_{i}({b}):\n    return {b} * {i % 7} + {rng.randint(0, 99)}\n"
            f.write(json.dumps({"text": text}) + "\n")
    return root


def _nano_run_config(corpus, out, **changes):
    from k3.train.config import nano_smoke

    return nano_smoke(data=str(corpus), out=str(out), threads=1, steps=4, sample_tokens=0, **changes)


@pytest.fixture
def nano_run_config(qat_corpus):
    """fn(out, **changes) -> TrainConfig of a 4-step FP32 k3-nano run on qat_corpus writing `out`."""
    return lambda out, **changes: _nano_run_config(qat_corpus, out, **changes)


@pytest.fixture(scope="session")
def plain_run(qat_corpus, tmp_path_factory):
    """Directory of a finished plain (no QAT) FP32 k3-nano run."""
    import os

    from k3.train.trainer import Trainer

    out = tmp_path_factory.mktemp("runs") / "plain"
    old = os.environ.get("K3_CACHE_DIR")
    os.environ["K3_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "k3-cache")
    n = torch.get_num_threads()
    try:
        Trainer(_nano_run_config(qat_corpus, out), quiet=True).run(measure_peak=False)
    finally:
        torch.set_num_threads(n)
        if old is None:
            os.environ.pop("K3_CACHE_DIR")
        else:
            os.environ["K3_CACHE_DIR"] = old
    return out
