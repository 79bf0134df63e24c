"""`k3 train --task vision` dispatches to the VL loop with the k3 train flags mapped."""

import pytest

from k3.cli import main


def test_task_vision_maps_flags(monkeypatch):
    import k3.train.vl as tvl

    seen = {}

    def fake_train(args):
        seen.update(vars(args))
        return {"accuracy": 1.0}

    monkeypatch.setattr(tvl, "train", fake_train)
    argv = ["train", "--task", "vision", "--steps", "7", "--batch-size", "3", "--lr", "0.01", "--out", "x"]
    assert main([*argv, "--save-every", "2"]) == 0
    assert seen["preset"] == "k3-tiny-vl" and seen["steps"] == 7 and seen["batch"] == 3
    assert seen["lr"] == 0.01 and seen["out"] == "x" and seen["save_every"] == 2
    assert main(argv) == 0 and seen["save_every"] == 0  # not given: only the final save


def test_task_vision_refuses_text_only_flags(monkeypatch, capsys):
    import k3.train.vl as tvl

    monkeypatch.setattr(tvl, "train", lambda args: pytest.fail("must not train"))
    assert main(["train", "--task", "vision", "--seq-len", "64"]) == 2
    assert "--seq-len" in capsys.readouterr().err
