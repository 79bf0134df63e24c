"""Naive generation on the model itself: the reference the inference engine is tested against
(CONTRIBUTING.md#a-reference-generate).

`use_cache=False` recomputes the whole sequence every step (slow, obviously right); `use_cache=True`
prefills a `ModelState` once and then decodes one token at a time with the KDA recurrence and the
absorbed MLA path. Greedy decoding (temperature 0) of both must give the same tokens.
"""

import torch

from k3.model.state import ModelState


def pick_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [B, V] -> next ids [B]."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """input_ids [B, T] -> [B, T + n] with n <= max_new_tokens (stops early once every row hit eos)."""
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    state = ModelState.empty(model.config) if use_cache else None
    ids, step_input = input_ids, input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = model(step_input if use_cache else ids, state=state).logits[:, -1]
        nxt = pick_next(logits, temperature, top_k, generator)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        step_input = nxt[:, None]
        if eos_token_id is not None and bool(done.all()):
            break
    return ids
