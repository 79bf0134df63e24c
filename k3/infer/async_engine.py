"""Thread-backed asyncio front end of the Engine, for the HTTP server and the terminal chat.

One background thread owns the engine: it drains an inbox of submissions and aborts between steps and
runs `step()` while there is work, so the event loop never waits for a model step. Callers consume
`Event`s from a bounded inbox per request; events are plain copies (no shared mutable state crosses
the thread boundary) and carry only what is new: the tokens of the step and the text they complete.
An event's text holds back a trailing partial UTF-8 character and, with stop strings, the last
(longest stop - 1) characters, which a stop string may still cut; the final event carries the rest. A
reader slower than the engine never makes its inbox grow: past `INBOX_EVENTS` waiting events, each
new one is merged into the last (tokens, text and logprobs appended), so what waits is at most the
output itself. Leaving the consumer loop early (client disconnect, cancellation) or `cancel()`
aborts the request, which frees its pending place at once and its slot and pages before the next step.
`max_pending` bounds the requests in flight. A request whose own sampling or detokenizing fails ends
with an error event; the others in its batch go on (`Engine.step`). The engine thread also refreshes
a copy of the engine's counters and gauges after every drain and step, so `metrics()` never reads the
scheduler's lists while they change.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import threading
import traceback
from dataclasses import dataclass, field

from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.ops import native

INBOX_EVENTS = 64  # events waiting for one reader before new ones are merged into the last


class QueueFull(RuntimeError):
    """Too many requests in flight (the server answers 503)."""


@dataclass
class Event:
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str = ""  # the output text this event adds (the events' texts join to the final text)
    logprobs: list = field(default_factory=list)  # entries for new_tokens
    prompt_logprobs: list = field(default_factory=list)  # at finish
    cached_tokens: int = 0
    error: str | None = None


class AsyncEngine:
    def __init__(self, engine: Engine, max_pending: int = 256):
        self.engine, self.max_pending = engine, max_pending
        self._metrics = engine.metrics()
        self._subs: dict[str, tuple[asyncio.AbstractEventLoop, Inbox]] = {}
        self._sent: dict[str, int] = {}  # characters of each request's text already in an event
        self._subs_lock = threading.Lock()  # never held across a model step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._stop = False
        # the engine thread must be the process's only OpenMP master: the loading thread's pool would
        # make every barrier of the engine's thread team sleep (k3/ops/csrc/omp_pool.c)
        native.release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="k3-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def metrics(self) -> dict:
        """The engine's counters and gauges as of its last drain or step, + `pending` (requests in
        flight here: queued for the engine thread, waiting or running)."""
        with self._subs_lock:
            pending = len(self._subs)
        return {**self._metrics, "pending": pending}

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    # ---- requests (event-loop side) -----------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"areq-{next(self._ids)}"

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        salt: str = "",
        media: tuple = (),
        request_id: str | None = None,
    ):
        """Async iterator of Events for one request; raises QueueFull / ValueError before the first.
        `media`: `k3.infer.media.MediaSpan`s (image embeddings), see `Engine.add_request`.
        `request_id` (from `new_request_id`) lets another task `cancel` it."""
        self.engine.validate(prompt, media)
        loop, q = asyncio.get_running_loop(), Inbox()
        rid = request_id or self.new_request_id()
        with self._subs_lock:
            if rid in self._subs:
                raise ValueError(f"request_id {rid!r} is already in use")
            if len(self._subs) >= self.max_pending:
                raise QueueFull(f"{len(self._subs)} requests in flight (max_pending={self.max_pending})")
            self._subs[rid] = (loop, q)
        self._inbox.put(("add", rid, list(prompt), params, salt, tuple(media)))
        self._wake.set()
        finished = False
        try:
            while not finished:
                event = await q.get()
                finished = event.finished
                yield event
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._subs_lock:
            self._subs.pop(request_id, None)
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Abort a request from another task of the event loop (its client hung up): its consumer gets a
        final "abort" event now, and the engine frees its slot and pages before the next step."""
        with self._subs_lock:
            sub = self._subs.get(request_id)
        if sub is not None:
            sub[1].put_nowait(Event([], True, "abort"))
        self.abort(request_id)

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            events = self._drain()
            if self.engine.has_unfinished:
                events += self._step()
            self._metrics = self.engine.metrics()
            self._post(events)
            if not self.engine.has_unfinished and self._inbox.empty():
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    @staticmethod
    def _post(events: list) -> None:
        """Hand the events to their event loops: one wake-up per loop, not one per event."""
        by_loop: dict = {}
        for loop, q, event in events:
            by_loop.setdefault(loop, []).append((q, event))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _drain(self) -> list:
        events = []
        while True:
            try:
                kind, rid, *rest = self._inbox.get_nowait()
            except queue.Empty:
                return events
            if kind == "abort":
                self.engine.abort(rid)
                self._sent.pop(rid, None)
                continue
            with self._subs_lock:
                sub = self._subs.get(rid)
            if sub is None:  # aborted before it started
                continue
            try:
                self.engine.add_request(rest[0], rest[1], salt=rest[2], request_id=rid, media=rest[3])
            except Exception as e:  # noqa: BLE001 - this request alone fails
                events.append((*sub, Event([], True, "error", error=f"{type(e).__name__}: {e}")))
                self._forget(rid)

    def _forget(self, rid: str) -> None:
        with self._subs_lock:
            self._subs.pop(rid, None)
        self._sent.pop(rid, None)

    def _step(self) -> list:
        try:
            outs = self.engine.step()
        except Exception:  # a bug must not hang clients: fail everything in flight
            err = traceback.format_exc(limit=3)
            with self._subs_lock:
                subs, self._subs = self._subs, {}
            self._sent.clear()
            for rid in subs:
                self.engine.abort(rid)
            return [(lp, q, Event([], True, "error", error=err)) for lp, q in subs.values()]
        events = []
        for out in outs:
            s, k = out.seq, len(out.new_tokens)
            with self._subs_lock:
                sub = self._subs.get(s.request_id)
            if sub is None:
                continue
            event = Event(list(out.new_tokens), out.finished, s.finish_reason,
                          self._new_text(s, out.finished),
                          list(s.logprobs[len(s.logprobs) - k :]) if s.params.logprobs is not None else [],
                          list(s.prompt_logprobs) if out.finished else [], s.cached_tokens,
                          s.error)  # fmt: skip
            events.append((*sub, event))
            if out.finished:
                self._forget(s.request_id)
        return events

    def _new_text(self, s, finished: bool) -> str:
        """The text of `s` not yet sent that no later token can change: all of it at the end; before,
        up to its last whole character, less what a stop string may still cut."""
        sent = self._sent.get(s.request_id, 0)
        if finished:
            end = len(s.text)
        else:
            hold = max((len(x) - 1 for x in s.params.stop), default=0)
            end = max(sent, min(len(s.text), len(s.stable_text)) - hold)
        self._sent[s.request_id] = end
        return s.text[sent:end]


def _deliver(items: list) -> None:
    for q, event in items:
        q.put(event)


def merge(a: Event, b: Event) -> Event:
    """One event standing for `a` then `b`."""
    return Event(a.new_tokens + b.new_tokens, b.finished, b.finish_reason, a.text + b.text,
                 a.logprobs + b.logprobs, b.prompt_logprobs, b.cached_tokens, b.error)  # fmt: skip


class Inbox:
    """One request's events on its event loop: at most `limit` wait; a newer one is merged into the
    last (`merge`), so a slow reader holds at most its output, once. Not thread-safe: the engine
    thread hands events over with `call_soon_threadsafe`."""

    def __init__(self, limit: int = INBOX_EVENTS):
        self.limit, self._items, self._ready = limit, collections.deque(), asyncio.Event()

    def put(self, event: Event) -> None:
        if len(self._items) >= self.limit and not self._items[-1].finished:
            self._items[-1] = merge(self._items[-1], event)
        else:
            self._items.append(event)
        self._ready.set()

    put_nowait = put

    def qsize(self) -> int:
        return len(self._items)

    async def get(self) -> Event:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()
