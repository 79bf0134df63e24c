"""Placeholder expansion and replacement: counts, several images per sequence, mismatches, the VL model."""

import pytest
import torch
from PIL import Image

from k3.chat_format import ChatOptions, render
from k3.model.multimodal import K3VLForCausalLM, init_vl_weights, scatter_image_embeddings, tokens_per_image
from k3.tokenizer_train import train_tokenizer
from k3.vision.config import IMAGE_PLACEHOLDER, vl_preset
from k3.vision.media import (
    MediaIds,
    check_media_counts,
    encode_segments_with_images,
    expand_image_placeholders,
    image_token_ids,
    pad_runs,
)
from k3.vision.preprocess import batch_images, preprocess_image


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["image 100x50 hello world what colour is the square?"] * 20, vocab_size=1024)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3VLForCausalLM(vl_preset("k3-tiny-vl"))
    init_vl_weights(m, seed=0)
    return m.eval()


def test_image_token_layout(tok):
    ids = MediaIds.of(tok)
    assert ids.pad == tok.base + 21 and ids.begin == tok.base + 18
    out = image_token_ids(tok, (100, 50), 6)
    assert out[0] == ids.begin and out[-1] == ids.end and out[-8] == ids.content
    assert out[-7:-1] == [ids.pad] * 6
    assert tok.decode(out[1:-8]) == "image 100x50"


def test_expand_several_placeholders(tok):
    text = f"a{IMAGE_PLACEHOLDER}b {IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}c"
    ids = expand_image_placeholders(tok, text, [((10, 10), 1), ((56, 28), 2), ((300, 30), 5)])
    assert pad_runs(ids, MediaIds.of(tok).pad) == [1, 2, 5]
    assert tok.decode(ids) == "aimage 10x10b image 56x28image 300x30c"  # specials dropped
    with pytest.raises(ValueError, match="3 image placeholder"):
        expand_image_placeholders(tok, text, [((10, 10), 1)])


def test_user_text_cannot_forge_media_tokens(tok):
    ids = expand_image_placeholders(tok, "<|media_pad|><|media_begin|>", [])
    assert MediaIds.of(tok).pad not in ids and MediaIds.of(tok).begin not in ids


def test_chat_segments_with_images(tok):
    msgs = [{"role": "user", "content": f"{IMAGE_PLACEHOLDER}\nhello {IMAGE_PLACEHOLDER}"}]
    segs = render(msgs, options=ChatOptions(thinking=False))
    ids = encode_segments_with_images(tok, segs, [((28, 28), 1), ((56, 56), 4)])
    assert pad_runs(ids, MediaIds.of(tok).pad) == [1, 4]
    assert ids[0] == tok.token_to_id("<|open|>")
    with pytest.raises(ValueError, match="2 image placeholder"):
        encode_segments_with_images(tok, segs, [((28, 28), 1)])


def test_check_counts():
    check_media_counts([[1, 9, 9, 2, 9], [9, 9, 9]], 9, [2, 1, 3])
    with pytest.raises(ValueError, match="runs"):
        check_media_counts([[1, 9, 9, 2, 9]], 9, [3])  # same total, wrong split
    with pytest.raises(ValueError, match="total"):
        check_media_counts([[9, 9]], 9, [3])


def test_scatter_replaces_exactly_the_pads_in_order():
    ids = torch.tensor([[1, 7, 7, 2, 7], [7, 3, 3, 3, 3]])
    e = torch.zeros(2, 5, 4)
    img = torch.arange(16.0).view(4, 4) + 1
    out = scatter_image_embeddings(e, ids, img, 7, [2, 1, 1])
    assert torch.equal(out[0, 1], img[0]) and torch.equal(out[0, 2], img[1])
    assert torch.equal(out[0, 4], img[2]) and torch.equal(out[1, 0], img[3])
    assert out[ids != 7].abs().sum() == 0
    with pytest.raises(ValueError, match="4 <\\|media_pad\\|>"):
        scatter_image_embeddings(e, ids, img[:3], 7)
    with pytest.raises(ValueError, match="runs"):
        scatter_image_embeddings(e, ids, img, 7, [1, 2, 1])


def _inputs(model, tok, sizes):
    media = model.config.media
    images = [preprocess_image(Image.new("RGB", s, (200, 30, 30)), media) for s in sizes]
    text = " ".join(f"{IMAGE_PLACEHOLDER} hello" for _ in sizes)
    ids = expand_image_placeholders(tok, text, [(im.orig_size, im.num_tokens) for im in images])
    return torch.tensor([ids]), images


def test_vl_forward_two_images_in_one_sequence_and_a_batch(model, tok):
    ids, images = _inputs(model, tok, [(70, 30), (30, 90)])
    pixels, grid = batch_images(images)
    assert tokens_per_image(grid) == [im.num_tokens for im in images]
    out = model(ids, pixel_values=pixels, grid_thw=grid, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], model.config.text.vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    # the same two rows as a batch of two sequences give the same logits as alone
    ids1, im1 = _inputs(model, tok, [(70, 30)])
    ids2, im2 = _inputs(model, tok, [(60, 60)])
    T = max(ids1.shape[1], ids2.shape[1])
    batch = torch.full((2, T), tok.pad_id)
    batch[0, : ids1.shape[1]], batch[1, : ids2.shape[1]] = ids1[0], ids2[0]
    px, gr = batch_images(im1 + im2)
    with torch.no_grad():
        both = model(batch, pixel_values=px, grid_thw=gr).logits
        alone = model(ids2, pixel_values=im2[0].pixel_values, grid_thw=[im2[0].grid_thw]).logits
    torch.testing.assert_close(both[1, : ids2.shape[1]], alone[0], atol=1e-4, rtol=1e-4)


def test_vl_mismatch_errors(model, tok):
    ids, images = _inputs(model, tok, [(70, 30), (30, 90)])
    pixels, grid = batch_images(images)
    with pytest.raises(ValueError, match="media_pad"):
        model(ids)  # pads but no image
    with pytest.raises(ValueError, match="image embeddings"):
        model(ids, pixel_values=images[0].pixel_values, grid_thw=[images[0].grid_thw])
    with pytest.raises(ValueError, match="runs"):
        swapped = batch_images(images[::-1])
        if tokens_per_image(swapped[1]) == tokens_per_image(grid):
            pytest.skip("same counts")
        model(ids, pixel_values=swapped[0], grid_thw=swapped[1])


def test_state_dict_names_are_official(model):
    names = set(model.state_dict())
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in names
    assert "mm_projector.proj.2.weight" in names and "mm_projector.post_norm.weight" in names
    assert "language_model.model.embed_tokens.weight" in names and "language_model.lm_head.weight" in names


def test_projector_norm_init_sets_image_token_scale():
    """The post_norm start value is the RMS of every projected image token (RMSNorm output x weight)."""
    cfg = vl_preset("k3-tiny-vl")
    m = K3VLForCausalLM(cfg)
    init_vl_weights(m, seed=0, projector_norm_init=0.1)
    assert torch.equal(m.mm_projector.post_norm.weight, torch.full_like(m.mm_projector.post_norm.weight, 0.1))
    img = preprocess_image(Image.new("RGB", (90, 60), (200, 30, 30)), cfg.media)
    with torch.no_grad():
        emb = m.image_embeddings(*batch_images([img]))
    rms = emb.pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.full_like(rms, 0.1), rtol=1e-2)  # eps 1e-5 in the norm
    with pytest.raises(ValueError, match="projector_norm_init"):
        init_vl_weights(m, projector_norm_init=0.0)
