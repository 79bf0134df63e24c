"""Hybrid prefix cache: exact (cache on == off), the snapshot invariant, eviction, tenant isolation."""

import pytest
import torch

from k3.infer.cache.block_manager import PagePool
from k3.infer.cache.prefix_cache import PrefixCache, chain_hashes
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.model.state import ModelState

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def cfg(**kw):
    base = dict(page_size=16, prefix_unit=16, num_pages=96, max_model_len=1024, max_prefill_chunk=48)
    return EngineConfig(**{**base, **kw})


def session(engine, prompt, turns=10, salt="", noise=False):
    """Multi-turn replay: each prompt = the conversation so far + a new message -> (outputs, cached).
    With `noise`, an unrelated 100-token request runs between turns (pressure on the page pool)."""
    convo, outs, cached = [], [], []
    for t in range(turns):
        if noise:
            outs.append(engine.generate([prompt(100, 500 + t)], PARAMS)[0].output)
        convo = convo + prompt(9 + 5 * t, 100 + t)
        (seq,) = engine.generate([convo], PARAMS, salt=salt)
        outs.append(seq.output)
        cached.append(seq.cached_tokens)
        convo = convo + seq.output
    return outs, cached


@pytest.mark.parametrize(
    ("page_size", "capture"),
    [(16, True), (32, True), (16, False)],
    ids=["page=unit", "page=2unit_cow", "pausing"],
)
def test_cache_on_equals_off_over_ten_turns(nano, prompt, page_size, capture):
    off, _ = session(Engine(nano, cfg(enable_prefix_cache=False)), prompt)
    on_engine = Engine(nano, cfg(page_size=page_size, capture_snapshots=capture))
    on, cached = session(on_engine, prompt)
    assert on == off
    assert cached[0] == 0 and all(c > 0 for c in cached[2:])
    m = on_engine.metrics()
    assert m["prefix_cache_hit_tokens"] / m["prefix_cache_queried_tokens"] > 0.6


@pytest.mark.parametrize("capture", [True, False], ids=["captured_in_chunk", "paused_at"])
def test_snapshot_invariant(nano, prompt, capture):
    """Every snapshot at length p equals the KDA state after exactly the first p tokens, whether the one
    before the last prompt token (144 here) is captured inside the last chunk or the prompt pauses there."""
    engine = Engine(nano, cfg(max_prefill_chunk=40, capture_snapshots=capture))
    p = prompt(150, 3)
    fed = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: fed.append([n for _, n in plan.items]) or execute(plan)
    (seq,) = engine.generate([p], SamplingParams(max_tokens=30, ignore_eos=True))
    assert fed[:5] == ([[32], [32], [32], [32], [22]] if capture else [[32], [32], [32], [32], [16]])
    tokens = seq.tokens
    snaps = list(engine.scheduler.cache.snaps.values())
    lengths = sorted(s.length for s in snaps)
    assert (150 - 1) // 16 * 16 in lengths and max(lengths) == (len(tokens) - 1) // 16 * 16  # finish snapshot
    kda_layers = [i for i in range(nano.config.num_hidden_layers) if nano.config.is_kda_layer(i)]
    for snap in snaps:
        state = ModelState.empty(nano.config)
        with torch.no_grad():
            nano(torch.tensor([tokens[: snap.length]]), state=state)
        for layer, saved in zip(kda_layers, snap.handle, strict=True):
            ref = state[layer]
            for name, got in zip(("conv_q", "conv_k", "conv_v", "recurrent"), saved, strict=True):
                torch.testing.assert_close(got, getattr(ref, name)[0], atol=1e-4, rtol=1e-4, msg=name)


def test_eviction_under_tiny_budget_is_exact(nano, prompt):
    off, _ = session(Engine(nano, cfg(enable_prefix_cache=False)), prompt, turns=6, noise=True)
    engine = Engine(nano, cfg(num_pages=13, max_model_len=208))
    engine.scheduler.cache.budget_bytes = 4 * engine.runner.snapshot_nbytes  # + few pages: constant eviction
    on, cached = session(engine, prompt, turns=6, noise=True)
    assert on == off
    cache = engine.scheduler.cache
    assert len(cache.snaps) <= 4 and any(c > 0 for c in cached)
    assert cache.evicted_pages > 0 and cache.evicted_snapshots > 0


def test_tenant_isolation(nano, prompt):
    engine = Engine(nano, cfg())
    p = prompt(100, 4)
    a1 = engine.generate([p], PARAMS, salt="key-a")[0]
    b = engine.generate([p], PARAMS, salt="key-b")[0]
    a2 = engine.generate([p], PARAMS, salt="key-a")[0]
    assert a1.cached_tokens == 0 and b.cached_tokens == 0 and a2.cached_tokens == 96
    assert a1.output == b.output == a2.output


def test_lookup_needs_mla_chain_and_snapshot():
    pool = PagePool(8)
    cache = PrefixCache(pool, unit=4, page_size=8, budget_bytes=100, per_path_cap=2)
    tokens = list(range(32))
    hs = chain_hashes(tokens, 4, "")
    assert hs == chain_hashes(tokens, 4, "") and hs != chain_hashes(tokens, 4, "salt")
    pages = [pool.allocate() for _ in range(4)]
    for i, h in enumerate(hs):
        cache.add_page(h, pages[i // 2])
    assert cache.lookup(hs, 33).length == 0  # no snapshot yet
    for length in (8, 16, 24):
        cache.add_snapshot(hs, length, f"s{length}", 10)
    assert sorted(s.length for s in cache.snaps.values()) == [16, 24]  # per-path cap drops the shallowest
    hit = cache.lookup(hs[:7], 29)
    assert hit.length == 24 and hit.snapshot == "s24" and hit.pages == pages[:3]
    assert pool.refcount[pages[0]] == 4  # owner + two unit entries + the hit's reference
    cache._drop_mla(hs[4])  # a broken chain caps the hit below the break
    assert cache.lookup(hs, 33).length == 16
    for length in (4, 12):  # budget 100 bytes / 10 each: still fine; shrink the budget
        cache.add_snapshot(hs, length, "x", 10)
    cache.budget_bytes = 10
    cache.add_snapshot(hs, 32, "s32", 10)
    assert cache.snapshot_bytes <= 10


def test_junction_snapshot_serves_branches(nano, prompt):
    """A shared prefix whose MLA pages outrun the snapshots gets a snapshot at the junction."""
    engine = Engine(nano, cfg(max_prefill_chunk=80))
    shared = prompt(200, 7)
    a = engine.generate([shared + prompt(60, 8)], PARAMS)[0]  # snapshots at chunk ends 80, 160, 240, ...
    b = engine.generate([shared + prompt(60, 9)], PARAMS)[0]  # hits 160; MLA chain reaches 192
    c = engine.generate([shared + prompt(60, 10)], PARAMS)[0]
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 160, 192)
    off = Engine(nano, cfg(enable_prefix_cache=False))
    assert c.output == off.generate([shared + prompt(60, 10)], PARAMS)[0].output
