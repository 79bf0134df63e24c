"""API keys: the `api_key` dependency of every route but /health, and the prefix-cache salt of a tenant.

With `--api-key` (one or more) a request needs `Authorization: Bearer KEY`, compared in constant time
with every key (401 with `WWW-Authenticate`); the key it gave is its tenant."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from k3.serve.errors import APIError


def check_key(header: str, api_keys: tuple[str, ...]) -> str:
    """The bearer key of an Authorization header value, checked against every server key in constant
    time (when the server has keys) -> the key (the tenant)."""
    key = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if api_keys:
        # header text is latin-1 (HTTP bytes); compare the bytes the client sent with each key's UTF-8
        given, found = key.encode("latin-1", "replace"), False
        for k in api_keys:  # all of them, whatever matches: the time says nothing about which
            found |= hmac.compare_digest(given, k.encode("utf-8", "surrogateescape"))
        if not found:
            challenge = {"WWW-Authenticate": "Bearer"}
            raise APIError(401, "invalid or missing API key", "authentication_error", headers=challenge)
    return key


async def api_key(request: Request) -> str:
    """The route dependency: the request's checked key (the app's keys in `app.state.api_keys`)."""
    return check_key(request.headers.get("authorization", ""), request.app.state.api_keys)


def salt(key: str, cache_salt: str | None) -> str:
    """The prefix-cache salt of a request: its API key and its `cache_salt` (each part length-prefixed,
    so no two pairs give one salt), hashed."""
    parts = f"{len(key)}:{key}|{len(cache_salt or '')}:{cache_salt or ''}"
    return hashlib.sha256(parts.encode("utf-8", "surrogateescape")).hexdigest()
