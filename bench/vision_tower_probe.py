"""Can the k3-tiny-vl vision tower learn form (which shape, which digit) at all? A direct classifier probe.

Trains the tower + projector of a fresh k3-tiny-vl with a linear head on the pooled image tokens (no LM)
to name the shape of one-shape colour scenes (3 classes) or the digit of digit scenes (10 classes) from
`k3.vision.synthetic`, and prints the loss every 50 steps and the accuracy on 200 held-out images.
`--cnn` swaps the tower for a small 3-layer CNN on the same pixels (the baseline that shows the data is
learnable); `--pool` picks mean or max over an image's tokens; `--scale` resizes every image (0.55 maps
the 128..320-px scenes to the ~70..176 px of the task's first version). A lab tool, not a `k3 bench`
entry; docs/vision.md ("Image sizes") quotes its results with the commands.

    python bench/vision_tower_probe.py --task shape --pool max              # tower, current sizes
    python bench/vision_tower_probe.py --task shape --pool max --scale 0.55 # tower, small images
    python bench/vision_tower_probe.py --task shape --cnn --scale 0.55      # CNN baseline
"""

from __future__ import annotations

import argparse
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


def labelled(task: str, split: str, i: int, scale: float) -> tuple[Image.Image, int]:
    """(image, class) of the i-th example: the shape of a one-shape colour scene, or the digit."""
    if task == "shape":
        ex = synthetic.example(split, 0, i, ("colour",), max_shapes=1)
        label = next(j for j, s in enumerate(synthetic.SHAPES) if f" {s}?" in ex.question)
    else:
        ex = synthetic.example(split, 0, i, ("digit",))
        label = int(ex.answer)
    img = ex.image
    if scale != 1.0:
        size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
        img = img.resize(size, Image.Resampling.BICUBIC)
    return img, label


class TowerClassifier(nn.Module):
    """tower -> projector -> pool over each image's tokens -> linear head."""

    def __init__(self, classes: int, pool: str, seed: int):
        super().__init__()
        self.config = vl_preset("k3-tiny-vl")
        vl = K3VLForCausalLM(self.config)
        init_vl_weights(vl, seed=seed, projector_norm_init=0.1)
        self.tower, self.projector, self.pool = vl.vision_tower, vl.mm_projector, pool
        self.head = nn.Linear(self.config.text.hidden_size, classes)

    def forward(self, images: list[Image.Image]) -> torch.Tensor:
        inputs = [preprocess_image(im, self.config.media) for im in images]
        pixels, grid = batch_images(inputs)
        tokens = self.projector(self.tower(pixels, grid)).split([im.num_tokens for im in inputs])
        pooled = torch.stack([t.amax(0) if self.pool == "max" else t.mean(0) for t in tokens])
        return self.head(pooled)


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

    def forward(self, images: list[Image.Image]) -> torch.Tensor:
        out = []
        for im in images:
            x = preprocess_image(im, self.media)
            out.append(self.net(unpatchify(x.pixel_values, *x.grid_thw[1:])[None]))
        return torch.cat(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("shape", "digit"), default="shape")
    p.add_argument("--pool", choices=("mean", "max"), default="max")
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
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    classes = len(synthetic.SHAPES) if a.task == "shape" else 10
    model = CNNClassifier(classes) if a.cnn else TowerClassifier(classes, a.pool, a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    log, t0 = [], time.time()
    for step in range(a.steps):
        data = [labelled(a.task, "train", step * a.batch + j, a.scale) for j in range(a.batch)]
        loss = F.cross_entropy(model([d[0] for d in data]), torch.tensor([d[1] for d in data]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == a.steps - 1:
            log.append({"step": step, "loss": round(loss.item(), 3), "s": round(time.time() - t0, 1)})
            print(json.dumps(log[-1]), flush=True)
    with torch.no_grad():
        held = [labelled(a.task, "heldout", j, a.scale) for j in range(200)]
        pred = model([d[0] for d in held]).argmax(1)
    acc = (pred == torch.tensor([d[1] for d in held])).float().mean().item()
    print(json.dumps({"heldout_accuracy": acc, "n": len(held), **vars(a)}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "log": log, "heldout_accuracy": acc}, f, indent=2)


if __name__ == "__main__":
    main()
