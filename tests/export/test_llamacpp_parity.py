"""k3 against llama.cpp's kimi-k3 on the same weights: a k3-nano trained 200 steps, exported to GGUF.

Trained on the stdlib's top-level modules; held out: whole packages it never saw (email, http, json,
urllib, xml). The comparison itself is bench/parity_llamacpp.py, run here as users run it.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3.data.corpus import stdlib_root

ROOT = Path(__file__).resolve().parents[2]
HELD_OUT = ("email", "http", "json", "urllib", "xml")


def _run(args: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (
        f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )
    return r


@pytest.fixture(scope="module")
def trained(tmp_path_factory, llamacpp):
    """(run folder of a k3-nano trained 200 steps, held-out folder, env)."""
    tmp = tmp_path_factory.mktemp("parity")
    train, held = tmp / "train", tmp / "held"
    train.mkdir()
    for f in sorted(stdlib_root().glob("*.py")):
        shutil.copy(f, train / f.name)
    for pkg in HELD_OUT:
        shutil.copytree(stdlib_root() / pkg, held / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, K3_CACHE_DIR=str(tmp / "cache"))
    run = tmp / "run"
    cmd = [
        sys.executable,
        "-m",
        "k3.cli",
        "train",
        "--preset",
        "k3-nano",
        "--data",
        str(train),
        "--out",
        str(run),
    ]
    cmd += ["--steps", "200", "--batch-size", "8", "--seq-len", "128", "--eval-every", "0", "--threads", "2"]
    _run(cmd, env, timeout=900)
    return run, held, env


@pytest.fixture(scope="module")
def report(trained, tmp_path_factory):
    run, held, env = trained
    out = tmp_path_factory.mktemp("parity-report") / "parity.json"
    cmd = [sys.executable, "bench/parity_llamacpp.py", "--checkpoint", str(run), "--data", str(held)]
    cmd += [
        "--data-split",
        "all",
        "--positions",
        "1536",
        "--prompts",
        "8",
        "--new",
        "128",
        "--json",
        str(out),
    ]
    _run(cmd, env, timeout=900)
    return json.loads(out.read_text())["report"]


def test_tokenization_is_identical(report):
    t = report["tokenization"]
    assert t["documents"] >= 20 and t["tokens"] > 50_000
    assert t["mismatched_documents"] == 0, t["first_mismatch"]


def test_f32_logits_agree(report):
    f32 = report["outtypes"]["f32"]
    assert f32["positions"] == 1536
    assert f32["top1"] >= 0.999, f32
    assert f32["mean_kl"] <= 1e-5, f32
    assert abs(f32["ppl_k3"] / f32["ppl_llama"] - 1) <= 5e-4, f32
    # rounding differences only, wherever no router decision is a near-tie
    assert f32["max_abs_diff_clear_margin"] <= 1e-3, f32


def test_greedy_continuations_agree(report):
    g = report["greedy"]
    assert g["prompts"] == 8
    for run in g["runs"]:  # identical, or diverging right after a router near-tie on k3's side
        assert run["identical"] or run["margin_at_divergence"] < 1e-4, run


@pytest.mark.parametrize("outtype", ["bf16", "q8_0", "mxfp4"])
def test_quantized_ggufs_track_k3_at_the_same_precision(report, outtype):
    """Rounding, not a layout error: a misplaced block or scale gives near-random picks (top-1 < 0.5)."""
    s = report["outtypes"][outtype]
    assert s["top1"] >= 0.95 and s["mean_kl"] <= 2e-3, s
    assert abs(s["ppl_k3"] / s["ppl_llama"] - 1) <= 0.01, s


def test_llama_completion_runs_a_k3_gguf(trained, llamacpp, tmp_path):
    run, _, env = trained
    gguf = tmp_path / "nano.gguf"
    _run(
        [sys.executable, "-m", "k3.cli", "export", str(run), "--format", "gguf", "--out", str(gguf)], env, 300
    )
    cmd = [str(llamacpp.bin / "llama-completion"), "-m", str(gguf), "-p", "def main(", "-n", "24"]
    cmd += ["--temp", "0", "-no-cnv", "-t", "2", "--no-warmup"]
    r = _run(cmd, env, timeout=120)
    assert r.stdout.startswith("def main(") and len(r.stdout) > len("def main(") + 10, r.stdout
