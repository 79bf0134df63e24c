"""Token selection: greedy, temperature, top-k, top-p (nucleus), per-request seeded generators, and
logprobs (of the model's raw distribution, as OpenAI reports them) with the top-N alternatives."""

from __future__ import annotations

import numpy as np
import torch

from k3.infer.sequence import SamplingParams

# Below this temperature sampling is greedy: the scaled logits' softmax is a one-hot up to rounding, and
# dividing by a tiny temperature (1e-300) overflows to inf, whose softmax is NaN.
MIN_TEMPERATURE = 1e-5


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 -> temperature-scaled logits with tokens outside top-k / top-p set to -inf."""
    x = logits / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest set reaching top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """logits [V] fp32 -> the next token id."""
    if params.temperature < MIN_TEMPERATURE:
        # numpy's argmax (the first maximum, a NaN counting as one, as torch's) in ~4 us where torch's
        # costs ~50 us a row: it wakes torch's thread pool, whose spinning then competes with the next step
        return int(np.argmax(logits.detach().cpu().numpy()))
    probs = torch.softmax(filtered_logits(logits, params), -1)
    return int(torch.multinomial(probs, 1, generator=generator))


def logprobs(logits: torch.Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """logits [V] -> (logprob of `token`, [(id, logprob)] of the top_n most likely tokens)."""
    lp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(lp, top_n) if top_n else None
    alts = [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
    return float(lp[token]), alts
