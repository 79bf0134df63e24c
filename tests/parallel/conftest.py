"""Fixtures of the k3.parallel tests: a world-of-one gloo process group for the in-process tests
(module-scoped, torn down) and a tiny generated corpus for the distributed training runs."""

import json
import random
import socket

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world1():
    from k3.parallel.mesh import ParallelDims, build_mesh

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield build_mesh(ParallelDims(1, 1))
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """~60 KB of regular Python-like text: 480 JSON-lines documents (about 10 land in validation)."""
    rng = random.Random(0)
    names = ["alpha", "beta", "gamma", "delta", "total", "value", "items", "count"]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with path.open("w") as f:
        for i in range(480):
            a, b = rng.choice(names), rng.choice(names)
            text = f"def {a}_{i}({b}, n={i % 7}):\n    {a} = {b} * n\n    if {a} > {rng.randint(1, 99)}:\n"
            text += f"        return {a} - {i % 5}\n    return {a} + 1\n"
            f.write(json.dumps({"text": text}) + "\n")
    return path
