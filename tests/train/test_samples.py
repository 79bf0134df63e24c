"""Top-level blocks of sampled text, the parse fraction, the spike ratio and the evaluation points."""

from k3.train.metrics import ema, spike_ratio
from k3.train.samples import parse_fraction, parses, top_level_blocks
from k3.train.trainer import eval_steps

TEXT = '''"""Module doc.

Text in column 0 inside the docstring.
"""
import os
x = foo(1,
2)
@deco
def f(a):
    if a:
        return 1
    return 2
try:
    pass
except ValueError:
    pass
# a comment alone is not a block

class A(B:
    pass
def g(
'''


def test_blocks_follow_python_statements():
    blocks = top_level_blocks(TEXT, finished=False)
    assert [b.split("\n")[0] for b in blocks] == ['"""Module doc.', "import os", "x = foo(1,", "@deco",
                                                   "try:", "class A(B:"]  # fmt: skip
    assert blocks[3].count("\n") == 5 and "except ValueError" in blocks[4]
    assert top_level_blocks(TEXT, finished=True)[-1].startswith("def g(")  # kept when the text ended


def test_parse_fraction_counts_broken_blocks():
    frac, ok, n = parse_fraction([(TEXT, False)])
    assert (ok, n) == (5, 6) and frac == 5 / 6  # only `class A(B:` fails; the cut-off `def g(` is dropped
    assert parse_fraction([("def f(:\n    pass\n", True)]) == (0.0, 0, 1)
    assert parse_fraction([("# nothing\n", True)]) == (0.0, 0, 0)
    assert parses("x = '\\d'\n") and not parses("x = = 1\n")


def test_spike_ratio_and_ema():
    assert spike_ratio([5.0, 4.0, 3.0, 2.0], warmup=1) == 1.0
    assert spike_ratio([5.0, 2.0, 3.5, 2.5], warmup=2) == 1.75
    assert spike_ratio([9.0, 2.0, float("nan"), 2.2], warmup=1) == 1.1
    assert ema([2.0, 2.0, 2.0]) == [2.0, 2.0, 2.0]


def test_eval_steps_are_inside_the_run():
    assert eval_steps(100) == {20, 40, 60, 80}
    assert eval_steps(3) <= {1, 2} and eval_steps(1) == set()


def test_sample_texts_start_at_a_file_and_heal_the_prompt_space(make_tc):
    """Every text starts with its prompt; after "def " the first token brings the space back with a word
    (never a lone space), and the generation starts from EOS (the start of a file)."""
    import torch

    from k3.train.samples import _prompt_ids, _starting_with, sample_texts, sample_texts_reference
    from k3.train.trainer import Trainer

    trainer = Trainer(make_tc(steps=1), quiet=True)
    tok = trainer.tokenizer
    head, tail = _prompt_ids(tok, "def ")
    assert head[0] == tok.eos_id and tail == " " and tok.decode(head[1:]) == "def"
    allowed = _starting_with(tok, tok.vocab_size, " ")
    texts = [tok.decode([i]) for i in torch.nonzero(allowed).flatten().tolist()]
    assert texts and all(t.startswith(" ") and len(t) > 1 for t in texts)
    assert not allowed[tok.encode(" ")[0]] and not allowed[tok.eos_id]
    for fn in (sample_texts, sample_texts_reference):
        out = fn(trainer.model, tok, ("def ", "x = "), 3, 6, 0.8, 40, seed=0)
        assert len(out) == 6
        for (text, _finished), prompt in zip(out, ["def "] * 3 + ["x = "] * 3, strict=True):
            assert text.startswith(prompt) and len(text) > len(prompt)
        assert (
            fn(trainer.model, tok, ("def ",), 2, 6, 0.0, None, 0)[0]
            == fn(trainer.model, tok, ("def ",), 2, 6, 0.0, None, 1)[0]
        )  # greedy: the seed does not matter
        assert torch.is_grad_enabled() and trainer.model.training  # restored


def test_engine_samples_equal_the_reference_greedy(make_tc):
    """Greedy continuations through the engine (paged cache, native decode step, continuous batching of
    every row) are the eager reference's, token for token, and both end at the same EOS; with a
    temperature the engine's texts are reproducible from the seed and independent of the batch."""
    from k3.train.samples import PARSE_PROMPTS, sample_texts, sample_texts_reference
    from k3.train.trainer import Trainer

    trainer = Trainer(make_tc(steps=6, lr=0.02, adamw_lr=0.03), quiet=True)
    trainer._loop()
    model, tok = trainer.model, trainer.tokenizer
    ref = sample_texts_reference(model, tok, PARSE_PROMPTS, 2, 40, 0.0, None, 0)
    fast = sample_texts(model, tok, PARSE_PROMPTS, 2, 40, 0.0, None, 0)
    assert fast == ref
    assert len({text for text, _ in ref}) > 1  # the prompts lead to different texts
    a = sample_texts(model, tok, ("def ", "class "), 3, 24, 0.8, 40, 5)
    b = sample_texts(model, tok, ("def ", "class ", "import "), 3, 24, 0.8, 40, 5)
    assert a == b[:6] and a == sample_texts(model, tok, ("def ", "class "), 3, 24, 0.8, 40, 5)
    assert sample_texts(model, tok, ("def ",), 2, 0, 0.5, 40, 0) == [("def", False)] * 2
