"""Q8_0 linear layers: llama.cpp's 8-bit blocks kept as stored (int8 codes, one scale per 32 inputs).

    layer = Q8Linear.from_blocks(codes, scales)   # codes int8 [O, I], scales fp32 [O, I / 32]
    y = layer(x)                                  # x @ (codes * scales)^T, widened per call in torch

A weight is its code times its block's scale, exact in fp32, so the layer is the fp32 matrix `weight`
returns, held in a quarter of the bytes. The native step (k3.infer.decode.native_step) reads the codes
and scales directly; torch paths widen the matrix on each call. Made by the GGUF reader for Q8_0 tensors
(k3.export.gguf_read).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

BLOCK = 32


class Q8Linear(nn.Module):
    """A bias-free linear layer over Q8_0 blocks: buffers `codes` int8 [O, I] and `scales` fp32 [O, I/32]."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        O, I = codes.shape
        if codes.dtype != torch.int8 or I % BLOCK or scales.shape != (O, I // BLOCK):
            raise ValueError(f"Q8Linear: codes int8 [O, I] (I a multiple of 32) and scales [O, I/32]; got "
                             f"{codes.dtype} {tuple(codes.shape)} and {tuple(scales.shape)}")  # fmt: skip
        self.in_features, self.out_features = I, O
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.float().contiguous())

    @classmethod
    def from_blocks(cls, codes: torch.Tensor, scales: torch.Tensor) -> Q8Linear:
        return cls(codes, scales)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q8Linear:
        """Q8_0 of a [O, I] matrix as ggml rounds it: per 32 inputs d = amax / 127 in fp16, codes
        round(w / d)."""
        O, I = weight.shape
        blocks = weight.detach().float().view(O, I // BLOCK, BLOCK)
        d = (blocks.abs().amax(-1) / 127).half().float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return cls(codes.view(O, I), d)

    @property
    def weight(self) -> torch.Tensor:
        """The matrix as fp32 [O, I] (a new tensor each time)."""
        O, I = self.codes.shape
        return (self.codes.float().view(O, I // BLOCK, BLOCK) * self.scales.unsqueeze(-1)).view(O, I)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0"


def quantize_linears(model: nn.Module, skip=("lm_head",)) -> nn.Module:
    """Every nn.Linear of `model` whose width is a multiple of 32 as a Q8Linear (in place; returns it),
    but those whose name ends with one of `skip`."""
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        if m.in_features % BLOCK or name.endswith(skip):
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, Q8Linear.quantize(m.weight))
    return model
