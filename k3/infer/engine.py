"""Engine: add_request / step / generate / abort over the scheduler, the model runner and the sampler.

One `step()` plans a batch (`Scheduler`), runs it (`ModelRunner`), then per fed sequence: records prompt
logprobs, registers completed units' pages and aligned KDA snapshots with the prefix cache, samples when
the sequence has consumed all its tokens, and applies the stop rules (stop token ids incl. EOS, stop
strings on the detokenized text, max_tokens, max_model_len). A snapshot taken during decode is kept as
the sequence's pending snapshot and registered when it finishes (the next turn resumes there).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from k3.infer import memory
from k3.infer.cache.prefix_cache import chain_hashes
from k3.infer.config import EngineConfig
from k3.infer.media import check_media
from k3.infer.model_runner import ModelRunner
from k3.infer.sampler import logprobs, sample
from k3.infer.scheduler import Scheduler
from k3.infer.sequence import SamplingParams, Sequence, Status


def stop_at(text: str, stops: tuple[str, ...], checked: int = 0) -> int:
    """Where `text` is cut by the first of `stops` (in their order) that it holds, or -1. `text[:checked]`
    was searched before and holds none, so only matches ending after it are looked for: each search
    covers the new text plus the stop string's length, never the whole output."""
    for s in stops:
        at = text.find(s, max(0, checked - len(s) + 1))
        if at >= 0:
            return at
    return -1


def stop_at_reference(text: str, stops: tuple[str, ...], checked: int = 0) -> int:
    """`stop_at` searching the whole text every time, `checked` unused (the plain form the tests compare
    it with)."""
    for s in stops:
        at = text.find(s)
        if at >= 0:
            return at
    return -1


def make_head_column_major(model: torch.nn.Module) -> None:
    """Re-lay a large CPU `lm_head.weight` [V, D] out column-major (same values, shape and Parameter).

    A decode step multiplies one hidden row by the whole head; with the weight stored [D, V]-contiguous
    that is a streaming x @ W^T instead of V strided dot products (k3-tiny: ~5x faster per step). The
    checkpoint writer makes tensors contiguous, so saved files do not change.
    """
    head = getattr(model, "lm_head", None)
    w = getattr(head, "weight", None)
    if not isinstance(w, torch.Tensor) or w.device.type != "cpu" or w.dim() != 2:
        return
    if w.is_contiguous() and w.shape[0] >= 4 * w.shape[1]:
        with torch.no_grad():
            w.data = w.data.t().contiguous().t()


