"""Native-resolution image pre-processing for MoonViT (docs/spec_vision.md#preprocessing): budgeted resize,
pad, normalise, patchify.

No fixed resize: an image keeps its own aspect ratio and resolution unless it exceeds the patch budget.

1. scale s = min(1, sqrt(in_patch_limit / patches(W, H)), side_limit*p / W, side_limit*p / H) -- never
   upscaling; the resized size is floor(W*s) x floor(H*s) (at least 1 px);
2. pad right/bottom to a multiple of unit = patch_size * merge (28) -- shrinking a little more while
   the padded grid would still break a limit, so the *padded* grid obeys both limits;
3. RGBA/LA/P-with-transparency images are composited onto an 8-px chessboard (255/180) after the resize;
4. normalise (x/255 - mean)/std; padding is 0 in the normalised space [U: no source states the pad value];
5. cut into patches [N, 3, p, p] in row-major order of the (grid_h, grid_w) grid, grid_thw = (1, h, w).

The LLM sees (h/2)*(w/2) tokens per image (`num_image_tokens`). The server and the data pipeline call the
same functions, so their token counts agree with the model's by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from k3.vision.config import MediaProcConfig

CHESS_CELL = 8
CHESS_LIGHT, CHESS_DARK = 255, 180


@dataclass(frozen=True)
class ImageInput:
    """One pre-processed image: patches [N, 3, p, p] (N = h*w), grid_thw (1, h, w), the upload size."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    orig_size: tuple[int, int]  # (W, H) of the upload, shown to the model as "image WxH"

    @property
    def num_tokens(self) -> int:
        _, h, w = self.grid_thw
        return (h // 2) * (w // 2)


def target_size(width: int, height: int, media: MediaProcConfig) -> tuple[int, int, int, int]:
    """(resized W, resized H, grid_h, grid_w) for an upload of width x height
    (docs/spec_vision.md#preprocessing).

    grid_h * grid_w <= in_patch_limit and both <= patch_limit_on_one_side, grid sides even; no upscaling.
    """
    if not (isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
        raise ValueError(f"image size must be positive integers, got width={width!r}, height={height!r}")
    p, m = media.patch_size, media.merge_kernel_size
    unit, limit = p * m, media.in_patch_limit
    side = media.patch_limit_on_one_side // m * m  # an even side limit, in patches
    scale = min(1.0, math.sqrt(limit / ((width / p) * (height / p))), side * p / width, side * p / height)
    while True:
        w = max(1, math.floor(width * scale))
        h = max(1, math.floor(height * scale))
        gw, gh = math.ceil(w / unit) * m, math.ceil(h / unit) * m
        if gw * gh <= limit and gw <= side and gh <= side:
            return w, h, gh, gw
        scale *= 0.98  # padding pushed the grid over a limit: shrink a little more


def num_image_tokens(width: int, height: int, media: MediaProcConfig) -> int:
    """LLM tokens (= <|media_pad|> count) for an upload of width x height."""
    _, _, gh, gw = target_size(width, height, media)
    return (gh // media.merge_kernel_size) * (gw // media.merge_kernel_size)


def chessboard_composite(img: Image.Image) -> Image.Image:
    """RGB image: an image with alpha composited onto the 8-px 255/180 chessboard; others converted."""
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode not in ("RGBA", "LA", "PA"):
        return img.convert("RGB")
    img = img.convert("RGBA")
    yy, xx = np.mgrid[0 : img.height, 0 : img.width]
    cells = ((yy // CHESS_CELL + xx // CHESS_CELL) % 2).astype(np.uint8)
    board = np.where(cells == 0, CHESS_LIGHT, CHESS_DARK).astype(np.uint8)
    bg = Image.fromarray(np.stack([board] * 3, -1), "RGB").convert("RGBA")
    return Image.alpha_composite(bg, img).convert("RGB")


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """pixels [3, H, W] (H, W multiples of patch_size) -> patches [(H/p)*(W/p), 3, p, p], row-major."""
    c, H, W = pixels.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"pixels {H}x{W} must be multiples of patch_size={p}")
    x = pixels.reshape(c, H // p, p, W // p, p).permute(1, 3, 0, 2, 4)
    return x.reshape(-1, c, p, p)


def unpatchify(patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Inverse of `patchify`: [h*w, 3, p, p] -> [3, h*p, w*p]."""
    n, c, p, _ = patches.shape
    x = patches.reshape(grid_h, grid_w, c, p, p).permute(2, 0, 3, 1, 4)
    return x.reshape(c, grid_h * p, grid_w * p)


def preprocess_image(img: Image.Image, media: MediaProcConfig) -> ImageInput:
    """A decoded PIL image -> ImageInput (steps 1-5 of the module doc)."""
    W, H = img.size
    w, h, gh, gw = target_size(W, H, media)
    if (w, h) != (W, H):
        img = img.resize((w, h), Image.Resampling.BICUBIC)
    img = chessboard_composite(img)
    x = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
    mean = torch.tensor(media.image_mean).view(3, 1, 1)
    std = torch.tensor(media.image_std).view(3, 1, 1)
    x = (x - mean) / std
    p = media.patch_size
    canvas = torch.zeros(3, gh * p, gw * p)
    canvas[:, :h, :w] = x
    return ImageInput(patchify(canvas, p), (1, gh, gw), (W, H))


def batch_images(images: list[ImageInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack several images: (pixel_values [sum N, 3, p, p], grid_thw [num_images, 3] int64)."""
    if not images:
        raise ValueError("images must hold at least one image")
    pixels = torch.cat([im.pixel_values for im in images])
    grid = torch.tensor([im.grid_thw for im in images], dtype=torch.long)
    return pixels, grid
