"""CI smoke test: k3-nano trains for a few steps, the loss falls, and the run directory is a checkpoint
that k3.checkpoint, `k3 eval` and `k3 sample` accept."""

import json

import pytest
import torch

from k3.checkpoint import load_checkpoint
from k3.cli import main
from k3.train.metrics import read_metrics
from k3.train.trainer import Trainer


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory):
    from k3.train.config import nano_smoke

    out = tmp_path_factory.mktemp("smoke") / "run"
    tc = nano_smoke(
        data=str(corpus_dir), out=str(out), steps=12, eval_every=6, lr=0.03, adamw_lr=0.01, threads=1
    )
    summary = Trainer(tc, quiet=True).run(measure_peak=False)
    return out, summary


def test_loss_falls_and_metrics_are_written(trained):
    out, summary = trained
    recs = read_metrics(out / "metrics.jsonl")
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 13))
    first, last = sum(r["loss"] for r in train[:2]) / 2, sum(r["loss"] for r in train[-2:]) / 2
    assert last < first - 1.0, (first, last)
    assert len(evals) == 2 and evals[-1]["val_loss"] < 6.0
    assert 0 < summary["val_bpb"] < summary["unigram_bpb"] * 1.5
    assert all("moe_load_max" in r and r["moe_load_max"] >= 1.0 >= r["moe_load_min"] for r in train)
    assert all(len(r["max_logit"]) == 1 for r in train)  # one MLA layer in k3-nano
    assert (out / "loss.png").stat().st_size > 1000
    assert summary["skipped_steps"] == 0 and summary["steps"] == 12


def test_run_dir_is_a_loadable_checkpoint(trained):
    out, summary = trained
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).exists(), name
    model, config = load_checkpoint(out)
    assert config.vocab_size == 1024
    ids = torch.randint(0, 256, (1, 8))
    assert torch.isfinite(model(ids).logits).all()
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and any(b.abs().sum() > 0 for b in biases)  # Quantile Balancing moved them


def test_k3_eval_and_sample(trained, capsys):
    out, summary = trained
    assert main(["eval", str(out), "--json"]) == 0  # the run's settings: its final evaluation again
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] > 0 and res["val_bpb"] == pytest.approx(summary["val_bpb"], rel=1e-6)
    assert (
        main(["sample", str(out), "--prompt", "def alpha", "--max-tokens", "12", "--temperature", "0"]) == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("def alpha") and len(text) > len("def alpha")
    assert main(["eval", str(out / "nope")]) == 2  # a user error, reported without a traceback
