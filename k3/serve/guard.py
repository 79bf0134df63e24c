"""Connection-level guards of `k3 serve`: how many connections it holds, how long a request may take to
arrive, and which Host names it answers.

`guarded_protocol(limits)` is uvicorn's h11 protocol with three rules added per connection:

* past `max_connections` open connections a new one is answered 503 (OpenAI error JSON naming
  `--max-connections`) and closed before anything is read from it;
* a request's line and headers must arrive within `header_timeout` seconds of the connection opening
  (or of the previous response ending), and its body within `body_timeout` seconds of its headers; past
  either the server answers 408 naming the option (or, when not one byte of a request came, just
  closes) and closes the connection, and the route reading the body sees the client gone;
* uvicorn's own keep-alive idle timeout still closes a connection that sends nothing between requests.

`RequestGuard` is the app's outermost middleware: every request passes the header-size cap (431) and the
Host check `allowed_host` (400 outside --allowed-hosts; DNS rebinding: a web page whose name resolves to
127.0.0.1 sends its own name as Host); it counts every response by route and status and turns anything
unexpected into a 500 in the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import resource
import sys
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from k3.serve.metrics import ServerMetrics
from k3.serve.protocol import error_body

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0


def _error(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()  # fmt: skip
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
            "\r\nconnection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with a connection cap and header / body deadlines (see the module doc)."""

    limits = ConnectionLimits()

    def connection_made(self, transport) -> None:
        self._timer, self._phase, self._got_bytes = None, None, False
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            cap = self.limits.max_connections
            msg = f"{len(self.connections) - 1} connections open (--max-connections {cap})"
            transport.write(_error(503, "Service Unavailable", msg))
            transport.close()
            return
        self._follow()

    def data_received(self, data: bytes) -> None:
        self._got_bytes = self._got_bytes or bool(data)
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._got_bytes = False
        self._follow()

    def connection_lost(self, exc) -> None:
        self._arm(None)
        super().connection_lost(exc)

    # ---- deadlines ------------------------------------------------------------------------------------
    def _follow(self) -> None:
        """Arm the deadline of the phase the client's side is in: headers, body, or none (the request
        has arrived; the response is under way)."""
        if self.transport is None or self.transport.is_closing():
            return self._arm(None)
        state = self.conn.their_state
        if state is h11.IDLE:
            phase = "headers"
        elif state is h11.SEND_BODY:
            phase = "body"
        else:
            phase = None
        if phase != self._phase:
            self._arm(phase)

    def _arm(self, phase: str | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        if phase is not None:
            delay = self.limits.header_timeout if phase == "headers" else self.limits.body_timeout
            self._timer = self.loop.call_later(delay, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing() or self._phase != phase:
            return
        if phase == "headers":
            if self._got_bytes and self.conn.our_state is h11.IDLE:
                limit = self.limits.header_timeout
                msg = f"request line and headers not received within {limit:g} s (--header-timeout)"
                self.transport.write(_error(408, "Request Timeout", msg))
        else:
            if self.cycle is not None and not self.cycle.response_started:
                limit = self.limits.body_timeout
                msg = f"request body not received within {limit:g} s of its headers (--body-timeout)"
                self.transport.write(_error(408, "Request Timeout", msg))
            if self.cycle is not None:  # the route waiting for the body sees the client gone
                self.cycle.disconnected = True
                self.cycle.message_event.set()
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol class bound to `limits` (uvicorn.Config(http=...) takes a class)."""
    return type("K3H11Protocol", (GuardedH11Protocol,), {"limits": limits})


def raise_open_file_limit(wanted: int) -> int:
    """Raise this process's soft limit on open files towards `wanted` (at most the hard limit), so the
    connection cap is reached before the descriptors run out -> the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def is_loopback(host: str) -> bool:
    """Whether a bind address is loopback-only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name part of a Host header value: 'a.b:8000' -> 'a.b', '[::1]:80' -> '::1' (lower case)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_hosts(bind_host: str, extra: tuple[str, ...] | list[str] | None) -> frozenset[str] | None:
    """The Host names the server answers: loopback names when bound to loopback, plus `extra`; None
    (any) when bound elsewhere without `extra`, or when `extra` holds '*'."""
    extra = tuple(h.strip().lower() for h in (extra or ()) if h.strip())
    if "*" in extra:
        return None
    if is_loopback(bind_host):
        return frozenset(LOOPBACK_HOSTS + extra)
    return frozenset(extra) if extra else None


def allowed_host(header: str | None, allowed: frozenset[str] | None) -> bool:
    """Whether a request's Host header passes (no header: HTTP/1.0, which a browser never sends)."""
    return allowed is None or header is None or host_name(header) in allowed


# ---- the ASGI guard: header size, Host, status counts, and a 500 for anything unexpected ---------------
class RequestGuard:
    """Counts every response by route and status (a client gone before any byte: 499) and turns an
    exception that escaped a route into a 500 OpenAI error (or, after the response started, a logged
    line: the stream already ended with an error event or was cut by the client)."""

    def __init__(self, app, stats: ServerMetrics, max_header_bytes: int, hosts: frozenset[str] | None = None):
        self.app, self.stats, self.max_header_bytes, self.hosts = app, stats, max_header_bytes, hosts

    async def _refuse(self, scope, send, status: int, message: str) -> None:
        error = error_body(message, "invalid_request_error", None, status)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(error).encode()})
        self.stats.count_response(scope.get("path", ""), status)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if size > self.max_header_bytes:  # h11 caps only a header block that arrives in pieces
            msg = f"request line + headers over {self.max_header_bytes} bytes (--max-header-bytes)"
            return await self._refuse(scope, send, 431, msg)
        host = next((v for k, v in scope["headers"] if k == b"host"), None)
        host = None if host is None else host.decode("latin-1")
        if not allowed_host(host, self.hosts):  # DNS rebinding: a page's own name sent to 127.0.0.1
            msg = f"Host {host[:100]!r} is not served here (--allowed-hosts)"
            return await self._refuse(scope, send, 400, msg)
        status = None

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - incl. Rust panics (a BaseException) in a tokenizer
            if status is None:
                error = error_body(f"internal error: {type(e).__name__}", "server_error", None, 500)
                body = json.dumps(error)
                status = 500
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"application/json")]})  # fmt: skip
                await send({"type": "http.response.body", "body": body.encode()})
            print(f"k3 serve: {scope.get('path')}: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            self.stats.count_response(scope.get("path", ""), 499 if status is None else status)
