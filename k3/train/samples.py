"""Does it write Python? Continuations of a few prompts and the share of their top-level blocks that parse.

`sample_texts` continues each prompt `rows` times at a low temperature, from the start of a file (EOS
first) and with the prompt's trailing space healed (its first token must start with that space, as the
BPE glues spaces to the next word). It runs every continuation through the inference engine (k3.infer:
continuous batching, the native decode step, a paged cache); `sample_texts_reference`, with the same
signature, is the eager reference (k3.model.generate, one batched forward per token). Greedy decoding
gives the same texts through both; with a temperature each draws from the same distribution, with
different random streams.

`top_level_blocks` cuts a text into module-level statements: a block starts at a line that begins in
column 0 outside any triple-quoted string, except lines that continue the block before (`else`, `elif`,
`except`, `finally`, `case`, a closing bracket, a line after a decorator, or a line inside open brackets
after one ending in a comma, an operator or an opening bracket); an unclosed bracket elsewhere does not
swallow the next statement; a last block cut off by the token limit (no end of document) is dropped, and
blocks that are only comments or blank lines are not counted.

`parse_fraction` is the share of the counted blocks that `ast.parse` accepts (each distinct block once
per sample, so repeating a line does not raise it), so 1.0 means every finished top-level statement the
model wrote is valid Python.
"""

from __future__ import annotations

import ast
import re
import warnings

import torch
from torch import nn

from k3.model.generate import generate, pick_next

PROMPTS = ("def ", "class ", "import ")
PARSE_PROMPTS = ("def ", "class ", "import ", "from ", "@", "if ")
PARSE_TOKENS = 192  # tokens per parse-check continuation
TOP_K = 40
MAX_BATCH = 64  # engine rows decoded together (the native step's rows per call)
_CONTINUES = re.compile(r"(else|elif|except|finally|case)\b|[)\]}]")
_TRIPLE = re.compile(r'"""|\'\'\'')
_OPEN_ENDS = tuple(",([{+-*/%|&=\\")  # a line ending so inside brackets goes on in the next line


def _prompt_ids(tokenizer, prompt: str) -> tuple[list[int], str]:
    """(EOS + the ids of `prompt` without its trailing whitespace, that whitespace). The EOS says "a file
    starts here", as in training. A trailing space is cut because the BPE glues spaces to the word after
    them: "def " ends in a lone-space token the model rarely saw there, so the first sampled token must
    bring the space back instead (token healing)."""
    body = prompt.rstrip()
    return [tokenizer.eos_id, *tokenizer.encode(body)], prompt[len(body) :]


def _starting_with(tokenizer, vocab_size: int, tail: str) -> torch.Tensor:
    """[V] bool: ordinary ids whose text starts with `tail` and goes on past it."""
    ok = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(tokenizer.base):
        text = tokenizer.decode([i])
        ok[i] = text.startswith(tail) and len(text) > len(tail)
    return ok


def _healed_prompts(
    model, tokenizer, prompt, rows, temperature, top_k, gen
) -> tuple[list[int], torch.Tensor]:
    """(ids of the prompt's head, [rows, T] the head plus the healed first token of every row, if any).
    The first token comes from one forward of the head, masked to the ids that start with the cut
    whitespace and picked with `gen` (`pick_next`), the same for both paths."""
    head, tail = _prompt_ids(tokenizer, prompt)
    ids = torch.tensor([head] * rows)
    if tail:
        logits = model(ids[:1]).logits[:, -1].float().expand(rows, -1)
        allowed = _starting_with(tokenizer, logits.shape[-1], tail)
        first = pick_next(logits.masked_fill(~allowed, float("-inf")), temperature, top_k, gen)
        ids = torch.cat([ids, first[:, None]], 1)
    return head, ids


def _text(tokenizer, prompt: str, new: list[int]) -> tuple[str, bool]:
    """(prompt without its trailing whitespace + the decoded new ids up to EOS, whether EOS came)."""
    finished = tokenizer.eos_id in new
    new = new[: new.index(tokenizer.eos_id)] if finished else new
    return prompt.rstrip() + tokenizer.decode(new), finished


