"""Native-resolution patchify: budget, no upscaling, padding to 28, patch order, token counts."""

import pytest
import torch
from PIL import Image

from k3.vision.config import MediaProcConfig
from k3.vision.preprocess import (
    chessboard_composite,
    num_image_tokens,
    patchify,
    preprocess_image,
    target_size,
    unpatchify,
)

RELEASE = MediaProcConfig()


@pytest.mark.parametrize("size", [(1, 1), (13, 200), (29, 57), (333, 97), (640, 480), (28, 28), (1000, 30)])
def test_small_images_are_not_resized_only_padded(size):
    w, h, gh, gw = target_size(*size, RELEASE)
    assert (w, h) == size  # well under the budget: never rescaled
    assert gh * 14 >= h and gw * 14 >= w and gh % 2 == 0 and gw % 2 == 0
    assert gh * 14 - h < 28 and gw * 14 - w < 28  # padding only up to the next multiple of 28


@pytest.mark.parametrize("size", [(8000, 6000), (20000, 100), (100, 9000), (7169, 7169), (3600, 3600)])
def test_budget_and_side_limit_hold_without_upscaling(size):
    w, h, gh, gw = target_size(*size, RELEASE)
    assert gh * gw <= RELEASE.in_patch_limit
    assert gh <= 512 and gw <= 512
    assert w <= size[0] and h <= size[1]
    assert abs(w / h - size[0] / size[1]) / (size[0] / size[1]) < 0.05 or min(w, h) < 30  # aspect kept


def test_tight_budget_after_padding():
    media = MediaProcConfig(in_patch_limit=16, patch_limit_on_one_side=8)
    for size in [(57, 57), (200, 30), (30, 200), (1000, 1000), (113, 57)]:
        _, _, gh, gw = target_size(*size, media)
        assert gh * gw <= 16 and gh <= 8 and gw <= 8


def test_bad_size_raises():
    with pytest.raises(ValueError, match="width"):
        target_size(0, 10, RELEASE)


@pytest.mark.parametrize("size", [(31, 45), (100, 29), (57, 300), (140, 84)])
def test_preprocess_shapes_and_token_count(size):
    img = Image.new("RGB", size, (255, 0, 0))
    x = preprocess_image(img, RELEASE)
    _, gh, gw = x.grid_thw
    assert x.pixel_values.shape == (gh * gw, 3, 14, 14)
    assert x.orig_size == size
    assert x.num_tokens == (gh // 2) * (gw // 2) == num_image_tokens(*size, RELEASE)
    canvas = unpatchify(x.pixel_values, gh, gw)
    w, h = size
    assert torch.allclose(canvas[:, :h, :w], torch.tensor([1.0, -1.0, -1.0]).view(3, 1, 1))
    assert canvas[:, h:, :].abs().sum() == 0 and canvas[:, :, w:].abs().sum() == 0  # zero padding


def test_patchify_row_major():
    pix = torch.arange(3 * 28 * 42, dtype=torch.float32).view(3, 28, 42)
    p = patchify(pix, 14)
    assert p.shape == (6, 3, 14, 14)
    assert torch.equal(p[1], pix[:, 0:14, 14:28]) and torch.equal(p[3], pix[:, 14:28, 0:14])
    assert torch.equal(unpatchify(p, 2, 3), pix)
    with pytest.raises(ValueError, match="patch_size"):
        patchify(pix[:, :27], 14)


def test_transparency_goes_onto_the_chessboard():
    img = Image.new("RGBA", (16, 16), (0, 0, 0, 0))
    out = chessboard_composite(img)
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((8, 0)) == (180, 180, 180)
