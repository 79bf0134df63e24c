"""Continuous batching with chunked prefill, prefix-cache admission and preemption (pure Python).

Each `schedule()` call plans one model step within a budget of prompt tokens: running sequences first (a
decode feeds 1 token, an unfinished prefill its next chunk), then waiting ones while a KDA slot and pages are
free. Decode rows ride outside the budget (at most `max_num_seqs` of them): charging them would cut the step's
last prompt into a short tail chunk, and a short prefill forward costs nearly as much as a full one. With the
prefix cache on, a prefill chunk that does not finish the prompt ends on a unit boundary, and the KDA state at
floor((P-1)/unit)*unit is snapshotted (the last prompt token is always recomputed to produce logits): captured
inside the prompt's last chunk (`EngineConfig.capture_snapshots`), or, with that off, by pausing the prompt
there. A chunk also ends where the cached MLA chain outran the deepest snapshot at admission (a junction: a
shared prefix that later requests branch from) so a snapshot lands there. When pages run out, cache-only pages
are evicted first, then the newest running sequence is preempted: its memory is freed and it is requeued to
recompute prompt + output so far (its cached prefix usually comes straight back from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from k3.infer.cache.block_manager import PagePool, SlotPool
from k3.infer.cache.prefix_cache import PrefixCache, chain_hashes
from k3.infer.config import EngineConfig
from k3.infer.sequence import Sequence, Status


@dataclass
class StepPlan:
    """What the runner must do this step: page copies (COW), slot restores/resets, then feed `items`."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to feed)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src page, dst page)
    restores: list[tuple[int, object]] = field(default_factory=list)  # (slot, snapshot handle)
    resets: list[int] = field(default_factory=list)  # slots to zero

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.pages = PagePool(config.num_pages)
        self.slots = SlotPool(config.max_num_seqs)
        self.cache = (
            PrefixCache(
                self.pages,
                config.prefix_unit,
                config.page_size,
                config.snapshot_budget_bytes,
                config.snapshots_per_path,
            )
            if config.enable_prefix_cache
            else None
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -----------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan, budget = StepPlan(), self.config.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            decoding = seq.num_computed >= len(seq.prompt)  # one token, outside the budget
            if not decoding and budget == 0:
                continue
            n = self._chunk(seq, 1 if decoding else budget)
            while not self._reserve(seq, n, plan):
                victim = next(
                    (
                        s
                        for s in reversed(self.running)
                        if s is not seq and all(s is not x for x, _ in plan.items)
                    ),
                    None,
                )
                self.preempt(victim or seq)
                if victim is None:
                    break
            if seq.status is Status.RUNNING:
                plan.items.append((seq, n))
                budget -= 0 if decoding else n
        while self.waiting and budget > 0 and self.slots.num_free:
            if not self._admit(self.waiting[0], budget, plan):
                break
            seq = self.waiting.popleft()
            budget -= plan.items[-1][1]
        return plan

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens to feed this step; chunk ends land on cache units when the prompt is not finished."""
        c, remaining = seq.num_computed, seq.num_uncomputed
        n = min(remaining, budget, self.config.max_prefill_chunk)
        seq.capture = 0
        if self.cache is None or seq.params.prompt_logprobs is not None:
            return n
        u = self.config.prefix_unit
        if n < remaining and (c + n) // u * u > c:
            n = (c + n) // u * u - c
        last = (len(seq) - 1) // u * u
        for stop in (seq.junction, last):
            if c < stop < c + n:
                if stop == last and stop != seq.junction and self.config.capture_snapshots:
                    seq.capture = stop  # the runner snapshots it inside this chunk
                else:
                    n = stop - c
        return n

    def _admit(self, seq: Sequence, budget: int, plan: StepPlan) -> bool:
        slot = self.slots.allocate()
        hit = None
        if self.cache is not None and seq.params.prompt_logprobs is None:
            u = self.config.prefix_unit
            hashes = chain_hashes(seq.tokens, u, seq.salt, n_units=(len(seq) - 1) // u, media=seq.media)
            hit = self.cache.lookup(hashes, len(seq))
            seq.block_table, seq.num_computed = list(hit.pages), hit.length
            seq.junction = hit.mla_depth if hit.mla_depth > hit.length else 0
            seq.block_hashes = hashes[: hit.length // u]
            if seq.cached_tokens == 0:
                seq.cached_tokens = hit.length
        n = self._chunk(seq, budget)
        mark = len(plan.copies)
        if not self._reserve(seq, n, plan):
            del plan.copies[mark:]
            self._release(seq)
            self.slots.free(slot)
            return False
        seq.slot, seq.status = slot, Status.RUNNING
        if self.cache is not None:
            self.cache.queried_tokens += len(seq)
            self.cache.hit_tokens += seq.num_computed
        if hit is not None and hit.snapshot is not None:
            plan.restores.append((slot, hit.snapshot))
        else:
            plan.resets.append(slot)
        self.running.append(seq)
        plan.items.append((seq, n))
        return True

    # ---- memory -------------------------------------------------------------------------------------
    def _alloc(self) -> int | None:
        page = self.pages.allocate()
        while page is None and self.cache is not None and self.cache.evict_page():
            page = self.pages.allocate()
        return page

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Pages for positions [0, num_computed + n), the partially filled one made private (COW)."""
        ps, c = self.config.page_size, seq.num_computed
        if c % ps and self.pages.shared(seq.block_table[c // ps]):
            page = self._alloc()
            if page is None:
                return False
            plan.copies.append((seq.block_table[c // ps], page))
            self.pages.decref(seq.block_table[c // ps])
            seq.block_table[c // ps] = page
        while len(seq.block_table) * ps < c + n:
            page = self._alloc()
            if page is None:
                return False
            seq.block_table.append(page)
        return True

    def _release(self, seq: Sequence) -> None:
        for page in seq.block_table:
            self.pages.decref(page)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
        seq.pending_snapshot = seq.captured = None

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's memory and requeue it first in line (recompute on return)."""
        self.running.remove(seq)
        self._release(seq)
        self.slots.free(seq.slot)
        seq.slot, seq.status = None, Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence (its registered pages stay in the cache)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.slots.free(seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