@torch.no_grad()
def sample_texts(
    model: nn.Module,
    tokenizer,
    prompts: tuple[str, ...],
    rows: int,
    max_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
) -> list[tuple[str, bool]]:
    """`sample_texts_reference` through k3.infer's Engine: all rows of all prompts in one continuous
    batch (decode rows through the native step where the model qualifies). Each row samples with its
    own generator, seeded from `seed`, so a text does not depend on what else is in the batch."""
    from k3.infer.config import EngineConfig
    from k3.infer.engine import Engine
    from k3.infer.sequence import SamplingParams

    if max_tokens <= 0:
        return [(p.rstrip(), False) for p in prompts for _ in range(rows)]
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        heads, starts = [], []
        for prompt in prompts:
            head, ids = _healed_prompts(model, tokenizer, prompt, rows, temperature, top_k, gen)
            heads += [head] * rows
            starts += ids.tolist()
        page = 64
        longest = max(len(s) for s in starts) + max_tokens + 1
        pages = -(-longest // page)
        n = len(starts)
        config = EngineConfig(
            page_size=page,
            prefix_unit=page,
            num_pages=pages * min(n, MAX_BATCH),
            max_num_seqs=min(n, MAX_BATCH),
            max_model_len=pages * page,
            enable_prefix_cache=False,
            snapshot_budget_bytes=0,
            capture_snapshots=False,
            keep_freed_memory=False,  # process-wide: the training process's allocator stays as it was
        )
        engine = Engine(model, config, tokenizer=None, eos_token_id=tokenizer.eos_id)
        # row i's seed depends on `seed` and i alone: a text does not change with the other prompts
        seeds = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        params = [
            SamplingParams(
                max_tokens=max_tokens - (len(s) - len(h)),
                temperature=temperature,
                top_k=top_k or 0,
                seed=sd,
            )
            for s, h, sd in zip(starts, heads, seeds, strict=True)
        ]
        seqs = engine.generate(starts, params)
    finally:
        model.train(was_training)
    out = []
    for i, (seq, head) in enumerate(zip(seqs, heads, strict=True)):
        out.append(_text(tokenizer, prompts[i // rows], seq.tokens[len(head) :]))
    return out


@torch.no_grad()
def sample_texts_reference(
    model: nn.Module,
    tokenizer,
    prompts: tuple[str, ...],
    rows: int,
    max_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
) -> list[tuple[str, bool]]:
    """(text, finished) for `rows` continuations of every prompt, prompt by prompt; each text starts
    with its prompt; finished means the model ended the document (EOS) within `max_tokens` new tokens.
    Temperature 0 is greedy."""
    if max_tokens <= 0:
        return [(p.rstrip(), False) for p in prompts for _ in range(rows)]
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    out = []
    try:
        for prompt in prompts:
            head, ids = _healed_prompts(model, tokenizer, prompt, rows, temperature, top_k, gen)
            res = generate(
                model,
                ids,
                max_tokens - (ids.shape[1] - len(head)),
                temperature=temperature,
                top_k=top_k,
                eos_token_id=tokenizer.eos_id,
                generator=gen,
            )
            out += [_text(tokenizer, prompt, row[len(head) :]) for row in res.tolist()]
    finally:
        model.train(was_training)
    return out


def _bracket_delta(line: str) -> tuple[int, int]:
    """(bracket depth change, triple-quote toggles) of one line, ignoring comments and one-line strings."""
    depth, toggles, i, quote = 0, 0, 0, None
    while i < len(line):
        if line.startswith(('"""', "'''"), i):
            toggles += 1
            i += 3
            continue
        c = line[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            break
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        i += 1
    return depth, toggles


def top_level_blocks(text: str, finished: bool = True) -> list[str]:
    """Module-level statements of `text` (see the module doc); the last one is dropped unless `finished`."""
    blocks: list[list[str]] = []
    depth, in_string = 0, False
    for line in text.split("\n"):
        inside = depth > 0 and blocks and blocks[-1][-1].rstrip().endswith(_OPEN_ENDS)
        starts = (
            not in_string
            and not inside
            and line[:1] not in ("", " ", "\t")
            and not _CONTINUES.match(line)
            and not (blocks and blocks[-1][-1].startswith("@"))
        )
        if starts or not blocks:
            blocks.append([])
            depth = 0
        blocks[-1].append(line)
        if in_string:
            toggles = len(_TRIPLE.findall(line))
            in_string = toggles % 2 == 0
            continue
        d, toggles = _bracket_delta(line)
        depth += d
        in_string = toggles % 2 == 1
    if blocks and not finished:
        blocks.pop()
    return ["\n".join(b).strip("\n") + "\n" for b in blocks if _has_code(b)]


def _has_code(lines: list[str]) -> bool:
    return any(ln.strip() and not ln.strip().startswith("#") for ln in lines)


def parses(block: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences etc.: still valid syntax
        try:
            ast.parse(block)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return False
    return True


def parse_fraction(samples: list[tuple[str, bool]]) -> tuple[float, int, int]:
    """(parsed / counted, parsed, counted) over the distinct top-level blocks of each (text, finished)
    sample: a block the model repeats ("import sys" thirty times) counts once per sample."""
    blocks = [b for text, finished in samples for b in dict.fromkeys(top_level_blocks(text, finished))]
    ok = sum(parses(b) for b in blocks)
    return (ok / len(blocks) if blocks else 0.0), ok, len(blocks)
