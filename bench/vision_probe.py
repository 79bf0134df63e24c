"""Short k3-tiny-vl runs on a few question kinds, for diagnosing what the image pathway learns.

Runs `k3.vision.train_vl.train` (AdamW, warmup-cosine, 1 thread) on the synthetic task restricted to
KINDS and, through its step hook, prints every 25 steps the loss, the cross-entropy of the first answer
token (`ce1`; chance for colour is ln 6 = 1.79, for digits ln 10 = 2.30) and the gradient norms of the
vision side (tower + projector, `gv`) and of the LM (`gl`), before clipping; then greedy accuracy on 64
held-out questions of those kinds. Not a k3 bench entry: a lab tool whose results docs/vision.md quotes
with the command.

    python bench/vision_probe.py --kinds colour --steps 400 --projector-norm-init 0.1
    python bench/vision_probe.py --kinds colour --steps 300 --max-shapes 1   # the pathway sanity check
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from k3.model.transformer import IGNORE_INDEX
from k3.vision import synthetic
from k3.vision import train_vl as T


def grad_norm(params) -> float:
    norms = [p.grad.norm() for p in params if p.grad is not None]
    return float(torch.norm(torch.stack(norms))) if norms else 0.0


class StepLog:
    """The step hook: first-answer-token CE and vision / LM gradient norms every `every` steps."""

    def __init__(self, every: int = 25, steps: int = 0):
        self.every, self.steps, self.log, self.t0 = every, steps, [], time.time()

    def __call__(self, step: int, model, batch: dict, out) -> None:
        if step % self.every and step != self.steps - 1:
            return
        labels = batch["labels"]
        rows = torch.arange(labels.shape[0])
        first = (labels != IGNORE_INDEX).int().argmax(1)  # the first supervised position of each row
        ce1 = F.cross_entropy(out.logits[rows, first].detach(), labels[rows, first])
        named = list(model.named_parameters())
        gv = grad_norm(p for n, p in named if not n.startswith("language_model"))
        gl = grad_norm(p for n, p in named if n.startswith("language_model"))
        rec = {"step": step, "loss": round(out.loss.item(), 3), "ce1": round(ce1.item(), 3),
               "gv": round(gv, 4), "gl": round(gl, 4), "s": round(time.time() - self.t0, 1)}  # fmt: skip
        print(json.dumps(rec), flush=True)
        self.log.append(rec)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="colour", help=f"comma-separated subset of {','.join(synthetic.KINDS)}")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--projector-norm-init", type=float, default=1.0)
    p.add_argument("--max-shapes", type=int, default=3, help="most shapes per colour scene (1: one colour)")
    p.add_argument("--lm-layers", type=int, help="text layers (3:1 KDA:MLA; default: the preset's)")
    p.add_argument("--tower-width", type=int, help="vision tower width (default: the preset's)")
    p.add_argument("--eval-n", type=int, default=64, help="held-out questions scored at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the log and the accuracy here")
    a = p.parse_args(argv)
    flags = {"--kinds": a.kinds, "--max-shapes": a.max_shapes, "--steps": a.steps, "--batch": a.batch,
             "--lr": a.lr, "--projector-norm-init": a.projector_norm_init, "--seed": a.seed, "--threads": 1,
             **({"--lm-layers": a.lm_layers} if a.lm_layers else {}),
             **({"--tower-width": a.tower_width} if a.tower_width else {}),
             "--warmup": 30, "--eval-n": a.eval_n, "--eval-every": 0, "--log-every": 10**9,
             "--caption-frac": 0}  # fmt: skip
    args = T.parse_args([x for flag, value in flags.items() for x in (flag, str(value))])
    hook = StepLog(25, a.steps)
    res = T.train(args, on_step=hook)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "log": hook.log, "heldout": res}, f, indent=2)


if __name__ == "__main__":
    main()
