"""`k3 train --qat mx --qat-from-step N`: high precision before step N (bit-identical to a plain run),
fake-quantized from N on, and a resumed run switches at the same step."""

import argparse

import pytest

from k3.quant.qat import QATRoutedExperts, qat_enabled
from k3.train.checkpointing import step_dirs
from k3.train.cli import add_arguments, train_config_from_args
from k3.train.config import TrainConfig
from k3.train.metrics import read_metrics
from k3.train.trainer import Trainer, resume_config


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def test_qat_from_step_switches_at_n_and_resume_keeps_it(nano_run_config, plain_run, tmp_path):
    tc = nano_run_config(
        tmp_path / "qat", model_transforms=("qat-mx",), qat_from_step=2, save_every=1, keep=4
    )
    trainer = Trainer(tc, quiet=True)
    assert any(isinstance(m, QATRoutedExperts) for m in trainer.model.modules())
    assert not qat_enabled(trainer.model)  # built switched off
    trainer.run(measure_peak=False)
    assert qat_enabled(trainer.model)

    plain, qat = _losses(plain_run), _losses(tmp_path / "qat")
    # metrics step k logs the loss of optimizer step k-1: steps 0, 1 high precision, exactly the plain run
    assert [qat[k] for k in (1, 2)] == [plain[k] for k in (1, 2)]
    assert qat[3] != plain[3] and qat[4] != plain[4]  # step 2 on: fake-quantized forward

    # resume from step 1 (before the switch): the saved qat_from_step is used, and may not be changed
    first = [d for d in step_dirs(tmp_path / "qat") if d.name.endswith("00000001")][0]
    with pytest.raises(ValueError, match="qat_from_step"):
        resume_config(first, qat_from_step=3)
    resumed_tc = resume_config(first, out=str(tmp_path / "resumed"))
    assert resumed_tc.qat_from_step == 2
    resumed = Trainer(resumed_tc, resume=first, quiet=True)
    assert not qat_enabled(resumed.model)
    resumed.run(measure_peak=False)
    again = _losses(tmp_path / "resumed")
    assert sorted(again) == [2, 3, 4] and [again[k] for k in (2, 3, 4)] == [qat[k] for k in (2, 3, 4)]


def test_cli_flag():
    p = argparse.ArgumentParser(prog="k3 train")
    add_arguments(p)
    tc = train_config_from_args(p.parse_args(["--qat", "mx", "--qat-from-step", "5"]))
    assert (tc.model_transforms, tc.qat_from_step) == (("qat-mx",), 5)
    assert TrainConfig.from_json(tc.to_json()).qat_from_step == 5
    assert TrainConfig().qat_from_step == 0
    with pytest.raises(ValueError, match="qat_from_step"):
        train_config_from_args(p.parse_args(["--qat-from-step", "5"]))  # without --qat
    with pytest.raises(ValueError, match="qat_from_step"):
        TrainConfig(model_transforms=("qat-mx",), qat_from_step=-1)
