"""Validation loss and bits per byte, the unigram baseline, and a code sample.

bits per byte = (sum of target losses in nats) / (ln 2 * sum of target UTF-8 bytes), over the same
targets (the brief's loss_nats * tokens / (bytes * ln 2)). A byte-level BPE token always stands for the
same bytes, so a target's byte count is a table lookup (`token_byte_lengths`); the document separator
(EOS) has 0 bytes but its loss counts, so predicting where a file ends is paid for. Tokenizer-independent,
unlike loss per token: a model with a bigger vocabulary is not rewarded for longer tokens.

The final evaluation of a run scores the whole split (or its first `final_eval_tokens` targets) under
`torch.inference_mode` in batches of about EVAL_TOKENS_PER_FORWARD tokens whatever the training
micro-batch (`eval_batch_rows`): a [1, 128] forward spends its time in per-op overhead, not arithmetic.
A plain model's head and loss then run a few hundred rows at a time from the final hidden states, so the
[B*T, V] logits of a large batch never exist (`_target_nats`; `_target_nats_reference` is the
full-logits form, and the two give the same sums up to float rounding). Evaluations during training
keep `torch.no_grad` (inference tensors cached by a kernel could not be reused by the next step).

Unigram baseline: the cross-entropy of the same validation targets under the training split's token
frequencies (add-one smoothed), in the same units -- what a model that ignores context achieves.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import torch
from torch import nn

from k3.data import TokenizedDocs
from k3.data.eval_set import IGNORE_INDEX, EvalSet, build_eval_set
from k3.model.generate import generate
from k3.model.transformer import K3ForCausalLM, make_context

EVAL_TOKENS_PER_FORWARD = 8192  # tokens per forward of a final evaluation
HEAD_ROWS = 512  # rows of hidden states per head + loss chunk: [512, V] fp32 logits at a time


def token_byte_lengths(tokenizer) -> np.ndarray:
    """[vocab_size] int64: UTF-8 bytes each id stands for (0 for the reserved block)."""
    out = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    backend = tokenizer._backend  # noqa: SLF001 -- the tokenizer exposes no per-token byte view
    if not hasattr(backend, "tok"):  # tiktoken: bytes -> rank (a dict, or a method returning one)
        ranks = backend.ranks() if callable(backend.ranks) else backend.ranks
        for b, r in ranks.items():
            out[r] = len(b)
        return out
    for i in range(tokenizer.base):
        piece = backend.tok.id_to_token(i)
        # byte-level BPE: one alphabet character per byte; padding entries are unreachable
        out[i] = 0 if piece is None or piece.startswith("<|unused_") else len(piece)
    return out


def _autocast(bf16: bool, device_type: str = "cpu"):
    return torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else nullcontext()


def eval_batch_rows(seq_len: int, batch_size: int, world_size: int = 1, rows: int | None = None) -> int:
    """Rows per forward of a final evaluation: about EVAL_TOKENS_PER_FORWARD tokens, at least
    `batch_size`, no more than the `rows` to score, a multiple of `world_size` (every rank scores its
    share of each batch; a short last batch is padded with ignored rows)."""
    n = max(batch_size, EVAL_TOKENS_PER_FORWARD // seq_len, 1)
    if rows is not None:
        n = min(n, max(rows, 1))
    return -(-n // world_size) * world_size


def _plain(model: nn.Module) -> bool:
    return type(model) is K3ForCausalLM and not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    )


def _target_nats(model: nn.Module, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (nats) of one packed batch, labels [B*T] (-100: ignored).
    A plain K3ForCausalLM runs its trunk once, then head + loss over HEAD_ROWS rows at a time; any other
    model (QAT, sharded) goes through `_target_nats_reference`."""
    if not _plain(model):
        return _target_nats_reference(model, inputs, labels)
    ids = inputs["input_ids"]
    ctx = make_context(*ids.shape, inputs["cu_seqlens"], inputs["doc_ids"], None)
    h = model.model.norm(model.model(ids, ctx=ctx)).flatten(0, 1)
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    for lo in range(0, h.shape[0], HEAD_ROWS):
        logits = model.lm_head(h[lo : lo + HEAD_ROWS]).float()
        total += torch.nn.functional.cross_entropy(
            logits, labels[lo : lo + HEAD_ROWS], reduction="sum", ignore_index=IGNORE_INDEX
        ).double()
    return total


