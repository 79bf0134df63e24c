"""`k3 train` flags map onto TrainConfig; resume accepts only bookkeeping changes; QAT transform hook."""

import argparse

import pytest

from k3.train.cli import _explicit_changes, add_arguments, train_config_from_args
from k3.train.config import TrainConfig
from k3.train.trainer import Trainer, resume_config


def _parse(*argv):
    p = argparse.ArgumentParser(prog="k3 train")
    add_arguments(p)
    return p.parse_args(argv)


def test_no_flags_is_the_demo_recipe():
    assert train_config_from_args(_parse()) == TrainConfig()
    assert TrainConfig().preset == "k3-mini" and TrainConfig().minutes == 10


def test_flags_map_onto_fields():
    args = _parse(
        "--preset",
        "k3-nano",
        "--steps",
        "7",
        "--lr",
        "0.01",
        "--no-per-head",
        "--bf16",
        "--optimizer",
        "adamw",
        "--schedule",
        "cosine",
        "--qk-clip-tau",
        "50",
        "--grad-accum",
        "2",
        "--qat",
        "mx",
        "--seed",
        "3",
    )
    tc = train_config_from_args(args)
    assert (tc.preset, tc.steps, tc.minutes, tc.lr, tc.per_head, tc.bf16) == (
        "k3-nano",
        7,
        None,
        0.01,
        False,
        True,
    )
    got = (tc.optimizer, tc.schedule, tc.qk_clip_tau, tc.grad_accum, tc.seed)
    assert got == ("adamw", "cosine", 50.0, 2, 3)
    assert tc.model_transforms == ("qat-mx",)
    assert _explicit_changes(_parse("--no-qk-clip")) == {"qk_clip_tau": None}


def test_bad_values_raise_value_error():
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig(seq_len=0)
    with pytest.raises(ValueError, match="model_overrides"):
        TrainConfig(model_overrides={"not_a_key": 1}).model_config()


def test_resume_rejects_recipe_changes(make_tc, tmp_path):
    Trainer(make_tc(steps=1), quiet=True).run(measure_peak=False)
    with pytest.raises(ValueError, match="cannot change"):
        resume_config(tmp_path / "run", lr=0.5)
    assert resume_config(tmp_path / "run", steps=4).steps == 4


def test_qat_transform_trains(make_tc):
    from k3.quant.qat import QATRoutedExperts

    trainer = Trainer(make_tc(steps=2, model_transforms=("qat-mx",)), quiet=True)
    assert any(isinstance(m, QATRoutedExperts) for m in trainer.model.modules())
    summary = trainer.run(measure_peak=False)
    assert summary["skipped_steps"] == 0


def test_schedules():
    from k3.train.trainer import lr_multiplier

    tc = TrainConfig(warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_multiplier(tc, 0, None) == pytest.approx(0.1) and lr_multiplier(tc, 50, None) == 1.0
    cos = [lr_multiplier(tc, s, 100) for s in range(100)]
    assert cos[9] == 1.0 and cos[10] == 1.0 and cos[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(cos[10:], cos[11:], strict=False))
    wsd = [lr_multiplier(tc.replace(schedule="wsd"), s, 100) for s in range(100)]
    assert wsd[10:80] == [1.0] * 70 and wsd[-1] < 0.06


def test_bf16_autocast_trains(make_tc):
    summary = Trainer(make_tc(steps=3, bf16=True), quiet=True).run(measure_peak=False)
    assert summary["skipped_steps"] == 0 and summary["val_loss"] < 7.0


def test_a_minutes_wsd_run_retimes_its_end_only_while_the_lr_holds(make_tc):
    import time

    t = Trainer(make_tc(steps=None, minutes=1.0, schedule="wsd", warmup_steps=2, eval_every=0), quiet=True)
    t.state.update(step=32, total_steps=100)
    t._retime_total([0.01] * 32, deadline=time.perf_counter() + 2.0)  # 2 s left at 10 ms a step
    assert 200 < t.state["total_steps"] < 240  # 32 + ~196
    t.state.update(step=85, total_steps=100)  # past the decay start (80): the end stays
    t._retime_total([0.01] * 32, deadline=time.perf_counter() + 2.0)
    assert t.state["total_steps"] == 100
    t.state.update(step=32, total_steps=100)  # a shorter end whose decay would start before step 32
    t._retime_total([0.01] * 32, deadline=time.perf_counter() + 0.05)
    assert t.state["total_steps"] == 100
