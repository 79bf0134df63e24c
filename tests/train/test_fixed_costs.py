"""A run's fixed costs are phases with seconds in the progress output and the summary; the final
evaluation is bounded or skipped by final_eval_tokens."""

import json

from k3.train.trainer import Trainer


def test_phases_are_printed_and_summed_and_no_final_eval_skips_its_costs(make_tc, capsys):
    summary = Trainer(make_tc(steps=2, final_eval_tokens=0), progress=False).run(measure_peak=False)
    out = capsys.readouterr().out
    phases = summary["phases"]
    for name in ("data", "model", "baselines", "matmul peak", "checkpoint", "samples", "plots"):
        assert name in phases and phases[name] >= 0, name
        assert f"|   {name} " in out  # a row of the summary table
    for name in ("data", "model", "checkpoint", "samples"):
        assert f"\n{name}: " in "\n" + out  # printed as it ends
    assert "final eval" not in phases and summary["val_bpb"] is None and summary["baselines_bpb"] == {}
    assert "no final evaluation" in out
    assert sum(phases.values()) < summary["wall_seconds"]
    with open(summary["out"] + "/summary.json") as f:
        assert json.load(f)["phases"] == phases


def test_final_eval_tokens_bounds_the_scored_targets_and_the_baselines_bytes(make_tc):
    t = Trainer(make_tc(steps=1, final_eval_tokens=100, sample_tokens=0), quiet=True)
    summary = t.run(measure_peak=False)
    assert summary["val_tokens"] == 128 < summary["val_tokens_total"]  # two whole rows of 64
    assert set(summary["baselines_bpb"]) == {"gzip -9", "bz2 -9", "xz -9e", "unigram"}
    assert t._final_eval_rows() == 2
    assert abs(summary["val_bytes"] - len(_prefix_bytes(t))) <= 3


def _prefix_bytes(trainer) -> bytes:
    from k3.train.baselines import eval_rows_bytes

    return eval_rows_bytes(trainer.eval_set, 2, trainer.tokenizer)


def test_short_steps_runs_cap_the_default_final_eval_at_three_times_their_training(make_tc):
    """By default the final evaluation scores the whole split, unless a `--steps` run trains on fewer
    tokens than a third of it (scoring would cost more than the training): then it scores
    max(eval_tokens, 3 x the training tokens), and says so. An explicit final_eval_tokens always wins,
    and a run long enough scores everything."""
    probe = Trainer(make_tc("probe", steps=1, sample_tokens=0, eval_tokens=64), quiet=True)
    split = probe.eval_set.rows * probe.eval_set.seq_len
    tokens_per_step = probe.tc.batch_size * probe.tc.seq_len
    assert 3 * tokens_per_step < split, "the synthetic corpus's split must be larger than 3 steps"
    assert probe.final_eval_limit() == max(64, 3 * tokens_per_step)
    summary = probe.run(measure_peak=False)
    assert summary["val_tokens"] < summary["val_tokens_total"]
    long_steps = -(-split // (3 * tokens_per_step))
    assert Trainer(make_tc("long", steps=long_steps), quiet=True).final_eval_limit() is None
    assert (
        Trainer(make_tc("explicit", steps=1, final_eval_tokens=10**9), quiet=True).final_eval_limit() == 10**9
    )