def _target_nats_reference(model: nn.Module, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
    """`_target_nats` from the model's full logits [B, T, V]."""
    logits = model(inputs["input_ids"], cu_seqlens=inputs["cu_seqlens"], doc_ids=inputs["doc_ids"]).logits
    return torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), labels, reduction="sum", ignore_index=IGNORE_INDEX
    )


def evaluate(
    model: nn.Module,
    docs: TokenizedDocs | EvalSet,
    token_bytes: np.ndarray,
    eos_id: int,
    *,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    bf16: bool = False,
    unigram_logp: np.ndarray | None = None,
    runtime=None,
    inference: bool = False,
) -> dict[str, float]:
    """{"val_loss" (nats/token), "val_bpb", "tokens", "bytes"} (+ "unigram_bpb" of the same targets
    given `unigram_logp` [V]) over the fixed evaluation set of `docs` (k3.data.eval_set: every document
    once, one seeded order, the same for every run and model): its first `max_tokens` targets (rounded
    up to whole rows), or all of them for None / 0 -- then "bytes" is exactly the documents' UTF-8 size.

    With a distributed `runtime` (k3.train.runtime) every rank scores its batch_size / world_size rows
    of each batch and the sums are all-reduced: the same targets and result as one process.
    `inference`: run under torch.inference_mode (after training only), else torch.no_grad."""
    rank, world = (runtime.rank, runtime.world_size) if runtime is not None else (0, 1)
    device = runtime.device if runtime is not None else torch.device("cpu")
    es = docs if isinstance(docs, EvalSet) else build_eval_set(docs, seq_len, eos_id)
    lengths = torch.from_numpy(np.asarray(token_bytes))
    uni = None if unigram_logp is None else torch.from_numpy(unigram_logp)
    was_training = model.training
    model.eval()
    nats, uni_nats, tokens, nbytes = 0.0, 0.0, 0, 0
    try:
        for b in es.batches(batch_size, max_tokens, rank, world):
            inputs = {k: b[k].to(device) for k in ("input_ids", "cu_seqlens", "doc_ids")}
            labels = b["labels"].flatten()
            with torch.inference_mode() if inference else torch.no_grad(), _autocast(bf16, device.type):
                losses = _target_nats(model, inputs, labels.to(device))
            real = labels[labels != IGNORE_INDEX]
            nats += float(losses)
            uni_nats -= 0.0 if uni is None else float(uni[real].sum())
            tokens += real.numel()
            nbytes += int(lengths[real].sum())
    finally:
        model.train(was_training)
    if runtime is not None:
        nats, uni_nats, tokens, nbytes = runtime.sum([nats, uni_nats, tokens, nbytes])
        tokens, nbytes = int(tokens), int(nbytes)
    res = {"val_loss": nats / max(tokens, 1), "val_bpb": nats / (math.log(2) * max(nbytes, 1)),
           "tokens": tokens, "bytes": nbytes}  # fmt: skip
    if uni is not None:
        res["unigram_bpb"] = uni_nats / (math.log(2) * max(nbytes, 1))
    return res


def unigram_log_probs(train: TokenizedDocs, eos_id: int, vocab_size: int) -> np.ndarray:
    """[V] float64 log-frequencies of the training stream (documents + one EOS each), add-one smoothed."""
    counts = np.bincount(np.asarray(train.tokens), minlength=vocab_size).astype(np.float64) + 1.0
    counts[eos_id] += train.num_docs
    return np.log(counts / counts.sum())


@torch.no_grad()
def sample_text(
    model: nn.Module,
    tokenizer,
    prompt: str,
    max_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """`prompt` + up to `max_tokens` sampled tokens, decoded (stops at EOS)."""
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        out = generate(
            model,
            torch.tensor([ids]),
            max_tokens,
            temperature=temperature,
            top_k=top_k,
            eos_token_id=tokenizer.eos_id,
            generator=gen,
        )
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0].tolist())
