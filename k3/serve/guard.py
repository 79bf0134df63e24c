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

`allowed_host` is the Host check the app applies to every request (DNS rebinding: a web page whose
name resolves to 127.0.0.1 sends its own name as Host).
"""

from __future__ import annotations

import ipaddress
import json
import resource
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

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
