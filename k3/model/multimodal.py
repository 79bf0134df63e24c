"""K3VLForCausalLM: MoonViT tower + patch-merger projector + the K3 language model (docs/spec.md#forward,
docs/spec_vision.md#placement).

    image_embeds = mm_projector(vision_tower(pixel_values, grid_thw))      [M, D]  M = sum (h/2)(w/2)
    e            = embed_tokens(input_ids)                                 [B, T, D]
    e[input_ids == media_pad] = image_embeds  (row-major over B, T; image i fills the i-th pad run)
    logits       = language_model(inputs_embeds=e)

Several images per sequence and several sequences per batch are packed into one `pixel_values` /
`grid_thw`, images in the order their pad runs appear. Counts are checked: a mismatch between the pads and
the images raises ValueError. Module names are the checkpoint prefixes `vision_tower.`, `mm_projector.`,
`language_model.` (docs/spec.md#tensors), so `state_dict()` keys are the official tensor names.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3.model.init import init_weights
from k3.model.transformer import CausalLMOutput, K3ForCausalLM
from k3.model.vision import MoonViT, PatchMergerProjector, _grids, init_vision_weights
from k3.vision.config import K3VLConfig
from k3.vision.media import check_media_counts


def tokens_per_image(grid_thw) -> list[int]:
    """LLM tokens of each image: (h/2)*(w/2)."""
    return [(h // 2) * (w // 2) for _, h, w in _grids(grid_thw)]


def scatter_image_embeddings(
    inputs_embeds: torch.Tensor,
    input_ids: torch.Tensor,
    image_embeds: torch.Tensor,
    pad_id: int,
    counts: list[int] | None = None,
) -> torch.Tensor:
    """inputs_embeds [B, T, D] with the `pad_id` positions of input_ids [B, T] set to image_embeds [M, D].

    counts (tokens per image) are checked against the pad runs when given; the total always is.
    Differentiable in both inputs_embeds and image_embeds.
    """
    mask = input_ids == pad_id
    n = int(mask.sum())
    if n != image_embeds.shape[0]:
        raise ValueError(
            f"input_ids hold {n} <|media_pad|> (id {pad_id}) positions but {image_embeds.shape[0]} image "
            "embeddings were given"
        )
    if counts is not None:
        check_media_counts(input_ids.tolist(), pad_id, counts)
    if n == 0:
        return inputs_embeds
    return inputs_embeds.masked_scatter(mask[..., None], image_embeds.to(inputs_embeds.dtype))


class K3VLForCausalLM(nn.Module):
    """vision_tower + mm_projector + language_model (K3ForCausalLM)."""

    def __init__(self, config: K3VLConfig):
        super().__init__()
        self.config = config
        self.pad_id = config.media_pad_id
        self.vision_tower = MoonViT(config.vision)
        self.mm_projector = PatchMergerProjector(config.vision)
        self.language_model = K3ForCausalLM(config.text)

    def image_embeddings(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        """pixel_values [N, 3, p, p], grid_thw [I, 3] -> [sum (h/2)(w/2), text D]."""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thw))

    def embed(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, grid_thw=None
    ) -> torch.Tensor:
        """input_ids [B, T] (+ images) -> inputs_embeds [B, T, D] with the pads replaced."""
        e = self.language_model.model.embed_tokens(input_ids)
        if pixel_values is None:
            if bool((input_ids == self.pad_id).any()):
                raise ValueError("input_ids hold <|media_pad|> tokens but no pixel_values were given")
            return e
        if grid_thw is None:
            raise ValueError("grid_thw is required with pixel_values")
        img = self.image_embeddings(pixel_values, grid_thw)
        return scatter_image_embeddings(e, input_ids, img, self.pad_id, tokens_per_image(grid_thw))

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        grid_thw=None,
        **kwargs,
    ) -> CausalLMOutput:
        """input_ids [B, T] (+ pixel_values, grid_thw) -> logits [B, T, V] (+ loss). kwargs go to the LM."""
        e = self.embed(input_ids, pixel_values, grid_thw)
        return self.language_model(inputs_embeds=e, labels=labels, **kwargs)


def init_vl_weights(
    model: K3VLForCausalLM, seed: int | None = None, projector_norm_init: float = 1.0
) -> None:
    """The text model's init table (k3.model.init) plus `init_vision_weights` for tower and projector.

    projector_norm_init: the starting value of `mm_projector.post_norm.weight` [D]. With 1.0 the image
    tokens enter the LM at RMS 1 while text embeddings sit at RMS `initializer_range` (0.02): in the
    AttnRes depth mixtures the raw image embedding then dominates every layer's output at image positions
    and the tower's gradients shrink; a small value (0.1, the k3.train.vl default) puts both on a comparable
    scale [C: the release does not say how its projector was initialised; docs/vision.md].
    """
    if not (math.isfinite(projector_norm_init) and projector_norm_init > 0):
        raise ValueError(f"projector_norm_init must be a finite number > 0, got {projector_norm_init!r}")
    text = model.config.text
    init_weights(model.language_model, text.initializer_range, text.num_hidden_layers, seed=seed)
    init_vision_weights(model.vision_tower, text.initializer_range)
    init_vision_weights(model.mm_projector, text.initializer_range)
    with torch.no_grad():
        model.mm_projector.post_norm.weight.fill_(projector_norm_init)
