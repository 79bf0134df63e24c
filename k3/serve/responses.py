"""OpenAI response bodies: chat completions, text completions, stream chunks and logprob blocks."""

from __future__ import annotations

import json

from k3.serve.protocol import now


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def token_str(tok, i: int) -> str:
    return tok.decode([i], skip_special=False)


def chat_logprobs(tok, tokens: list[int], entries: list) -> dict:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def item(i, lp):
        s = token_str(tok, i)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in top]}
               for t, (lp, top) in zip(tokens, entries, strict=False)]  # fmt: skip
    return {"content": content}


def completion_logprobs(tok, prompt: list[int], prompt_lps: list, output: list[int], out_lps: list,
                        echo: bool) -> dict:  # fmt: skip
    """Legacy completions logprobs {tokens, token_logprobs, top_logprobs, text_offset}; with echo the
    prompt tokens come first (the first has no logprob)."""
    toks, lps, tops = [], [], []
    if echo:
        toks += prompt
        lps.append(None)
        tops.append(None)
        for lp, top in prompt_lps:
            lps.append(lp)
            tops.append({token_str(tok, a): alp for a, alp in top})
    toks += output
    for lp, top in out_lps:
        lps.append(lp)
        tops.append({token_str(tok, a): alp for a, alp in top})
    strs = [token_str(tok, t) for t in toks]
    offsets, pos = [], 0
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": strs, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_response(rid: str, model: str, message: dict, finish: str, use: dict, logprobs=None) -> dict:
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model, "choices": [choice],
            "usage": use}  # fmt: skip


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None) -> dict:
    choices = (
        [] if use is not None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    )
    body = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": now(),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return body


def completion_response(rid: str, model: str, text: str, finish: str | None, use: dict | None,
                        logprobs=None) -> dict:  # fmt: skip
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
    body = {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body
