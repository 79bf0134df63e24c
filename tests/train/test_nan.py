"""Non-finite losses / gradients skip the step; N in a row stop the run; NaN never reaches the disk."""

import pytest
import torch

import k3.train.step as step_mod
from k3.checkpoint import load_checkpoint
from k3.train.checkpointing import save_training_checkpoint, step_dirs
from k3.train.metrics import read_metrics
from k3.train.trainer import Trainer, TrainingStopped

real_forward_loss = step_mod.forward_loss


class NanGrad(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss with poisoned gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


def _poison(monkeypatch, bad_calls: set[int], kind: str = "loss"):
    calls = {"n": 0}

    def forward_loss(model, batch, bf16):
        calls["n"] += 1
        loss = real_forward_loss(model, batch, bf16)
        if calls["n"] in bad_calls:
            return loss * float("nan") if kind == "loss" else NanGrad.apply(loss)
        return loss

    monkeypatch.setattr(step_mod, "forward_loss", forward_loss)


def _finite(model):
    return all(torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point())


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_bad_steps_are_skipped(make_tc, tmp_path, monkeypatch, kind):
    _poison(monkeypatch, {3, 4}, kind)
    summary = Trainer(make_tc(steps=6), quiet=True).run(measure_peak=False)
    assert summary["skipped_steps"] == 2 and summary["steps"] == 6
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in recs if r.get("event") == "skipped_non_finite"] == [3, 4]
    model, _ = load_checkpoint(tmp_path / "run")
    assert _finite(model)


def test_a_streak_stops_the_run_and_disk_stays_finite(make_tc, tmp_path, monkeypatch):
    _poison(monkeypatch, set(range(3, 100)))
    trainer = Trainer(make_tc(steps=20, save_every=1, keep=50, max_bad_steps=3), quiet=True)
    with pytest.raises(TrainingStopped, match="3 consecutive non-finite"):
        trainer.run(measure_peak=False)
    assert trainer.state["step"] == 5  # steps 3, 4, 5 were bad
    dirs = step_dirs(tmp_path / "run")
    assert dirs and all(_finite(load_checkpoint(d)[0]) for d in dirs)


def test_saving_non_finite_weights_is_refused(make_tc, tmp_path):
    trainer = Trainer(make_tc(steps=1), quiet=True)
    with torch.no_grad():
        trainer.model.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        save_training_checkpoint(tmp_path / "run", 1, trainer.model, trainer.config, trainer.optimizers, {})
    assert step_dirs(tmp_path / "run") == []
