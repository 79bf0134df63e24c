"""Scheduler and block manager alone (pure Python, no model): budgets, aligned chunks, COW, preemption."""

import pytest

from k3.infer.cache.block_manager import PagePool, SlotPool
from k3.infer.config import EngineConfig
from k3.infer.scheduler import Scheduler
from k3.infer.sequence import Sequence


def run_step(sched: Scheduler):
    """Pretend the model ran the plan: advance every fed sequence."""
    plan = sched.schedule()
    for seq, n in plan.items:
        seq.num_computed += n
        if seq.num_computed == len(seq):
            seq.output.append(1)
    return plan


def _chunk_ends(cfg: EngineConfig, n: int = 100) -> tuple[list[int], list[int]]:
    """(num_computed after each step, the capture position each step's chunk carried) for one prompt."""
    sched = Scheduler(cfg)
    seq = Sequence(list(range(n)))
    sched.add(seq)
    ends, captures = [], []
    while seq.num_computed < n:
        run_step(sched)
        ends.append(seq.num_computed)
        captures.append(seq.capture)
    return ends, captures


def test_chunks_align_to_units_and_snapshot_before_the_last_token():
    cfg = EngineConfig(page_size=16, prefix_unit=16, num_pages=32, max_model_len=512, max_prefill_chunk=40)
    # 40-token budget rounded to units; 96 = floor(99/16)*16 is captured inside the last chunk ...
    assert _chunk_ends(cfg) == ([32, 64, 100], [0, 0, 96])
    # ... or, with capturing off, the prompt pauses there
    assert _chunk_ends(EngineConfig(**{**cfg.__dict__, "capture_snapshots": False})) == (
        [32, 64, 96, 100],
        [0, 0, 0, 0],
    )
    off = Scheduler(EngineConfig(**{**cfg.__dict__, "enable_prefix_cache": False}))
    seq2 = Sequence(list(range(100)))
    off.add(seq2)
    run_step(off)
    assert seq2.num_computed == 40


def test_token_budget_and_slots_bound_a_step():
    cfg = EngineConfig(page_size=16, prefix_unit=16, num_pages=64, max_model_len=256, max_num_seqs=2,
                       max_num_batched_tokens=50, enable_prefix_cache=False)  # fmt: skip
    sched = Scheduler(cfg)
    for _ in range(3):
        sched.add(Sequence(list(range(30))))
    plan = run_step(sched)
    assert [n for _, n in plan.items] == [30, 20] and len(sched.waiting) == 1  # 2 slots, 50 tokens
    plan = run_step(sched)
    assert [n for _, n in plan.items] == [1, 10]  # decode first, then the unfinished prefill


def test_decode_rows_ride_outside_the_prompt_budget():
    """Running decodes do not shrink the step's prompt budget: a waiting prompt that fits the budget
    is fed whole beside them, not cut into a chunk plus a short tail."""
    cfg = EngineConfig(page_size=16, prefix_unit=16, num_pages=64, max_model_len=256, max_num_seqs=4,
                       max_num_batched_tokens=64, enable_prefix_cache=False)  # fmt: skip
    sched = Scheduler(cfg)
    for _ in range(2):
        sched.add(Sequence(list(range(32))))
    run_step(sched)  # both prompts, 64 tokens
    for _ in range(2):
        sched.add(Sequence(list(range(32))))
    plan = run_step(sched)
    assert [n for _, n in plan.items] == [1, 1, 32, 32]
    assert sum(n for _, n in plan.items) == 66 > cfg.max_num_batched_tokens


def test_preemption_frees_the_newest_and_requeues_it_first():
    cfg = EngineConfig(page_size=16, prefix_unit=16, num_pages=4, max_model_len=64, enable_prefix_cache=False)
    sched = Scheduler(cfg)
    a, b = Sequence(list(range(32))), Sequence(list(range(32)))
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 pages each, pool full
    assert sched.pages.num_free == 0
    run_step(sched)  # a needs a third page at position 32: b is preempted
    assert sched.num_preemptions == 1 and sched.waiting[0] is b and b.num_computed == 0
    assert len(a.block_table) == 3 and sched.pages.num_free == 1


def test_pool_refcounts_and_slots():
    pool = PagePool(2)
    p = pool.allocate()
    pool.incref(p)
    assert pool.shared(p) and not pool.decref(p) and pool.decref(p) and pool.num_free == 2
    with pytest.raises(ValueError, match="already free"):
        pool.decref(p)
    slots = SlotPool(1)
    s = slots.allocate()
    assert slots.allocate() is None
    slots.free(s)
    with pytest.raises(ValueError, match="already free"):
        slots.free(s)