@dataclass
class StepOutput:
    seq: Sequence
    new_tokens: list[int]
    finished: bool


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig | None = None,
        tokenizer=None,
        eos_token_id: int | None = None,
    ):
        self.config = config or EngineConfig()
        self.model, self.tokenizer = model.eval(), tokenizer
        make_head_column_major(model)
        if self.config.keep_freed_memory:
            memory.keep_freed_memory()
        self.eos_token_id = (
            eos_token_id
            if eos_token_id is not None
            else (tokenizer.eos_id if tokenizer is not None else model.config.eos_token_id)
        )
        self.vocab_size = model.config.vocab_size
        self.scheduler = Scheduler(self.config)
        self.runner = ModelRunner(model, self.config)
        self.generator = torch.Generator().manual_seed(0)
        self.requests: dict[str, Sequence] = {}
        self.stats = dict(
            requests=0, prompt_tokens=0, generated_tokens=0, failed_requests=0, aborted_requests=0
        )

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        salt: str = "",
        request_id: str | None = None,
        media: tuple = (),
    ) -> Sequence:
        """`media`: `k3.infer.media.MediaSpan`s, prompt positions fed from given embeddings (images)."""
        params = params or SamplingParams()
        self.validate(prompt, media)
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(list(prompt), params, salt=salt, request_id=request_id or "", media=tuple(media))
        seq.generator = self.generator if params.seed is None else torch.Generator().manual_seed(params.seed)
        self.requests[seq.request_id] = seq
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(prompt)
        self.scheduler.add(seq)
        return seq

    def validate(self, prompt: list[int], media: tuple = ()) -> None:
        """Raise ValueError for a prompt (and media spans) the engine cannot take (no state is touched)."""
        if media:
            check_media(media, len(prompt), self.model.config.hidden_size)
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        if len(prompt) > self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens, more than max_model_len {self.config.max_model_len}"
            )

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and seq.status is not Status.FINISHED:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
            self.stats["aborted_requests"] += 1

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- stepping -----------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if not plan:
            return []
        # A decode-only step runs in inference mode (less per-op dispatch work than no_grad). Prefill
        # chunks stay in no_grad: kernels there cache constant tensors that training may reuse later.
        decode_only = all(n == 1 for _, n in plan.items)
        with torch.inference_mode() if decode_only else contextlib.nullcontext():
            all_logits = self.runner.execute(plan)
        outputs = []
        for (seq, n), logits in zip(plan.items, all_logits, strict=True):
            before = len(seq.output)
            try:
                self._advance(seq, n, logits)
            except Exception as e:  # noqa: BLE001 - this row's sampling or detokenizing failed: it alone fails
                self._fail(seq, e)
            if (
                seq.status is not Status.FINISHED
                and seq.num_computed == len(seq)
                and len(seq.output) == before
            ):
                self._finish(seq, "length")  # max_tokens == 0: prompt scored, nothing to generate
            if len(seq.output) > before or seq.status is Status.FINISHED:
                outputs.append(StepOutput(seq, seq.output[before:], seq.status is Status.FINISHED))
        return outputs

    def _advance(self, seq: Sequence, n: int, logits: torch.Tensor) -> None:
        """Account for n fed tokens (logits [n, V]) and sample when the sequence is caught up."""
        c = seq.num_computed
        if seq.params.prompt_logprobs is not None:
            for t in range(c, c + n):
                if t + 1 < len(seq.prompt) and t == len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append(
                        logprobs(logits[t - c], seq.prompt[t + 1], seq.params.prompt_logprobs)
                    )
        seq.num_computed += n
        if self.scheduler.cache is not None:
            self._register(seq, n)
        if seq.num_computed < len(seq) or len(seq.output) >= seq.params.max_tokens:
            return
        tok = sample(logits[-1], seq.params, seq.generator)
        if seq.params.logprobs is not None:
            seq.logprobs.append(logprobs(logits[-1], tok, seq.params.logprobs))
        seq.output.append(tok)
        self.stats["generated_tokens"] += 1
        self._check_stop(seq, tok)

    def _register(self, seq: Sequence, n: int) -> None:
        """New complete units -> MLA cache entries; an aligned state -> a KDA snapshot (now or pending)."""
        cache, u, ps = self.scheduler.cache, self.config.prefix_unit, self.config.page_size
        done = len(seq.block_hashes)
        seq.block_hashes = chain_hashes(
            seq.tokens, u, seq.salt, seq.num_computed // u, start=seq.block_hashes, media=seq.media
        )
        for i in range(done, len(seq.block_hashes)):
            cache.add_page(seq.block_hashes[i], seq.block_table[i * u // ps])
        if seq.captured is not None:  # the state at an aligned position inside this chunk
            length, handle = seq.captured
            seq.captured = None
            if self.config.snapshot_budget_bytes:
                cache.add_snapshot(seq.block_hashes, length, handle, self.runner.snapshot_nbytes)
        if seq.num_computed % u or self.config.snapshot_budget_bytes == 0:
            return
        handle = self.runner.snapshot(seq.slot)
        if n > 1 or seq.num_computed <= len(seq.prompt):
            cache.add_snapshot(seq.block_hashes, seq.num_computed, handle, self.runner.snapshot_nbytes)
        else:
            seq.pending_snapshot = (seq.num_computed, handle)

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        if self.tokenizer is not None:
            seq.text = self._detokenize(seq)
            if p.stop:
                at = stop_at(seq.text, p.stop, seq.stop_checked)
                seq.stop_checked = len(seq.stable_text)
                if at >= 0:
                    seq.text = seq.text[:at]
                    return self._finish(seq, "stop")
        if tok in p.stop_token_ids or (tok == self.eos_token_id and not p.ignore_eos):
            return self._finish(seq, "stop")
        if len(seq.output) >= p.max_tokens or len(seq) >= self.config.max_model_len:
            return self._finish(seq, "length")

    def _detokenize(self, seq: Sequence) -> str:
        """decode(seq.output), decoding only the tokens after the last whole-character boundary: byte-level
        BPE text is the concatenation of its tokens' bytes, so decode(a + b) == decode(a) + decode(b)
        whenever a's bytes end on a whole UTF-8 character (its decoding does not end in U+FFFD)."""
        tail = seq.output[seq.stable_ids :]
        if seq.params.reserved_text:
            tail = self.tokenizer.decode(tail, reserved_text=dict(seq.params.reserved_text))
        else:
            tail = self.tokenizer.decode(tail)
        text = seq.stable_text + tail
        if not tail.endswith("\ufffd"):
            seq.stable_ids, seq.stable_text = len(seq.output), text
        return text

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End one request whose own step failed (finish_reason "error"); the rest of its batch goes on.
        Its memory is released like an abort's; nothing it half-registered is kept as a snapshot."""
        seq.error = f"{type(error).__name__}: {error}"
        seq.finish_reason, seq.pending_snapshot = "error", None
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        self.stats["failed_requests"] += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.pending_snapshot is not None and self.scheduler.cache is not None:
            length, handle = seq.pending_snapshot
            self.scheduler.cache.add_snapshot(seq.block_hashes, length, handle, self.runner.snapshot_nbytes)
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)

    @classmethod
    def from_checkpoint(
        cls, ckpt_dir: str, config: EngineConfig | None = None, device: str = "cpu"
    ) -> Engine:
        """Model (k3.checkpoint) + tokenizer (K3Tokenizer files in the same directory, if any), or a
        kimi-k3 GGUF file's model and tokenizer (k3.export.gguf_read: MXFP4 routed experts stay packed,
        other tensors are decoded to bfloat16 for a BF16 file, else to float32)."""
        from pathlib import Path

        from k3.checkpoint.io import load_checkpoint
        from k3.export.gguf_read import is_gguf, load_gguf
        from k3.tokenizer import K3Tokenizer

        if is_gguf(ckpt_dir):
            gguf = load_gguf(ckpt_dir, device=device)
            return cls(gguf.model, config, tokenizer=gguf.tokenizer)
        model, _ = load_checkpoint(ckpt_dir, device=device)
        d = Path(ckpt_dir)
        has_tok = (d / "tokenizer_config.json").exists()
        return cls(model, config, tokenizer=K3Tokenizer.from_dir(d) if has_tok else None)

    # ---- convenience --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        salt: str = "",
    ) -> list[Sequence]:
        """Run prompts to completion (continuous batching) -> finished sequences in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp, salt=salt) for p, sp in zip(prompts, plist, strict=True)]
        while any(s.status is not Status.FINISHED for s in seqs):
            self.step()
        return seqs

    def metrics(self) -> dict:
        """Counters and gauges (plain ints). Memory: KDA slots held by sequences; MLA pages held by
        sequences (`mla_pages_in_use`, shared ones counted once), held only by the prefix cache
        (`mla_pages_cached`) and free; KDA snapshots in the cache and those sequences still hold
        (pending or captured, registered when they finish or their chunk ends). Idle = no slot, no
        sequence page, no sequence snapshot."""
        sch, cache = self.scheduler, self.scheduler.cache
        seqs = [*sch.running, *sch.waiting]
        seq_pages = {p for s in seqs for p in s.block_table}
        pool = sch.pages
        return dict(
            self.stats,
            running=len(sch.running),
            waiting=len(sch.waiting),
            preemptions=sch.num_preemptions,
            prefix_cache_queried_tokens=cache.queried_tokens if cache else 0,
            prefix_cache_hit_tokens=cache.hit_tokens if cache else 0,
            kda_slots_total=sch.slots.num_slots,
            kda_slots_in_use=sch.slots.num_slots - sch.slots.num_free,
            mla_pages_total=pool.num_pages,
            mla_pages_in_use=len(seq_pages),
            mla_pages_cached=pool.num_pages - pool.num_free - len(seq_pages),
            mla_pages_free=pool.num_free,
            kda_snapshots_cached=len(cache.snaps) if cache else 0,
            kda_snapshot_bytes=cache.snapshot_bytes if cache else 0,
            kda_snapshots_held=sum((s.pending_snapshot is not None) + (s.captured is not None) for s in seqs),
        )
