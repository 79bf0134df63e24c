"""Engine fast-path details: the column-major head, and decode steps in inference mode."""

import copy

import torch

from k3.infer.config import EngineConfig
from k3.infer.engine import Engine, make_head_column_major
from k3.infer.sequence import SamplingParams


def test_head_for_gemv_keeps_values_and_parameter(nano):
    model = copy.deepcopy(nano)
    w = model.lm_head.weight
    before, h = w.detach().clone(), torch.randn(3, model.config.hidden_size)
    ref = model.lm_head(h)
    make_head_column_major(model)
    assert model.lm_head.weight is w and torch.equal(w, before)
    assert w.shape[0] < 4 * w.shape[1] or not w.is_contiguous()  # re-laid out when the head is wide
    torch.testing.assert_close(model.lm_head(h), ref)
    assert model.state_dict()["lm_head.weight"].contiguous().equal(before)


def test_decode_in_inference_mode_leaves_normal_tensors(nano, prompt):
    model = copy.deepcopy(nano)
    cfg = EngineConfig(page_size=16, num_pages=16, max_model_len=128, max_num_seqs=2, prefix_unit=16)
    engine = Engine(model, cfg)
    seqs = engine.generate([prompt(20, 0), prompt(33, 1)], SamplingParams(max_tokens=6))
    assert all(len(s.output) == 6 for s in seqs)
    pools = [t for d in engine.runner.kda.values() for t in d.values()]
    assert pools and not any(t.is_inference() for t in pools)
    # the model still trains afterwards (nothing it holds became an inference tensor)
    model.train()
    ids = torch.tensor([prompt(16, 2)])
    model(ids, labels=ids).loss.backward()
    assert model.lm_head.weight.grad is not None


def test_prefill_chunks_run_the_last_ffn_only_where_a_row_samples(nano, prompt):
    """Prompt chunks before the last need no logits: the last layer's FFN does not run for them (keep=0);
    the last chunk runs it on one position, prompt logprobs on every position; outputs stay exact."""
    model = copy.deepcopy(nano)
    rows, ffn = [], model.model.layers[-1].ffn
    model.model.layers[-1].ffn = lambda x: rows.append(x.shape[1]) or ffn(x)
    cfg = EngineConfig(
        page_size=16, num_pages=16, max_model_len=128, max_num_seqs=2, prefix_unit=16,
        max_prefill_chunk=16, max_num_batched_tokens=16, enable_prefix_cache=False,
    )  # fmt: skip
    engine = Engine(model, cfg)
    p = prompt(40, 3)
    (seq,) = engine.generate([p], SamplingParams(max_tokens=1))
    assert rows == [1]  # chunks 16 + 16 + 8: only the last reaches the end and samples
    rows.clear()
    (scored,) = engine.generate([p], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert rows == [16, 16, 8] and scored.output == seq.output
    full = model(torch.tensor([p])).logits[0, -1]
    assert seq.output == [int(full.argmax())]
