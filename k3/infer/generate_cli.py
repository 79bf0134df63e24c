"""`k3 generate CHECKPOINT_DIR --prompt-file F`: one completion of an arbitrarily long prompt on the engine.

The prompt file is read and tokenized in pieces of about 1 MiB, each cut just before a non-space
character that follows a newline -- a boundary no pre-token of the K3 pattern crosses, so the ids equal
tokenizing the whole text at once -- and the engine, sized for exactly this one sequence, prefills it in
chunks of `--chunk` tokens: KDA state passes from chunk to chunk, MLA attends over the paged latent
cache block by block (k3.model.mla), so memory is the weights + the MLA latent cache + one chunk's
activations (docs/long_context.md). Progress goes to stderr, the completion to stdout.
`--ids` reads whitespace-separated token ids instead of text (no tokenizer needed).
"""

from __future__ import annotations

import argparse
import sys
import time

PIECE_CHARS = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint", help="checkpoint directory (config.json, safetensors, tokenizer files) or .gguf file"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt (UTF-8 text, or token ids with --ids)")
    p.add_argument("--ids", action="store_true", help="the prompt is whitespace-separated token ids")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk: tokens per forward")
    p.add_argument("--page-size", type=int, default=64, help="MLA cache page size in tokens")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress or statistics on stderr")


def _cut(text: str) -> int:
    """Index just after the last newline that is followed by a non-space character (0: none)."""
    i = len(text) - 1
    while True:
        i = text.rfind("\n", 0, i)
        if i < 0:
            return 0
        if not text[i + 1].isspace():
            return i + 1


def read_prompt(path: str, tokenizer=None, as_ids: bool = False, piece_chars: int = PIECE_CHARS) -> list[int]:
    """Token ids of a prompt file, read in pieces of about `piece_chars` characters (module doc)."""
    ids: list[int] = []
    try:
        f = open(path, encoding="utf-8", newline="")  # noqa: SIM115 -- closed below; newlines kept as they are
    except OSError as e:
        raise ValueError(f"--prompt-file: cannot read {path!r}: {e.strerror}") from None
    with f:
        rest = ""
        while True:
            try:
                chunk = f.read(piece_chars)
            except UnicodeDecodeError as e:
                raise ValueError(f"--prompt-file: {path!r} is not UTF-8 ({e.reason})") from None
            text = rest + chunk
            if not chunk:
                ids += _encode(text, tokenizer, as_ids, path)
                return ids
            cut = max(text.rfind(c) for c in " \t\r\n") + 1 if as_ids else _cut(text)
            ids += _encode(text[:cut], tokenizer, as_ids, path)
            rest = text[cut:]


def _encode(text: str, tokenizer, as_ids: bool, path: str) -> list[int]:
    if as_ids:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise ValueError(f"--prompt-file: {path!r} must hold whitespace-separated integer ids") from None
    return tokenizer.encode(text) if text else []


def engine_config(prompt_len: int, max_tokens: int, chunk: int, page_size: int):
    """An EngineConfig sized for one sequence of prompt_len + max_tokens tokens, prefilled `chunk` at a
    time, no prefix cache (nothing to share; its snapshots would only cost memory)."""
    from k3.infer.config import EngineConfig

    if chunk < 1 or page_size < 1:
        raise ValueError(f"--chunk and --page-size must be >= 1, got {chunk} and {page_size}")
    total = prompt_len + max_tokens
    return EngineConfig(page_size=page_size, prefix_unit=page_size, num_pages=-(-total // page_size),
                        max_num_seqs=1, max_num_batched_tokens=chunk, max_prefill_chunk=chunk,
                        max_model_len=total, enable_prefix_cache=False, snapshot_budget_bytes=0)  # fmt: skip


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from k3.export.gguf_read import is_gguf, read_gguf_tokenizer
    from k3.infer.engine import Engine
    from k3.infer.sequence import SamplingParams, Status
    from k3.tokenizer import K3Tokenizer

    if args.max_tokens < 0:
        raise ValueError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    d = Path(args.checkpoint)
    if is_gguf(d):
        tok = read_gguf_tokenizer(d)
    else:
        tok = K3Tokenizer.from_dir(d) if (d / "tokenizer_config.json").exists() else None
    if tok is None and not args.ids:
        raise ValueError(f"checkpoint {args.checkpoint!r} has no tokenizer files: pass token ids with --ids")
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, file=sys.stderr, **k))
    t0 = time.perf_counter()
    if args.prompt is not None:
        prompt = _encode(args.prompt, tok, args.ids, "--prompt")
    else:
        prompt = read_prompt(args.prompt_file, tok, args.ids)
    log(f"prompt: {len(prompt)} tokens ({time.perf_counter() - t0:.1f} s to read)")
    cfg = engine_config(len(prompt), args.max_tokens, args.chunk, args.page_size)
    engine = Engine.from_checkpoint(args.checkpoint, cfg, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)  # fmt: skip
    seq = engine.add_request(prompt, params)
    t0, t_first, printed = time.perf_counter(), None, ""
    while seq.status is not Status.FINISHED:
        engine.step()
        if t_first is None:
            rate = seq.num_computed / (time.perf_counter() - t0)
            log(f"\rprefill {min(seq.num_computed, len(prompt))}/{len(prompt)} ({rate:.0f} tok/s)", end="")
        if seq.output and t_first is None:
            t_first = time.perf_counter()
            log("")
        if seq.output:
            text = " ".join(map(str, seq.output)) if args.ids or tok is None else tok.decode(seq.output)
            if not text.endswith("\ufffd") or seq.status is Status.FINISHED:  # wait for a whole character
                print(text[len(printed) :], end="", flush=True)
                printed = text
    print()
    t_end = time.perf_counter()
    t_first = t_first or t_end
    n = len(seq.output)
    log(f"prefill {len(prompt)} tokens in {t_first - t0:.2f} s ({len(prompt) / (t_first - t0):.0f} tok/s); "
        f"{n} tokens generated ({(n - 1) / max(t_end - t_first, 1e-9):.1f} tok/s after the first); "
        f"peak RSS {peak_rss_mib():.0f} MiB; finish: {seq.finish_reason}")  # fmt: skip
    return 0
