"""Can the k3-tiny-vl vision tower learn form (which shape, which digit) at all? A direct classifier probe.

Trains the tower + projector of a fresh k3-tiny-vl with a linear head on the pooled image tokens (no LM)
to name the shape of one-shape colour scenes (3 classes) or the digit of digit scenes (10 classes) from
`k3.vision.synthetic`, and prints the loss every 50 steps and the accuracy on 200 held-out images.
`--task binding` asks the colour question of 1-3-shape colour scenes instead: the pooling is attention
with a learned query per shape name (6 classes), the smallest model of "read the colour of the named
shape" on top of the tower, so it tells whether the tower's tokens carry what binding needs.
`--cnn` swaps the tower for a small 3-layer CNN on the same pixels (the baseline that shows the data is
learnable); `--pool` picks mean or max over an image's tokens; `--scale` resizes every image (0.55 maps
the 128..320-px scenes to the ~70..176 px of the task's first version). A lab tool, not a `k3 bench`
entry; docs/vision.md ("Image sizes") quotes its results with the commands.

    python bench/vision_tower_probe.py --task shape --pool max              # tower, current sizes
    python bench/vision_tower_probe.py --task shape --pool max --scale 0.55 # tower, small images
    python bench/vision_tower_probe.py --task shape --cnn --scale 0.55      # CNN baseline
    python bench/vision_tower_probe.py --task binding --steps 800           # colour of the named shape
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from k3.model.multimodal import K3VLForCausalLM, init_vl_weights
from k3.vision import synthetic
from k3.vision.config import vl_preset
from k3.vision.preprocess import batch_images, preprocess_image, unpatchify

COLOUR_NAMES = sorted(synthetic.COLOURS)


def _named_shape(ex: synthetic.Example) -> int:
    """Index in synthetic.SHAPES of the shape a colour question names ("what colour is the square?")."""
    return next(j for j, s in enumerate(synthetic.SHAPES) if f" {s}?" in ex.question)


def labelled(task: str, split: str, i: int, scale: float) -> tuple[Image.Image, int, int]:
    """(image, class, query) of the i-th example: the shape of a one-shape colour scene, the digit, or
    (binding) the colour of the shape a 1-3-shape colour scene's question names (query: that shape)."""
    query = 0
    if task == "binding":
        ex = synthetic.example(split, 0, i, ("colour",))
        query = _named_shape(ex)
        label = COLOUR_NAMES.index(ex.answer)
    elif task == "shape":
        ex = synthetic.example(split, 0, i, ("colour",), max_shapes=1)
        label = _named_shape(ex)
    else:
        ex = synthetic.example(split, 0, i, ("digit",))
        label = int(ex.answer)
    img = ex.image
    if scale != 1.0:
        size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
        img = img.resize(size, Image.Resampling.BICUBIC)
    return img, label, query


class TowerClassifier(nn.Module):
    """tower -> projector -> pool over each image's tokens (mean, max, or attention with a learned
    query per shape: "query") -> linear head."""

    def __init__(self, classes: int, pool: str, seed: int, width: int | None = None):
        super().__init__()
        self.config = vl_preset("k3-tiny-vl")
        if width:
            self.config = dataclasses.replace(self.config, vision=self.config.vision.with_width(width))
        vl = K3VLForCausalLM(self.config)  # built whole (a tiny LM) so init_vl_weights initializes the
        init_vl_weights(vl, seed=seed, projector_norm_init=0.1)  # tower exactly as in training; LM dropped
        self.tower, self.projector, self.pool = vl.vision_tower, vl.mm_projector, pool
        d = self.config.text.hidden_size
        self.queries = nn.Parameter(torch.randn(len(synthetic.SHAPES), d) * d**-0.5)
        self.head = nn.Linear(d, classes)

    def forward(self, images: list[Image.Image], queries: list[int]) -> torch.Tensor:
        inputs = [preprocess_image(im, self.config.media) for im in images]
        pixels, grid = batch_images(inputs)
        tokens = self.projector(self.tower(pixels, grid)).split([im.num_tokens for im in inputs])
        return self.head(torch.stack([self._pool(t, q) for t, q in zip(tokens, queries, strict=True)]))

    def _pool(self, t: torch.Tensor, query: int) -> torch.Tensor:
        if self.pool == "query":  # t [N, d]: softmax over the image's tokens of <token, query>
            return torch.softmax(t @ self.queries[query] * t.shape[-1] ** -0.5, 0) @ t
        return t.amax(0) if self.pool == "max" else t.mean(0)


class CNNClassifier(nn.Module):
    """Three strided convolutions + global max pool, on the tower's normalised, padded pixels."""

    def __init__(self, classes: int):
        super().__init__()
        self.media = vl_preset("k3-tiny-vl").media
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 5, 2, 2), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 2, 1), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
            nn.Linear(64, classes),
        )  # fmt: skip

    def forward(self, images: list[Image.Image], queries: list[int]) -> torch.Tensor:
        del queries  # the CNN baseline serves the shape / digit tasks only
        out = []
        for im in images:
            x = preprocess_image(im, self.media)
            out.append(self.net(unpatchify(x.pixel_values, *x.grid_thw[1:])[None]))
        return torch.cat(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("shape", "digit", "binding"), default="shape")
    p.add_argument(
        "--pool", choices=("mean", "max", "query"), default=None, help="default: max (binding: query)"
    )
    p.add_argument("--tower-width", type=int, default=None, help="vision tower width (default: the preset's)")
    p.add_argument("--cnn", action="store_true", help="the CNN baseline instead of the tower")
    p.add_argument("--scale", type=float, default=1.0, help="resize every image by this factor")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the log and the accuracy here")
    a = p.parse_args(argv)
    if not (a.scale > 0 and a.steps > 0 and a.batch > 0):
        p.error("--scale, --steps and --batch must be positive")
    a.pool = a.pool or ("query" if a.task == "binding" else "max")
    if a.task == "binding" and (a.cnn or a.pool != "query"):
        p.error("--task binding needs the tower with --pool query (the shape name picks the tokens)")
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    classes = {"shape": len(synthetic.SHAPES), "digit": 10, "binding": len(COLOUR_NAMES)}[a.task]
    model = CNNClassifier(classes) if a.cnn else TowerClassifier(classes, a.pool, a.seed, a.tower_width)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    log, t0 = [], time.time()
    for step in range(a.steps):
        data = [labelled(a.task, "train", step * a.batch + j, a.scale) for j in range(a.batch)]
        logits = model([d[0] for d in data], [d[2] for d in data])
        loss = F.cross_entropy(logits, torch.tensor([d[1] for d in data]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == a.steps - 1:
            log.append({"step": step, "loss": round(loss.item(), 3), "s": round(time.time() - t0, 1)})
            print(json.dumps(log[-1]), flush=True)
    with torch.no_grad():
        held = [labelled(a.task, "heldout", j, a.scale) for j in range(200)]
        pred = model([d[0] for d in held], [d[2] for d in held]).argmax(1)
    acc = (pred == torch.tensor([d[1] for d in held])).float().mean().item()
    print(json.dumps({"heldout_accuracy": acc, "n": len(held), **vars(a)}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "log": log, "heldout_accuracy": acc}, f, indent=2)


if __name__ == "__main__":
    main()
