"""The VL training loop: the --kinds / --max-shapes flags, the step hook, a short run end to end."""

import numpy as np
import pytest

from k3.vision import train_vl as T


def test_parse_args_names_bad_kinds(capsys):
    with pytest.raises(SystemExit):
        T.parse_args(["--kinds", "colour,smell"])
    assert "--kinds" in capsys.readouterr().err
    assert T.parse_args(["--kinds", "digit, count"]).kinds == ("digit", "count")


def test_short_run_calls_the_step_hook_with_gradients(tmp_path):
    seen = []

    def hook(step, model, batch, out):
        vision = [p.grad for n, p in model.named_parameters() if n.startswith("vision_tower")]
        assert all(g is not None for g in vision) and batch["labels"].shape[0] == 2
        seen.append((step, out.loss.item()))

    args = T.parse_args(["--steps", "3", "--batch", "2", "--eval-n", "4", "--eval-every", "0", "--threads",
                         "1", "--kinds", "colour,count", "--out", str(tmp_path / "ck")])  # fmt: skip
    result = T.train(args, on_step=hook)
    assert [s for s, _ in seen] == [0, 1, 2] and all(np.isfinite(loss) for _, loss in seen)
    assert 0.0 <= result["accuracy"] <= 1.0 and set(result["per_kind"]) <= {"colour", "count"}
    assert result["kinds"] == ["colour", "count"] and (tmp_path / "ck" / "heldout_eval.json").exists()
