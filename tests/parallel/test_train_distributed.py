"""`k3 train --nproc 2 --ep 2` (2 CPU processes, gloo, torchrun) on a tiny generated corpus: the real
Trainer, data pipeline, eval, schedule and QK-Clip, distributed by k3.parallel.

One 2-process run (4 steps, DCP checkpoints at steps 2 and 4) against
* the plain 1-process `k3 train` of the same global batch: losses and val losses within 1e-4. The
  2-rank run computes the same function (capacity factor E/k: nothing can drop) except for Quantile
  Balancing, which reads the bias from summed histograms instead of the exact quantile (within one bin,
  2/512); measured on this corpus the losses differ by <= 1.4e-5 over 4 steps and 8e-5 by step 6,
  while a 1-process run of the distributed runtime matches the 2-rank one within 5e-7;
* a resume of its step-2 checkpoint on ONE process (world of one): steps 3-4 within 1e-4 (same maths);
* rank 0's run directory: metrics once per step, summary, DCP checkpoints, and a consolidated official
  checkpoint equal to `k3 export` of the last DCP checkpoint.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300  # seconds for the 2-process run; generous for a loaded 2-core machine
TAU = 0.065  # k3-nano's max logits are ~0.06-0.08 at the start: QK-Clip edits the sharded weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(corpus: Path) -> list[str]:
    return [
        "--preset", "k3-nano", "--data", str(corpus), "--steps", "4", "--seq-len", "32", "--batch-size", "4",
        "--warmup-steps", "2", "--eval-every", "2", "--eval-tokens", "512", "--save-every", "2",
        "--keep", "3", "--log-every", "1", "--sample-tokens", "4", "--threads", "1",
        "--capacity-factor", "4", "--qk-clip-tau", str(TAU),
    ]  # fmt: skip


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_file):
    from k3.cli import main

    d = tmp_path_factory.mktemp("dist-train")
    cache = d / "k3-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(cache))
        assert main(["train", *_args(corpus_file), "--out", str(d / "one")]) == 0  # caches the tokenizer
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        cmd = [sys.executable, "-m", "k3.cli", "train", "--nproc", "2", "--ep", "2", *_args(corpus_file)]
        proc = subprocess.run(
            [*cmd, "--out", str(d / "ep2")],
            cwd=ROOT,
            env={**env, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        # resume the 2-rank step-2 checkpoint on one process: a world of one, chosen by the DCP format
        world1 = {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        }
        for key, value in world1.items():  # set here so that they are removed again afterwards
            mp.setenv(key, value)
        half = d / "ep2" / "checkpoints" / "step-00000002"
        assert main(["train", "--resume", str(half), "--out", str(d / "resumed")]) == 0
    return d, proc.stdout + proc.stderr


def test_two_ranks_match_one_process(runs):
    d, _ = runs
    ep2, one = _records(d / "ep2", "train"), _records(d / "one", "train")
    assert [r["step"] for r in ep2] == [r["step"] for r in one] == [1, 2, 3, 4]  # rank 0 logs once
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(ep2, one, strict=True)]
    assert max(diffs) < 1e-4, diffs
    assert one[0]["loss"] - one[-1]["loss"] > 0.3  # it trains
    assert [a["tokens"] for a in ep2] == [b["tokens"] for b in one] == [128, 256, 384, 512]
    assert all(r["drop_rate"] == 0.0 for r in ep2)  # capacity factor E/k
    clipped = [r["qk_clipped_heads"] for r in ep2]
    assert clipped == [r["qk_clipped_heads"] for r in one] and sum(clipped) > 0  # QK-Clip on shards
    assert [r["lr_mult"] for r in ep2] == [r["lr_mult"] for r in one]  # the same schedule
    ev2, ev1 = _records(d / "ep2", "eval"), _records(d / "one", "eval")
    assert [r["step"] for r in ev2] == [2, 4] and [r["tokens"] for r in ev2] == [r["tokens"] for r in ev1]
    assert max(abs(a["val_loss"] - b["val_loss"]) for a, b in zip(ev2, ev1, strict=True)) < 1e-4


def test_rank0_writes_the_run_directory(runs):
    from k3.checkpoint import load_checkpoint
    from k3.parallel.dcp import is_dcp_checkpoint, load_model_no_dist

    d, output = runs
    run = d / "ep2"
    assert output.count("| k3 train") == 1 and "dp=1 x ep=2" in output  # one report, from rank 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens"] == 512 and not summary["interrupted"]
    ckpts = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-00000002", "step-00000004"]
    assert all(is_dcp_checkpoint(c) for c in ckpts)
    layout = json.loads((ckpts[-1] / "train_state.json").read_text())["layout"]
    assert layout == {"world_size": 2, "dp": 1, "ep": 2}
    final, config = load_checkpoint(run)  # the consolidated official checkpoint in the run directory
    sharded, _, step = load_model_no_dist(ckpts[-1])
    a, b = final.state_dict(), sharded.state_dict()
    assert step == 4 and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.1.block_sparse_moe.experts.w1"].shape == (config.num_experts, 32, 32)
    assert (run / "tokenizer.json").exists() and (run / "loss.png").exists()


def test_resume_on_one_process(runs):
    d, _ = runs
    ep2 = {r["step"]: r["loss"] for r in _records(d / "ep2", "train")}
    resumed = _records(d / "resumed", "train")
    assert [r["step"] for r in resumed] == [3, 4]
    assert max(abs(r["loss"] - ep2[r["step"]]) for r in resumed) < 1e-4, (ep2, resumed)
    assert "drop_rate" in resumed[0]  # the distributed runtime (world of one), capacity factor kept


def test_export_equals_the_consolidated_run(runs, tmp_path):
    from k3.checkpoint import load_checkpoint
    from k3.cli import main

    d, _ = runs
    assert (
        main(["export", str(d / "ep2" / "checkpoints" / "step-00000004"), "--out", str(tmp_path / "x")]) == 0
    )
    a, b = load_checkpoint(tmp_path / "x")[0].state_dict(), load_checkpoint(d / "ep2")[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_worker_command_line_round_trips():
    import argparse

    from k3.parallel.launch import torchrun_argv
    from k3.train.cli import _argv_of, add_arguments

    p = argparse.ArgumentParser(prog="k3 train")
    add_arguments(p)
    flags = ["--nproc", "2", "--ep", "2", "--lr", "0.01", "--bf16", "--no-qk-clip", "--prompt", "def f(x): "]
    args = p.parse_args([*flags, "--capacity-factor", "4"])
    argv = _argv_of(args)
    assert "--nproc" not in argv
    back = p.parse_args(argv)
    assert {k: v for k, v in vars(back).items() if k != "nproc"} == {
        k: v for k, v in vars(args).items() if k != "nproc"
    }
    from k3.cli import main

    assert main(["train", "--nproc", "0"]) == 2  # a user error, before anything starts
    cmd = torchrun_argv(2, ["--nproc", "2", "--steps", "3"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in cmd
    assert cmd[-4:] == ["-m", "k3.train", "--steps", "3"]
