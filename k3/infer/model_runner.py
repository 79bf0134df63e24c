"""Owns the device caches and runs the model on a `StepPlan` (CONTRIBUTING.md#the-engine-owns-the-caches).

Pools, allocated once from the engine config:
* MLA layer l: latents [num_pages * page_size, R + Dr] in the model dtype (a page = page_size rows);
* KDA layer l: conv_q/k/v [num_slots, C, W-1] (model dtype) and recurrent [num_slots, H, K, V] fp32.

A step first applies the plan's page copies (copy-on-write) and slot restores/resets, then runs one forward
per group of rows that feed the same number of tokens n, whatever their cached lengths (a ragged batch,
k3.infer.cache.paged_mla): all decode rows (n == 1) go in one `DecodeStep` (k3.infer.decode: the native C
step, or the torch step compiled at batch 1 with `EngineConfig.compile`; chosen once, here), and prefill
chunks of equal size share one forward too. With `EngineConfig.compile` the SiTU activations run fused
(k3.ops.glu.fused_activations). The model decodes with the absorbed MLA path and the KDA recurrence
when n == 1 and prefills with the chunked paths otherwise; MLA attention over a long cache streams the
latents page block by page block (k3.model.mla, DENSE_MAX_SCORES)."""

from __future__ import annotations

import torch

from k3.infer.cache.paged_mla import PagedBatch, PagedMLAState
from k3.infer.config import EngineConfig
from k3.infer.decode.backend import DecodeStep
from k3.infer.decode.native_step import unsupported as native_unsupported
from k3.infer.decode.native_step import weight_dtype
from k3.infer.media import embed_with_media
from k3.infer.scheduler import StepPlan
from k3.infer.sequence import Sequence
from k3.model.state import KDAState
from k3.model.transformer import K3ForCausalLM
from k3.ops.glu import fused_activations
from k3.quant.packed import PackedRoutedExperts

