"""Does a VL checkpoint bind colours to shapes? Colour accuracy by the number of shapes in the scene.

Scores held-out colour questions ("what colour is the square?") of `k3.vision.synthetic` by greedy
answers (in process, `k3.vision.train_vl.answer`), split by how many shapes (each its own colour) the
scene holds, next to what a model that names one of the scene's colours at random would score (1/n),
and the share of wrong answers that are a colour of another shape in the scene. A model that sees the
colours but cannot tell which belongs to the named shape scores ~1/n with every error "present". A lab
tool, not a `k3 bench` entry; docs/vision.md ("Colour binding") quotes it with the command.

    python bench/vision_binding.py runs/tiny-vl-2 -n 600
"""

from __future__ import annotations

import argparse
import json

import torch

from k3.tokenizer import K3Tokenizer
from k3.vision import synthetic
from k3.vision.checkpoint import load_vl_checkpoint
from k3.vision.train_vl import answer, encode_example


def scene_colours(ex: synthetic.Example) -> list[str]:
    """The colours of a colour scene, read off its caption ("a red square and a blue circle.")."""
    words = ex.caption.rstrip(".").split()
    return [w for w in words if w in synthetic.COLOURS]


def binding_table(checkpoint: str, n: int, seed: int = 0) -> dict[int, dict]:
    """{number of shapes: {accuracy, chance_if_unbound, wrong_but_present, n}} over n colour questions."""
    model, tok = load_vl_checkpoint(checkpoint).eval(), K3Tokenizer.from_dir(checkpoint)
    counts: dict[int, list[int]] = {}  # shapes -> [right, wrong but present, total]
    for ex in synthetic.examples("heldout", seed, n, kinds=("colour",)):
        present = scene_colours(ex)
        pred = answer(model, tok, encode_example(tok, model.config, ex.question, None, ex.image))
        c = counts.setdefault(len(present), [0, 0, 0])
        c[0] += pred == ex.answer
        c[1] += pred != ex.answer and pred in present
        c[2] += 1
    return {
        k: {"accuracy": r / t, "chance_if_unbound": 1 / k, "wrong_but_present": w / t, "n": t}
        for k, (r, w, t) in sorted(counts.items())
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint directory of k3.vision.train_vl")
    p.add_argument("-n", type=int, default=600, help="held-out colour questions")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the table here")
    a = p.parse_args(argv)
    if a.n <= 0:
        p.error(f"-n must be positive, got {a.n}")
    torch.set_num_threads(a.threads)
    table = binding_table(a.checkpoint, a.n)
    print("| shapes | accuracy | 1/n (a random shape's colour) | wrong, another shape's colour | questions |")
    print("|---|---|---|---|---|")
    for k, row in table.items():
        print(f"| {k} | {row['accuracy']:.3f} | {row['chance_if_unbound']:.3f} | "
              f"{row['wrong_but_present']:.3f} | {row['n']} |")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"checkpoint": a.checkpoint, "n": a.n, "by_shapes": table}, f, indent=2)


if __name__ == "__main__":
    main()
