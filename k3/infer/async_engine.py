"""Thread-backed asyncio front end of the Engine, for the HTTP server and the terminal chat.

One background thread owns the engine and runs `step()` while there is work; callers submit requests and
consume `Event`s from an asyncio queue per request. The events are plain copies (no shared mutable
state crosses the thread boundary). Leaving the consumer loop early (client disconnect, cancellation)
aborts the request, which frees its slot and pages. `max_pending` bounds running + waiting requests.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from dataclasses import dataclass, field

from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams


class QueueFull(RuntimeError):
    """Too many requests in flight (the server answers 503)."""


@dataclass
class Event:
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str = ""  # the whole output text so far (cut at a stop string)
    logprobs: list = field(default_factory=list)  # entries for new_tokens
    prompt_logprobs: list = field(default_factory=list)  # at finish
    cached_tokens: int = 0
    error: str | None = None


class AsyncEngine:
    def __init__(self, engine: Engine, max_pending: int = 256):
        self.engine, self.max_pending = engine, max_pending
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._subs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="k3-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def metrics(self) -> dict:
        with self._lock:
            return self.engine.metrics()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    # ---- requests -----------------------------------------------------------------------------------
    async def generate(self, prompt: list[int], params: SamplingParams, salt: str = ""):
        """Async iterator of Events for one request; raises QueueFull / ValueError before the first."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        with self._lock:
            if len(self._subs) >= self.max_pending:
                raise QueueFull(f"{len(self._subs)} requests in flight (max_pending={self.max_pending})")
            seq = self.engine.add_request(prompt, params, salt=salt)
            rid = seq.request_id
            self._subs[rid] = (loop, queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finished
                yield event
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._subs.pop(request_id, None)
            self.engine.abort(request_id)

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_unfinished
                events = self._step() if busy else []
            for loop, queue, event in events:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _step(self) -> list:
        try:
            outs = self.engine.step()
        except Exception:  # a bug must not hang clients: fail everything in flight
            err = traceback.format_exc(limit=3)
            events = [(lp, q, Event([], True, "error", error=err)) for lp, q in self._subs.values()]
            for rid in list(self._subs):
                self.engine.abort(rid)
            self._subs.clear()
            return events
        events = []
        for out in outs:
            sub = self._subs.get(out.seq.request_id)
            if sub is None:
                continue
            s, k = out.seq, len(out.new_tokens)
            event = Event(list(out.new_tokens), out.finished, s.finish_reason, s.text,
                          list(s.logprobs[len(s.logprobs) - k :]) if s.params.logprobs is not None else [],
                          list(s.prompt_logprobs) if out.finished else [], s.cached_tokens)  # fmt: skip
            events.append((*sub, event))
            if out.finished:
                self._subs.pop(s.request_id, None)
        return events
