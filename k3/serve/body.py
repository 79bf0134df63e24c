"""A request body on its way in: the Content-Type, the size cap applied while it streams in, strict JSON.

Every POST must say Content-Type application/json (415; none is refused too, so a web page cannot post
cross-site without a CORS preflight); its body is read with a size cap applied as it arrives (413
before the rest arrives), then -- in the server's worker threads, never on the event loop -- decoded as
UTF-8 (400) and parsed as strict JSON (400: no NaN, no lone surrogates, at most --max-json-depth deep).
"""

from __future__ import annotations

import json
import re

from fastapi import Request

from k3.serve.errors import APIError

JSON_TYPES = ("application/json",)


def check_content_type(request: Request) -> None:
    ctype = request.headers.get("content-type")
    if ctype is None or ctype.split(";")[0].strip().lower() not in JSON_TYPES:
        # a browser sends a cross-site POST without a CORS preflight only as text/plain, a form or with
        # no Content-Type: refusing all but application/json keeps web pages out
        raise APIError(415, f"Content-Type must be application/json, got {ctype!r}")


async def read_body(request: Request, cap: int) -> bytes:
    """The body, refused with 413 as soon as it passes `cap` bytes (a chunked body has no length)."""
    too_big = APIError(
        413, f"request body over {cap} bytes (--max-body-bytes)", headers={"Connection": "close"}
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes, max_depth: int = 64, before_walk=None) -> dict:
    """Strict JSON: UTF-8, no NaN / Infinity, no lone surrogate escapes, an object at the top, arrays and
    objects nested at most `max_depth` deep. `beforewalk(data)` checks what it can before the walk."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8") from None
    except RecursionError:  # deeper than the decoder's own limit (~1,000)
        raise APIError(400, _too_deep(max_depth)) from None
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise APIError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    if before_walk is not None:
        before_walk(data)
    # valid UTF-8 holds no surrogate: only a \uD800-\uDFFF escape can make one
    too_deep, bad = walk(data, max_depth, _SURROGATE_ESCAPE.search(raw) is not None)
    if too_deep:
        raise APIError(400, _too_deep(max_depth))
    if bad is not None:
        raise APIError(400, f"{bad or 'body'}: a lone UTF-16 surrogate is not valid Unicode", param=bad)
    return data


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _too_deep(max_depth: int) -> str:
    return f"request body nests arrays / objects over {max_depth} deep (--max-json-depth)"


def walk(data, max_depth: int, strings: bool = True) -> tuple[bool, str | None]:
    """One pass without recursion -> (nested over max_depth?, the path of the first string (key or
    value) holding a lone surrogate, else None); `strings=False` checks the nesting alone."""
    first_bad = None
    stack = [(data, "", 1)]
    while stack:
        obj, path, depth = stack.pop()
        if isinstance(obj, str):
            if first_bad is None and not _valid_unicode(obj):
                first_bad = path
            continue
        if not isinstance(obj, dict | list):
            continue
        if depth > max_depth:
            return True, None
        values = obj.values() if isinstance(obj, dict) else obj
        if not strings:  # containers only: a list of 250,000 strings costs one pass in C
            stack += [(v, "", depth + 1) for v in values if isinstance(v, dict | list)]
            continue
        items = list(obj.items()) if isinstance(obj, dict) else [(str(i), v) for i, v in enumerate(obj)]
        for k, v in reversed(items):  # reversed: the stack pops them in document order
            name = str(k).encode("utf-8", "backslashreplace").decode()  # printable in the error message
            sub = f"{path}.{name}" if path else name
            stack.append((v, sub, depth + 1))
            if first_bad is None and not _valid_unicode(str(k)):
                stack.append((k, sub, depth + 1))
    return False, first_bad


def _valid_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
