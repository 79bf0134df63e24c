"""`--resume` reproduces the uninterrupted run bit for bit on CPU (losses, weights, router biases)."""

import torch

from k3.checkpoint import load_checkpoint
from k3.train.checkpointing import step_dirs
from k3.train.metrics import read_metrics
from k3.train.trainer import Trainer, resume_config


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def test_resume_is_bit_exact(make_tc, tmp_path):
    tc = make_tc("straight", steps=6, save_every=3, keep=3, grad_accum=2)
    Trainer(tc, quiet=True).run(measure_peak=False)
    straight = tmp_path / "straight"
    half = [d for d in step_dirs(straight) if d.name.endswith("00000003")][0]

    resumed_tc = resume_config(half, out=str(tmp_path / "resumed"))
    trainer = Trainer(resumed_tc, resume=half, quiet=True)
    assert trainer.state["step"] == 3
    trainer.run(measure_peak=False)

    a, b = _losses(straight), _losses(tmp_path / "resumed")
    assert sorted(b) == [4, 5, 6]
    assert [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]  # exact float equality
    m1, _ = load_checkpoint(straight)
    m2, _ = load_checkpoint(tmp_path / "resumed")
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_resume_in_place_continues_the_run(make_tc, tmp_path):
    tc = make_tc("run", steps=3)
    Trainer(tc, quiet=True).run(measure_peak=False)
    run = tmp_path / "run"
    Trainer(resume_config(run, steps=5), resume=run, quiet=True).run(measure_peak=False)
    assert sorted(_losses(run)) == [1, 2, 3, 4, 5]
    assert [d.name for d in step_dirs(run)] == ["step-00000003", "step-00000005"]
