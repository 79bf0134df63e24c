"""Shared fixtures for the training tests: a small synthetic corpus and a private k3 cache."""

import json
import random

import pytest


def _document(rng: random.Random, i: int) -> str:
    names = ["alpha", "beta", "gamma", "delta", "total", "value", "items", "count"]
    a, b = rng.choice(names), rng.choice(names)
    body = [f"def {a}_{i}({b}, n={i % 7}):", f'    """Return {b} scaled by n."""', f"    {a} = {b} * n"]
    body += [
        f"    if {a} > {rng.randint(1, 99)}:",
        f"        return {a} - {i % 5}",
        f"    return {a} + 1",
        "",
    ]
    return "\n".join(body)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """~120 KB of regular Python-like text: 960 JSON-lines documents (about 20 land in validation)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    with (root / "corpus.jsonl").open("w") as f:
        for i in range(960):
            f.write(json.dumps({"text": _document(rng, i)}) + "\n")
    return root


@pytest.fixture(autouse=True)
def k3_cache(tmp_path_factory, monkeypatch):
    """Tokenizer / token caches in a per-session temporary directory, never ~/.cache."""
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "k3-cache"))


@pytest.fixture
def make_tc(corpus_dir, tmp_path):
    """TrainConfig factory: k3-nano on the synthetic corpus, writing under tmp_path/<name>."""
    from k3.train.config import nano_smoke

    def make(name: str = "run", **changes):
        return nano_smoke(data=str(corpus_dir), out=str(tmp_path / name), threads=1, **changes)

    return make
