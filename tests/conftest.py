"""Fixtures shared across test directories."""

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def trained_nano(tmp_path_factory):
    """A `k3 train` run directory: k3-nano trained for 150 steps on the embedded corpus (~2.2 bits/byte,
    about a minute on 2 cores), a model whose choices have the near-ties of a trained one."""
    out = tmp_path_factory.mktemp("trained") / "nano"
    cmd = [sys.executable, "-m", "k3.cli", "train", "--preset", "k3-nano", "--steps", "150",
           "--out", str(out), "--sample-tokens", "0", "--threads", "2"]  # fmt: skip
    env = {**os.environ, "K3_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "k3-cache")}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        pytest.fail(f"`{' '.join(cmd[2:])}` failed:\n{run.stderr[-3000:]}")
    return out
