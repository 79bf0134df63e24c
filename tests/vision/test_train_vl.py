"""The VL training loop: the --kinds / --max-shapes / size flags, the step hook, a short run end to end."""

import numpy as np
import pytest

from k3.train import vl as T


def test_parse_args_names_bad_kinds(capsys):
    with pytest.raises(SystemExit):
        T.parse_args(["--kinds", "colour,smell"])
    assert "--kinds" in capsys.readouterr().err
    assert T.parse_args(["--kinds", "digit, count"]).kinds == ("digit", "count")


def test_a_repeated_kind_trains_more_but_evaluates_once():
    args = T.parse_args(["--kinds", "digit,count,digit", "--eval-n", "6"])
    sampler = T.Sampler(0, None, 0.0, kinds=args.kinds)
    assert [sampler.next().kind for _ in range(6)] == ["digit", "count", "digit"] * 2
    assert [ex.kind for ex in T.heldout_examples(args)] == ["digit", "count"] * 3


def test_size_flags_keep_the_k3_layer_pattern_and_tower_shapes():
    config = T.build_config(T.parse_args(["--lm-layers", "8", "--tower-width", "96"]))
    la = config.text.linear_attn_config
    assert config.text.num_hidden_layers == 8 and la.full_attn_layers == (4, 8)
    assert la.kda_layers == (1, 2, 3, 5, 6, 7)
    v = config.vision
    assert (v.vt_hidden_size, v.vt_intermediate_size, v.qkv_hidden_size, v.mm_hidden_size) == (
        96,
        288,
        96,
        96,
    )
    assert v.vt_num_attention_heads == 2 and v.text_hidden_size == config.text.hidden_size
    assert T.build_config(T.parse_args([])) == T.vl_preset("k3-tiny-vl")  # no flags: the preset as it is


@pytest.mark.parametrize(
    "argv, needle",
    [(["--lm-layers", "0"], "--lm-layers"), (["--tower-width", "-8"], "--tower-width"),
     (["--lm-layers", "8", "--init", "runs/x"], "--init")],
)  # fmt: skip
def test_size_flags_are_checked(argv, needle, capsys):
    with pytest.raises(SystemExit):
        T.parse_args(argv)
    assert needle in capsys.readouterr().err


def test_short_run_calls_the_step_hook_with_gradients(tmp_path):
    seen = []

    def hook(step, model, batch, out):
        vision = [p.grad for n, p in model.named_parameters() if n.startswith("vision_tower")]
        assert all(g is not None for g in vision) and batch["labels"].shape[0] == 2
        seen.append((step, out.loss.item()))

    flags = "--steps 3 --batch 2 --eval-n 4 --eval-every 0 --threads 1 --kinds colour,count --lm-layers 5"
    args = T.parse_args([*flags.split(), "--out", str(tmp_path / "ck")])
    result = T.train(args, on_step=hook)
    assert [s for s, _ in seen] == [0, 1, 2] and all(np.isfinite(loss) for _, loss in seen)
    assert 0.0 <= result["accuracy"] <= 1.0 and set(result["per_kind"]) <= {"colour", "count"}
    assert result["lm_layers"] == 5 and result["tower_width"] == 64
    assert result["kinds"] == ["colour", "count"] and (tmp_path / "ck" / "heldout_eval.json").exists()


def test_save_every_keeps_the_last_save_when_a_run_dies(tmp_path):
    import json

    from k3.checkpoint.vl import load_vl_checkpoint

    def die_at_step_2(step, model, batch, out):
        if step == 2:
            raise RuntimeError("stopped")

    flags = "--steps 4 --batch 2 --eval-n 4 --eval-every 0 --threads 1 --kinds colour --lm-layers 4"
    args = T.parse_args([*flags.split(), "--save-every", "2", "--out", str(tmp_path / "ck")])
    with pytest.raises(RuntimeError, match="stopped"):
        T.train(args, on_step=die_at_step_2)
    record = json.loads((tmp_path / "ck" / "heldout_eval.json").read_text())
    assert record == {"step": 2, "of": 4, "partial": True}
    assert load_vl_checkpoint(tmp_path / "ck").config.text.num_hidden_layers == 4
    with pytest.raises(SystemExit):
        T.parse_args(["--save-every", "-1"])
