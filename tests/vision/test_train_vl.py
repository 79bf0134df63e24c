"""The VL training loop: kinds / max_shapes options, the step hook, a short run end to end."""

import numpy as np
import pytest

from k3.vision import synthetic
from k3.vision import train_vl as T


def _colours_in(img) -> set[str]:
    a = np.asarray(img.convert("RGB")).astype(int)
    return {n for n, c in synthetic.COLOURS.items() if (np.abs(a - np.array(c)).sum(-1) < 30).sum() > 20}


def test_max_shapes_one_gives_single_colour_scenes():
    exs = synthetic.examples("train", 0, 12, kinds=("colour",), max_shapes=1)
    assert all(e.kind == "colour" for e in exs)
    assert all(_colours_in(e.image) == {e.answer} for e in exs)
    many = synthetic.examples("train", 0, 30, kinds=("colour",))
    assert max(len(_colours_in(e.image)) for e in many) > 1  # the default still draws up to three


@pytest.mark.parametrize(
    "kinds, max_shapes, match",
    [
        ((), 3, "kinds"),
        (("colour", "smell"), 3, "kinds"),
        (("colour",), 0, "max_shapes"),
        (("colour",), 4, "max_shapes"),
    ],  # fmt: skip
)
def test_bad_kinds_or_max_shapes(kinds, max_shapes, match):
    with pytest.raises(ValueError, match=match):
        synthetic.example("train", 0, 0, kinds, max_shapes)


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
