"""A SIGKILL during a save leaves the previous checkpoint loadable; Ctrl-C saves and exits cleanly."""

import os
import signal
import subprocess
import sys
import time

from k3.checkpoint import load_checkpoint
from k3.train.checkpointing import resolve_checkpoint, step_dirs
from k3.train.metrics import read_metrics
from k3.train.trainer import Trainer

TRAIN = [sys.executable, "-c", "import sys; from k3.cli import main; sys.exit(main(sys.argv[1:]))", "train"]


def _nano_args(corpus_dir, out, *extra):
    return [
        *TRAIN,
        "--preset",
        "k3-nano",
        "--data",
        str(corpus_dir),
        "--out",
        str(out),
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--threads",
        "1",
        "--warmup-steps",
        "2",
        "--eval-tokens",
        "512",
        "--sample-tokens",
        "4",
        *extra,
    ]


def _wait_for(cond, timeout: float, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    return False


def test_sigkill_during_save_keeps_the_previous_checkpoint(make_tc, tmp_path):
    run = tmp_path / "run"
    Trainer(make_tc(steps=2), quiet=True).run(measure_peak=False)  # complete checkpoint step-2
    env = dict(os.environ, K3_TEST_SAVE_DELAY="120")
    proc = subprocess.Popen(
        [*TRAIN, "--resume", str(run), "--steps", "3"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    ck = run / "checkpoints"
    try:
        partial = lambda: [p for p in ck.glob(".tmp-step-00000003-*") if (p / "train_state.json").exists()]
        assert _wait_for(partial, 60, proc), "the save never started"
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [d.name for d in step_dirs(run)] == ["step-00000002"]
    latest = resolve_checkpoint(run)
    model, config = load_checkpoint(latest)
    assert config.vocab_size == 1024 and sum(p.numel() for p in model.parameters()) > 0
    # the next run resumes from step 2 and cleans the debris up
    Trainer(make_tc(steps=3), resume=run, quiet=True).run(measure_peak=False)
    assert [d.name for d in step_dirs(run)] == ["step-00000002", "step-00000003"]
    assert not list(ck.glob(".tmp-*"))


def test_ctrl_c_saves_and_exits(corpus_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        _nano_args(corpus_dir, out, "--steps", "100000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    trained = lambda: any(r["kind"] == "train" for r in read_metrics(out / "metrics.jsonl"))
    try:
        assert _wait_for(trained, 60, proc), "no step was trained"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "--resume" in stderr
    step = max(r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train")
    assert step < 100000 and step_dirs(out)[-1].name == f"step-{step:08d}"
    load_checkpoint(out)
    assert "| k3 train" in stdout
