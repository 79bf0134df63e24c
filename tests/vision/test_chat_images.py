"""OpenAI image_url content parts in the chat format: placeholders in order, URLs collected, literal
placeholders refused, text-only rendering refuses images; the frontend's spans sit on the pad runs."""

import pytest
import torch
from PIL import Image

from k3.chat_format import IMAGE_SLOT, ChatOptions, render, to_text
from k3.vision.config import IMAGE_PLACEHOLDER

OPTS = ChatOptions(thinking=False)


def _img(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_parts_become_placeholders_in_order():
    urls: list = []
    msgs = [
        {"role": "user", "content": [_img("data:a"), {"type": "text", "text": "compare"}, _img("data:b")]}
    ]
    text = to_text(render(msgs, options=OPTS, images=urls))
    assert urls == ["data:a", "data:b"]
    assert f"{IMAGE_SLOT}compare{IMAGE_SLOT}" in text and text.count(IMAGE_PLACEHOLDER) == 2


def test_string_url_form_and_training_layout_agree():
    urls: list = []
    served = render([{"role": "user", "content": [_img("data:x"), {"type": "text", "text": "how many?"}]}],
                    options=OPTS, images=urls)  # fmt: skip
    trained = render([{"role": "user", "content": f"{IMAGE_PLACEHOLDER}how many?"}], options=OPTS)
    # the server renders exactly what k3.train.vl trains on: the same text, and the same ids, since
    # encoding cuts the text at each placeholder (k3.vision.media.expand_image_placeholders)
    assert to_text(served) == to_text(trained) and to_text(trained).count(IMAGE_PLACEHOLDER) == 1
    assert [m for _, m in served if m] == [m for _, m in trained if m]


@pytest.mark.parametrize(
    "msgs",
    [
        [{"role": "user", "content": [_img("data:a"), {"type": "text", "text": f"x {IMAGE_PLACEHOLDER}"}]}],
        [{"role": "user", "content": f"{IMAGE_PLACEHOLDER}"}],
        [{"role": "system", "content": IMAGE_PLACEHOLDER}, {"role": "user", "content": "hi"}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<|kimi_image_"},
                    {"type": "text", "text": "placeholder|>"},
                ],
            }
        ],  # fmt: skip
    ],
)
def test_literal_placeholder_refused(msgs):
    with pytest.raises(ValueError, match="placeholder"):
        render(msgs, options=OPTS, images=[])


def test_images_refused_without_a_collector_or_outside_user_messages():
    with pytest.raises(ValueError, match="image_url"):
        render([{"role": "user", "content": [_img("data:a")]}], options=OPTS)
    with pytest.raises(ValueError, match="image_url"):
        render([{"role": "system", "content": [_img("data:a")]}, {"role": "user", "content": "q"}],
               options=OPTS, images=[])  # fmt: skip
    with pytest.raises(ValueError, match="content part type"):
        render([{"role": "user", "content": [{"type": "input_audio"}]}], options=OPTS, images=[])


def test_frontend_spans_cover_the_pad_runs():
    from k3.infer.vision import VisionFrontend
    from k3.model.multimodal import K3VLForCausalLM, init_vl_weights
    from k3.tokenizer_train import train_tokenizer
    from k3.vision.config import vl_preset
    from k3.vision.image_io import encode_data_url
    from k3.vision.preprocess import batch_images

    torch.manual_seed(0)
    model = K3VLForCausalLM(vl_preset("k3-tiny-vl"))
    init_vl_weights(model, seed=0)
    model.eval()
    tok = train_tokenizer(["image 60x90 what is it"] * 10, vocab_size=1024)
    fe = VisionFrontend(model)
    urls: list = []
    a, b = Image.new("RGB", (60, 90), (200, 0, 0)), Image.new("RGB", (120, 40), (0, 0, 200))
    msgs = [{"role": "user", "content": [_img(encode_data_url(a)), {"type": "text", "text": "and"},
                                         _img(encode_data_url(b))]}]  # fmt: skip
    segs = render(msgs, options=OPTS, images=urls)
    images = fe.load(urls)
    ids = fe.encode(tok, segs, images)
    spans = fe.spans(ids, images)
    assert [s.key for s in spans] == [p.key for p in images] and spans[0].key != spans[1].key
    x = torch.tensor([ids])
    want = model.embed(x, *batch_images([p.image for p in images]))[0]
    for s in spans:
        assert all(t == model.pad_id for t in ids[s.start : s.stop])
        torch.testing.assert_close(s.embeds, want[s.start : s.stop])
    assert sum(s.stop - s.start for s in spans) == ids.count(model.pad_id)
