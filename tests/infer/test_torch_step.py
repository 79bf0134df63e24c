"""The engine's torch decode step (k3.infer.decode.torch_step): compiled == eager, the paged decode op,
the fallback.

One module-scoped engine pays for the compile (~25 s for k3-nano on 2 cores, once per CI run)."""

import warnings

import pytest
import torch

from k3.infer.cache.paged_mla import paged_mla_decode
from k3.infer.config import EngineConfig
from k3.infer.decode import torch_step as torch_step_mod
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.ops.mla import causal_mask, mla_attention_absorbed

# native=False: these test the torch step (the native C step is tests/infer/test_native_step.py)
CFG = dict(page_size=16, prefix_unit=16, num_pages=24, max_model_len=160, max_num_seqs=4, native=False)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def compiled(nano):
    return Engine(nano, EngineConfig(**CFG, compile=True))


def run(engine, prompts):
    return engine.generate(prompts, GREEDY)


def test_compiled_decode_equals_eager(nano, prompt, compiled):
    prompts = [prompt(37, 1)]
    eager = run(Engine(nano, EngineConfig(**CFG)), prompts)[0]
    got = run(compiled, prompts)[0]
    step = compiled.runner.decode.torch
    assert step._compiled and step.compile_seconds is not None  # it really ran compiled
    assert got.output == eager.output
    for (lp, alts), (lp_ref, alts_ref) in zip(got.logprobs, eager.logprobs, strict=True):
        assert abs(lp - lp_ref) < 1e-4
        assert [i for i, _ in alts] == [i for i, _ in alts_ref]
        assert max(abs(a - b) for (_, a), (_, b) in zip(alts, alts_ref, strict=True)) < 1e-4


def test_compiled_engine_keeps_serving_batches_and_new_prompts(nano, prompt, compiled):
    """Batch-2 decode steps run eagerly beside the compiled batch-1 graph; a second prompt of another
    length reuses the graph (static shapes: tables padded to max_model_len / page_size)."""
    prompts = [prompt(5, 2), prompt(70, 3)]
    eager = [s.output for s in run(Engine(nano, EngineConfig(**CFG)), prompts)]
    assert [s.output for s in run(compiled, prompts)] == eager
    one = run(compiled, [prompt(90, 4)])[0].output
    assert one == run(Engine(nano, EngineConfig(**CFG)), [prompt(90, 4)])[0].output


def test_failed_compile_falls_back_to_eager_with_a_warning(nano, prompt, monkeypatch):
    def broken(fn, **kw):
        def call(*a):
            raise RuntimeError("no C++ compiler")

        return call

    monkeypatch.setattr(torch_step_mod.torch, "compile", broken)
    engine = Engine(nano, EngineConfig(**CFG, compile=True))
    with pytest.warns(UserWarning, match="compiled decode disabled.*no C\\+\\+ compiler"):
        got = run(engine, [prompt(20, 5)])[0].output
    assert got == run(Engine(nano, EngineConfig(**CFG)), [prompt(20, 5)])[0].output
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once, then eager without trying again
        run(engine, [prompt(20, 6)])


@pytest.mark.parametrize("lengths", [[20], [3, 20, 33]], ids=["one", "ragged"])
def test_paged_mla_decode_equals_dense_attention(lengths):
    """The op writes each row's latent at position c_b of its pages and attends over keys 0..c_b."""
    g = torch.Generator().manual_seed(0)
    H, Dn, Dr, Dv, R, ps = 3, 8, 4, 6, 10, 4
    B = len(lengths)
    pool = torch.randn(32 * ps, R + Dr, generator=g)
    tables = torch.randperm(32, generator=g)[: B * 10].view(B, 10)  # disjoint pages per row
    q_nope, q_pe = torch.randn(B, 1, H, Dn, generator=g), torch.randn(B, 1, H, Dr, generator=g)
    new = torch.randn(B, 1, R + Dr, generator=g)
    w_uk, w_uv = torch.randn(H, Dn, R, generator=g), torch.randn(H, Dv, R, generator=g)
    rows = lambda b, n: tables[b, torch.arange(n) // ps] * ps + torch.arange(n) % ps  # noqa: E731
    before = pool.clone()
    o = paged_mla_decode(q_nope, q_pe, new, pool, tables, torch.tensor(lengths), w_uk, w_uv, 0.3, ps)
    for b, c in enumerate(lengths):
        assert torch.equal(pool[rows(b, c + 1)[-1]], new[b, 0])  # written at key c_b
        keys = pool[rows(b, c + 1)][None]
        ref = mla_attention_absorbed(
            q_nope[b : b + 1], q_pe[b : b + 1], keys[..., :R], keys[..., R:], w_uk, w_uv, 0.3,
            causal_mask(1, c + 1),
        )  # fmt: skip
        torch.testing.assert_close(o[b : b + 1], ref, rtol=1e-5, atol=1e-5)
    written = torch.zeros(pool.shape[0], dtype=torch.bool)
    for b, c in enumerate(lengths):
        written[rows(b, c + 1)[-1]] = True
    assert torch.equal(pool[~written], before[~written])  # nothing else touched


def test_serve_warm_up_compiles_and_leaves_nothing_behind(compiled, capsys):
    from k3.serve.cli import warm_up

    warm_up(compiled)
    assert "compiling the decode step: done in" in capsys.readouterr().err
    sched = compiled.scheduler
    assert not sched.running and not sched.waiting and not compiled.requests
