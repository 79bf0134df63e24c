"""`k3 train` survives kill -9 at random moments: killed >= 10 times (several times inside a checkpoint
write), every checkpoint left on disk loads, `--resume RUN` continues bit for bit (the final weights and
every step's loss equal an uninterrupted run's), and `k3 eval` / `k3 sample` / `k3 serve` take the
killed run's folder (its latest checkpoint) before it ever finished."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import torch

from k3.checkpoint import load_checkpoint
from k3.train.checkpointing import step_dirs
from k3.train.metrics import read_metrics

K3 = [sys.executable, "-c", "import sys; from k3.cli import main; sys.exit(main(sys.argv[1:]))"]
STEPS = 14
KILLS = 10


def _train_args(corpus_dir, out) -> list[str]:
    return [*K3, "train", "--preset", "k3-nano", "--data", str(corpus_dir), "--out", str(out), "--steps",
            str(STEPS), "--seq-len", "64", "--batch-size", "4", "--threads", "1", "--warmup-steps", "2",
            "--eval-tokens", "512", "--sample-tokens", "0", "--save-every", "1", "--keep", "100"]  # fmt: skip


def _env():
    # each save sleeps 0.15 s inside its temporary directory: a window to kill a process mid-write
    return {**os.environ, "K3_TEST_SAVE_DELAY": "0.15", "OMP_NUM_THREADS": "1"}


def _losses(run) -> dict[int, float]:
    """The last logged loss of each step (a killed process may have logged a step it never saved)."""
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"}


def _kill_at_random(cmd, run, rng, mid_write: bool) -> bool:
    """Start `cmd`, SIGKILL it at a random moment (inside a checkpoint write when `mid_write`) ->
    whether it was killed (False: it finished first)."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ck = run / "checkpoints"
    deadline = time.monotonic() + (60 if mid_write else rng.uniform(2.0, 5.5))
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if mid_write and any(ck.glob(".tmp-step-*/train_state.json")):
                break
            time.sleep(0.005)
        killed = proc.poll() is None
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    assert not killed or proc.returncode == -signal.SIGKILL
    assert killed or proc.returncode == 0, proc.stderr.read().decode()[-2000:]
    return killed


def _check_every_checkpoint_loads(run) -> None:
    for d in step_dirs(run):
        model, config = load_checkpoint(d)
        assert config.vocab_size > 0 and all(torch.isfinite(p).all() for p in model.parameters()), d
        state = json.loads((d / "train_state.json").read_text())
        assert state["trainer"]["counters"]["step"] == int(d.name.split("-")[1])


def _served(run) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*K3, "serve", str(run), "--port", str(port), "--max-model-len", "256",
                             "--page-size", "16", "--shutdown-after", "60"], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                time.sleep(0.1)
        body = json.dumps({"model": "kimi-k3", "prompt": "def ", "max_tokens": 3}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        return json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["finish_reason"]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_kill_9_at_random_moments_then_resume_bit_exact(corpus_dir, tmp_path):
    rng = random.Random(0)
    run, ref = tmp_path / "run", tmp_path / "ref"
    kills = mid_write = 0
    cmd = _train_args(corpus_dir, run)
    while kills < KILLS:
        during_write = kills % 3 == 1  # every third kill lands inside a checkpoint write
        if not _kill_at_random(cmd, run, rng, during_write):
            break  # the run finished before the kill: start it again from scratch below
        kills += 1
        mid_write += during_write
        _check_every_checkpoint_loads(run)
        if step_dirs(run):
            cmd = [*K3, "train", "--resume", str(run)]
            if kills == 1 or (kills == 4 and not (run / "model.safetensors").exists()):
                _run_folder_commands(run)
    assert kills >= KILLS and mid_write >= 3, (kills, mid_write)
    assert not (run / "model.safetensors").exists()  # never finished so far
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=300)  # the last resume finishes
    subprocess.run(_train_args(corpus_dir, ref), env=_env(), check=True, capture_output=True, timeout=300)
    _check_every_checkpoint_loads(run)
    assert not list((run / "checkpoints").glob(".tmp-*"))
    a, b = _losses(ref), _losses(run)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert [a[s] for s in a] == [b[s] for s in a]  # exact float equality, step by step
    m1, _ = load_checkpoint(ref)
    m2, _ = load_checkpoint(run)
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def _run_folder_commands(run) -> None:
    """A killed run's folder (checkpoints only) is what eval, sample and serve take."""
    ev = subprocess.run([*K3, "eval", str(run), "--tokens", "512", "--json"], env=_env(), capture_output=True,
                        text=True, timeout=120)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert json.loads(ev.stdout.strip().splitlines()[-1])["val_loss"] > 0
    sample = subprocess.run([*K3, "sample", str(run), "--max-tokens", "4", "--prompt", "def "], env=_env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert sample.returncode == 0 and sample.stdout.startswith("def"), sample.stderr[-2000:]
    assert _served(run) in ("stop", "length")
