"""bench/vision_binding.py: the colours it reads off a scene; its table on a barely trained checkpoint."""

import importlib.util
from pathlib import Path

import pytest

from k3.vision import synthetic
from k3.vision import train_vl as T

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "vision_binding.py"


@pytest.fixture(scope="module")
def binding():
    spec = importlib.util.spec_from_file_location("vision_binding", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scene_colours_are_the_drawn_ones(binding):
    for ex in synthetic.examples("heldout", 0, 12, kinds=("colour",)):
        colours = binding.scene_colours(ex)
        assert ex.answer in colours and 1 <= len(colours) <= 3 and len(set(colours)) == len(colours)
        assert len(colours) == ex.caption.count(" and ") + 1


def test_table_rows_add_up(binding, tmp_path):
    flags = "--steps 2 --batch 2 --eval-n 4 --eval-every 0 --threads 1 --kinds colour"
    T.train(T.parse_args([*flags.split(), "--out", str(tmp_path / "ck")]))
    table = binding.binding_table(str(tmp_path / "ck"), 9)
    assert sum(row["n"] for row in table.values()) == 9 and set(table) <= {1, 2, 3}
    for k, row in table.items():
        assert row["chance_if_unbound"] == 1 / k
        assert 0 <= row["accuracy"] + row["wrong_but_present"] <= 1
        if k == 1:
            assert row["wrong_but_present"] == 0  # a one-shape scene has no other colour