KDA_FIELDS = ("conv_q", "conv_k", "conv_v", "recurrent")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: EngineConfig):
        self.model, self.config = model, config
        mc = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, model.model.embed_tokens.weight.dtype
        # a model with bf16 or Q8_0 weights that the native step runs keeps its caches fp32 and runs every
        # row natively (its torch paths would compute in bf16, or widen the 8-bit matrices per call)
        self.typed_native = (config.native and weight_dtype(model) == "typed" and type(model) is K3ForCausalLM
                             and native_unsupported(self) is None)  # fmt: skip
        if self.typed_native:
            self.dtype = torch.float32
        la, n_slots = mc.linear_attn_config, config.max_num_seqs
        C, W = la.num_heads * la.head_dim, la.short_conv_kernel_size
        self.mla: dict[int, torch.Tensor] = {}
        self.kda: dict[int, dict[str, torch.Tensor]] = {}
        for i in range(mc.num_hidden_layers):
            if mc.is_kda_layer(i):
                conv = lambda: torch.zeros(n_slots, C, W - 1, device=self.device, dtype=self.dtype)
                rec = torch.zeros(n_slots, la.num_heads, la.head_dim, la.head_dim, device=self.device)
                self.kda[i] = dict(conv_q=conv(), conv_k=conv(), conv_v=conv(), recurrent=rec)
            else:
                width = mc.kv_lora_rank + mc.qk_rope_head_dim
                rows = config.num_pages * config.page_size
                self.mla[i] = torch.zeros(rows, width, device=self.device, dtype=self.dtype)
        self.decode = DecodeStep(self, compile=config.compile, native=config.native)
        if config.deterministic and self.decode.native is None:
            raise ValueError(
                "deterministic serving runs every row through the native C step, which does not run this "
                f"model: {self.decode.why_not_native}"
            )
        if self.typed_native and self.decode.native is None:
            why = self.decode.why_not_native
            raise RuntimeError(f"the native step did not build for a bf16 / Q8_0 model: {why}")
        # every row through the native step: asked for, or where it beats the torch prefill (bf16 weights,
        # MXFP4 experts, which torch widens per call)
        packed = any(isinstance(m, PackedRoutedExperts) for m in model.modules())
        self.exact = config.deterministic or self.typed_native or (packed and self.decode.native is not None)
        self.snapshot_nbytes = sum(
            t[0].numel() * t.element_size() for d in self.kda.values() for t in d.values()
        )

    # ---- cache maintenance --------------------------------------------------------------------------
    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        ps = self.config.page_size
        for src, dst in pairs:
            for pool in self.mla.values():
                pool[dst * ps : (dst + 1) * ps] = pool[src * ps : (src + 1) * ps]

    def snapshot(self, slot: int) -> tuple:
        """A private copy of every KDA layer's state in `slot` (the snapshot handle)."""
        return tuple(tuple(d[f][slot].clone() for f in KDA_FIELDS) for d in self.kda.values())

    def restore(self, slot: int, handle: tuple) -> None:
        for d, saved in zip(self.kda.values(), handle, strict=True):
            for f, t in zip(KDA_FIELDS, saved, strict=True):
                d[f][slot] = t

    def reset(self, slot: int) -> None:
        for d in self.kda.values():
            for t in d.values():
                t[slot] = 0

    # ---- forward ------------------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, plan: StepPlan) -> list[torch.Tensor]:
        """-> per plan item, fp32 logits [n, V] for its n fed tokens when the sequence wants prompt
        logprobs, else [1, V] for the last one ([0, V] when no row of its forward reaches its end: a
        prompt chunk before the last needs no logits)."""
        self.copy_pages(plan.copies)
        for slot, handle in plan.restores:
            self.restore(slot, handle)
        for slot in plan.resets:
            self.reset(slot)
        if self.exact and not any(s.media for s, _ in plan.items):
            return self._native_rows(plan)
        groups: dict[int, list[int]] = {}
        for j, (_, n) in enumerate(plan.items):
            groups.setdefault(n, []).append(j)
        out: list[torch.Tensor | None] = [None] * len(plan.items)
        for n, rows in groups.items():
            with fused_activations(self.config.compile):
                logits = self._forward([plan.items[j][0] for j in rows], n)
            logits = logits.cpu()  # sampling and its generators live on the CPU
            for r, j in enumerate(rows):
                out[j] = logits[r]
        return out

    def _native_rows(self, plan: StepPlan) -> list[torch.Tensor]:
        """`execute` through the native step for every row, prompt chunks included: each prompt token is
        a row that sees the rows before it (k3.infer.decode.native_step.NativeDecodeStep.rows), so its
        logits, latents and KDA states are the bits decode would give it, whatever the chunking, the
        batch mates, the prefix-cache hits or the thread count. A prompt whose KDA state is captured
        inside this chunk runs in two calls, split there, with the snapshot taken between them."""
        step, V = self.decode.native, self.model.config.vocab_size
        first, second = _RowSet(), _RowSet()
        for j, (s, n) in enumerate(plan.items):
            c = s.num_computed
            split = s.capture if c < s.capture < c + n else c + n
            want_all = s.params.prompt_logprobs is not None
            for pos, tok in zip(range(c, c + n), _tokens(s, c, c + n), strict=True):
                rows = first if pos < split else second
                rows.add(j, tok, s.slot, s.block_table, pos, want_all or pos == len(s) - 1)
        logits = [step.rows(*first.args()) if first.ids else None]
        for s, n in plan.items:
            c = s.num_computed
            if c < s.capture < c + n:
                s.captured = (s.capture, self.snapshot(s.slot))
        logits.append(step.rows(*second.args()) if second.ids else None)
        out = [torch.empty(0, V) for _ in plan.items]
        parts: list[list[torch.Tensor]] = [[] for _ in plan.items]
        for rows, lg in zip((first, second), logits, strict=True):
            for r, j in enumerate(rows.owners):
                parts[j].append(lg[r])
        for j, p in enumerate(parts):
            if p:
                out[j] = torch.stack(p)
        return out

    def _forward(self, seqs: list[Sequence], n: int) -> torch.Tensor:
        """B sequences with c_b cached tokens each, feeding n more -> logits [B, n or 1 or 0, V] fp32."""
        starts = [s.num_computed for s in seqs]
        if n == 1 and not any(s.media for s in seqs):  # decode rows (and one-token prompt tails)
            ids = [_tokens(s, c, c + 1)[0] for s, c in zip(seqs, starts, strict=True)]
            return self.decode(ids, [s.slot for s in seqs], [s.block_table for s in seqs], starts)
        ids = torch.tensor(
            [_tokens(s, c, c + n) for s, c in zip(seqs, starts, strict=True)], device=self.device
        )
        batch = PagedBatch.from_tables(
            [s.block_table for s in seqs], starts, n, self.config.page_size, self.device
        )
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        capture = [s.capture - c if c < s.capture < c + n else -1 for s, c in zip(seqs, starts, strict=True)]
        state = []
        for i in range(self.model.config.num_hidden_layers):
            state.append(self.kda_state(i, slots) if i in self.kda else PagedMLAState(self.mla[i], batch))
            if i in self.kda and max(capture) > 0:
                state[-1].capture_at = capture
        if any(s.media for s in seqs):
            embed = self.model.model.embed_tokens
            rows = [
                embed_with_media(embed, ids[b : b + 1], [s], c)
                for b, (s, c) in enumerate(zip(seqs, starts, strict=True))
            ]
            inp = {"inputs_embeds": torch.cat(rows)}
        else:
            inp = {"input_ids": ids}
        # Logits of every position for prompt logprobs, else of the last one where a row reaches its end
        # (it samples), else none: the last layer then runs its mixer for the cache and state only.
        if any(s.params.prompt_logprobs is not None for s in seqs):
            keep = None
        else:
            keep = int(any(c + n >= len(s) for s, c in zip(seqs, starts, strict=True)))
        h = self.model.model(**inp, state=state, keep=keep)  # K3ForCausalLM.forward on the kept rows
        logits = self.model.lm_head(self.model.model.norm(h)).float()
        self.store_kda(state, slots)
        for b, (s, p) in enumerate(zip(seqs, capture, strict=True)):
            if p > 0:
                s.captured = (s.capture, self.captured_snapshot(state, b))
        return logits

    def captured_snapshot(self, state: list, row: int) -> tuple:
        """The KDA states a forward captured for batch row `row`, as a snapshot handle (`snapshot`'s
        layout and dtypes)."""
        return tuple(
            tuple(getattr(state[i].captured, f)[row].to(d[f].dtype).clone() for f in KDA_FIELDS)
            for i, d in self.kda.items()
        )

    def kda_state(self, layer: int, slots: torch.Tensor) -> KDAState:
        """KDA layer `layer`'s conv and recurrent states of the rows in `slots` [B] (gathered copies)."""
        return KDAState(**{f: self.kda[layer][f][slots] for f in KDA_FIELDS})

    def store_kda(self, state: list, slots: torch.Tensor) -> None:
        """Write every KDA layer's state of a forward (`state[layer]`) back into `slots`."""
        for i, pools in self.kda.items():
            for f in KDA_FIELDS:
                pools[f][slots] = getattr(state[i], f).to(pools[f].dtype)


class _RowSet:
    """The rows of one native call: per row its token, slot, page table and position, and which rows
    return logits (`owners`: the plan item of each returned row, in order)."""

    def __init__(self):
        self.ids, self.slots, self.tables, self.lengths, self.out, self.owners = [], [], [], [], [], []

    def add(self, item: int, tok: int, slot: int, table: list[int], pos: int, keep: bool) -> None:
        if keep:
            self.out.append(len(self.ids))
            self.owners.append(item)
        self.ids.append(tok)
        self.slots.append(slot)
        self.tables.append(table)
        self.lengths.append(pos)

    def args(self) -> tuple:
        return self.ids, self.slots, self.tables, self.lengths, self.out


def _tokens(seq: Sequence, start: int, stop: int) -> list[int]:
    """seq.tokens[start:stop] without concatenating prompt and output."""
    P = len(seq.prompt)
    return seq.prompt[start:stop] + seq.output[max(0, start - P) : max(0, stop - P)]
