"""A failure inside one request's own step (its sampling, its detokenizing) ends that request alone:
the other rows of the batch finish exactly as they would without it."""

import pytest

import k3.infer.engine as engine_module
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams, Status

CFG = dict(page_size=16, prefix_unit=16, num_pages=64, max_model_len=256, max_num_seqs=4)


@pytest.mark.parametrize("where", ["sample", "detokenize"])
def test_one_failing_row_leaves_its_batch_alone(nano, prompt, monkeypatch, where):
    prompts = [prompt(12, 1), prompt(20, 2), prompt(7, 3)]
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = [Engine(nano, EngineConfig(**CFG)).generate([p], greedy)[0].output for p in prompts]
    doomed = SamplingParams(max_tokens=10, ignore_eos=True, seed=13)  # the row that fails
    engine = Engine(nano, EngineConfig(**CFG))
    if where == "sample":
        real = engine_module.sample

        def sample(logits, params, generator=None):
            if params.seed == 13 and len(engine.requests) == 3:
                raise RuntimeError("invalid multinomial distribution")
            return real(logits, params, generator)

        monkeypatch.setattr(engine_module, "sample", sample)
    else:

        class Tok:
            def decode(self, ids):
                return ""

        engine.tokenizer = Tok()
        real = engine._detokenize

        def detokenize(seq):  # every row but the doomed one, whose third token fails
            if seq is seqs[1] and len(seq.output) == 3:
                raise ValueError("ids outside the vocabulary")
            return real(seq)

        monkeypatch.setattr(engine, "_detokenize", detokenize)
    seqs = [engine.add_request(p, doomed if i == 1 else greedy) for i, p in enumerate(prompts)]
    while any(s.status is not Status.FINISHED for s in seqs):
        engine.step()
    assert seqs[1].finish_reason == "error" and seqs[1].error
    assert [seqs[0].output, seqs[2].output] == [alone[0], alone[2]]
    assert [s.finish_reason for s in (seqs[0], seqs[2])] == ["length", "length"]
    m = engine.metrics()
    assert m["failed_requests"] == 1 and m["kda_slots_in_use"] == 0 and m["mla_pages_in_use"] == 0


def test_tiny_temperatures_are_greedy(nano, prompt):
    p = prompt(15, 4)
    greedy = Engine(nano, EngineConfig(**CFG)).generate([p], SamplingParams(max_tokens=8, ignore_eos=True))
    tiny = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-300, seed=1)
    assert Engine(nano, EngineConfig(**CFG)).generate([p], tiny)[0].output == greedy[0].output
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"))
