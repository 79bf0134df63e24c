"""Synthetic task (deterministic, correct by construction, disjoint splits); --data folders; VL checkpoint."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from k3.vision import synthetic
from k3.vision.data import load_folder, write_folder
from k3.vision.image_io import image_hash
from k3.vision.synthetic import COLOURS, Item, draw_item, example, examples, render_digit


def test_deterministic_by_seed_and_split():
    a, b = example("train", 3, 17), example("train", 3, 17)
    assert image_hash(a.image) == image_hash(b.image) and (a.question, a.answer) == (b.question, b.answer)
    assert image_hash(example("train", 4, 17).image) != image_hash(a.image)
    train = {image_hash(e.image) for e in examples("train", 0, 60)}
    held = {image_hash(e.image) for e in examples("heldout", 0, 60)}
    assert not train & held
    with pytest.raises(ValueError, match="split"):
        example("test", 0, 0)


def test_kinds_cycle_and_varied_sizes():
    exs = examples("train", 0, 80)
    assert [e.kind for e in exs[:4]] == list(synthetic.KINDS)
    sizes = {e.image.size for e in exs}
    assert len(sizes) > 40
    ratios = [w / h for w, h in sizes]
    assert min(ratios) < 0.6 and max(ratios) > 1.6
    assert all(synthetic.MIN_SIDE <= s <= synthetic.MAX_SIDE for e in exs for s in e.image.size)


def _colour_pixels(img: Image.Image, name: str) -> np.ndarray:
    a = np.asarray(img.convert("RGB")).astype(int)
    return np.abs(a - np.array(COLOURS[name])).sum(-1) < 30


def _blobs(mask: np.ndarray) -> int:
    """Connected components (4-neighbour) of a boolean mask."""
    seen, n = np.zeros_like(mask), 0
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        n += 1
        stack = [(y, x)]
        while stack:
            cy, cx = stack.pop()
            if 0 <= cy < mask.shape[0] and 0 <= cx < mask.shape[1] and mask[cy, cx] and not seen[cy, cx]:
                seen[cy, cx] = True
                stack += [(cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)]
    return n


def _colours_in(img: Image.Image) -> set[str]:
    return {name for name in COLOURS if _colour_pixels(img, name).sum() > 20}


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


def test_answers_correct_by_construction():
    for e in examples("heldout", 1, 48):
        if e.kind == "colour":
            assert e.answer in COLOURS and _colour_pixels(e.image, e.answer).sum() > 20
            assert f"{e.answer} {e.question.split()[-1].rstrip('?')}" in e.caption
        elif e.kind == "count":
            non_bg = np.asarray(e.image).astype(int).std(-1) > 25  # saturated shape pixels
            assert _blobs(non_bg) == int(e.answer)
        elif e.kind == "position":
            mask = np.asarray(e.image).astype(int).std(-1) > 25
            ys, xs = np.nonzero(mask)
            cx, cy = xs.mean() / e.image.width, ys.mean() / e.image.height
            want = {"left": cx < 0.4, "right": cx > 0.6, "top": cy < 0.4, "bottom": cy > 0.6}
            assert want[e.answer], (e.answer, cx, cy)
        else:
            assert e.answer.isdigit() and f"digit {e.answer}" in e.caption


def test_digit_fonts_differ():
    glyphs = [render_digit("4", f, 40, (0, 0, 0)) for f in synthetic.FONTS]
    assert len({image_hash(g) for g in glyphs}) == len(synthetic.FONTS)
    assert all(g.height >= 20 for g in glyphs)


def test_draw_item_rejects_unknown_shape():
    img = Image.new("RGB", (20, 20))
    from PIL import ImageDraw

    with pytest.raises(ValueError, match="shape"):
        draw_item(ImageDraw.Draw(img), Item("hexagon", "red", 10, 10, 8))


def test_data_folder_round_trip_and_split(tmp_path):
    exs = examples("train", 0, 40)
    write_folder(tmp_path, exs)
    train, held = list(load_folder(tmp_path, "train")), list(load_folder(tmp_path, "heldout", 0.25))
    assert len(list(load_folder(tmp_path, "all"))) == 40
    assert 0 < len(held) < 40 and len(train) + len(list(load_folder(tmp_path, "heldout"))) == 40
    first = next(load_folder(tmp_path, "all"))
    assert (first.question, first.answer) == (exs[0].question, exs[0].answer)
    assert image_hash(first.image) == image_hash(exs[0].image)


def test_data_folder_bad_rows(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "bad.bin").write_bytes(b"nope")
    for row, msg in [
        ({"image": "missing.png", "caption": "x"}, "not a file"),
        ({"image": "../a.png", "caption": "x"}, "not a file"),
        ({"image": "a.png"}, "caption"),
        ({"image": "a.png", "question": "q"}, "answer"),
        ({"image": "bad.bin", "caption": "x"}, "cannot decode"),
    ]:
        (tmp_path / "data.jsonl").write_text(json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=msg):
            list(load_folder(tmp_path, "all"))
    caption_only = {"image": "a.png", "caption": "a black square."}
    (tmp_path / "data.jsonl").write_text(json.dumps(caption_only) + "\n")
    (ex,) = load_folder(tmp_path, "all")
    assert ex.kind == "caption" and ex.answer == "a black square."


def test_vl_checkpoint_round_trip(tmp_path):
    from k3.checkpoint.vl import load_vl_checkpoint, save_vl_checkpoint
    from k3.model.multimodal import K3VLForCausalLM, init_vl_weights
    from k3.vision.config import vl_preset

    m = K3VLForCausalLM(vl_preset("k3-tiny-vl"))
    init_vl_weights(m, seed=1)
    save_vl_checkpoint(m, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert "vision_config" in cfg and "text_config" in cfg
    back = load_vl_checkpoint(tmp_path / "ck")
    assert back.config.media == m.config.media
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
