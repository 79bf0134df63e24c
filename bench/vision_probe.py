"""Short k3-tiny-vl runs on one question kind, for diagnosing what the image pathway learns.

Trains a fresh k3-tiny-vl (AdamW, warmup-cosine, 1 thread) on the synthetic task restricted to KINDS and
prints, every 25 steps, the loss, the cross-entropy of the first answer token (`ce1`; chance for colour
is ln 6 = 1.79) and the gradient norms of the vision side (tower + projector, `gv`) and of the LM (`gl`);
then greedy accuracy on 64 held-out questions of those kinds. Not a k3 bench entry: a lab tool whose
results docs/vision.md quotes with the command.

    python bench/vision_probe.py --kinds colour --steps 400 --projector-norm-init 0.1
    python bench/vision_probe.py --kinds colour --steps 300 --one-shape      # the pathway sanity check
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from k3.model.moe import update_router_biases
from k3.model.multimodal import K3VLForCausalLM, init_vl_weights
from k3.model.transformer import IGNORE_INDEX
from k3.optim.schedule import warmup_cosine
from k3.tokenizer import train_tokenizer
from k3.vision import synthetic
from k3.vision import train_vl as T
from k3.vision.config import vl_preset


def one_shape_colour(rng) -> synthetic.Example:
    """A colour scene with exactly one shape: the answer is the image's only non-background colour."""
    img = synthetic._canvas(rng)
    shape, colour = rng.choice(synthetic.SHAPES), rng.choice(sorted(synthetic.COLOURS))
    (box,) = synthetic._place(rng, img.width, img.height, 1, 0.25, 0.4)
    synthetic.draw_item(synthetic.ImageDraw.Draw(img), synthetic.Item(shape, colour, *box))
    return synthetic.Example(img, "", f"what colour is the {shape}?", colour, "colour")


def grad_norm(params) -> float:
    return float(torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="colour", help=f"comma-separated subset of {','.join(synthetic.KINDS)}")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--projector-norm-init", type=float, default=1.0)
    p.add_argument("--one-shape", action="store_true", help="colour scenes with a single shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the log and the accuracy here")
    a = p.parse_args(argv)
    kinds = tuple(a.kinds.split(","))
    if a.one_shape:
        synthetic._SCENES["colour"] = one_shape_colour
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    config = vl_preset("k3-tiny-vl")
    tok = train_tokenizer(T.task_texts(), vocab_size=config.text.vocab_size)
    model = K3VLForCausalLM(config)
    init_vl_weights(model, seed=a.seed, projector_norm_init=a.projector_norm_init)
    vision = [q for n, q in model.named_parameters() if not n.startswith("language_model")]
    lm = [q for n, q in model.named_parameters() if n.startswith("language_model")]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    log, i, t0 = [], 0, time.time()
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = a.lr * warmup_cosine(step, a.steps, min(30, a.steps), min_ratio=0.05)
        batch = []
        for _ in range(a.batch):
            ex = synthetic.example("train", a.seed, i, kinds)
            batch.append(T.encode_example(tok, config, ex.question, ex.answer, ex.image))
            i += 1
        b = T.collate(batch, tok.pad_id)
        out = model(**b)
        rows = torch.arange(a.batch)
        first = (b["labels"] != IGNORE_INDEX).int().argmax(1)  # the first supervised position of each row
        ce1 = F.cross_entropy(out.logits[rows, first], b["labels"][rows, first])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        gv, gl = grad_norm(vision), grad_norm(lm)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_router_biases(model)
        if step % 25 == 0 or step == a.steps - 1:
            rec = {"step": step, "loss": round(out.loss.item(), 3), "ce1": round(ce1.item(), 3),
                   "gv": round(gv, 4), "gl": round(gl, 4), "s": round(time.time() - t0, 1)}  # fmt: skip
            print(json.dumps(rec), flush=True)
            log.append(rec)
    held = [synthetic.example("heldout", a.seed, j, kinds) for j in range(64)]
    res = T.evaluate(model, tok, config, held)
    print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "log": log, "heldout": res}, f, indent=2)


if __name__ == "__main__":
    main()
