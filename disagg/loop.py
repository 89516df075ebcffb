"""One thread owns the engine; every front end (JSON lines, HTTP) talks to it through a queue.

    any thread                            the owning thread, run()
    submit(Submission) ──┐                take the queued commands: engine.submit / cancel
    cancel(request_id) ──┼──> queue ───>  engine.step()
    close()            ──┘                each open request: its newly committed tokens ->
                                          its TextStream -> sink(Event); its end -> last Event

Rules:
  * only the owning thread touches the engine once run() starts;
  * every accepted request gets exactly one last Event (`finish_reason` set),
    a refused one included; the Events before it carry each committed token
    once, in order, with the text those tokens made final;
  * a sink runs on the owning thread and must not block (hand the Event to a
    queue); a sink that raises loses its own request (cancelled), never the loop;
  * an unexpected exception at a request's submit (a bug) is logged and ends
    that request with an internal error, never the loop;
  * committed tokens are final: a running request's token list only grows,
    and the loop reads it only between steps;
  * close(): submit() refuses from then on; run() returns once every accepted
    request has ended.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Protocol

from disagg.textstream import TextStream
from drafter.engine import Engine
from drafter.request import Request, RequestError, Result
from unified_kv import AdmissionError

log = logging.getLogger(__name__)


def internal_error(request_id: str, e: BaseException) -> str:
    """The error a request gets for an unexpected exception (a bug, logged with its
    traceback): names the request and the exception."""
    return (f"internal error: {type(e).__name__}: {e} (request {request_id!r} failed "
            f"alone; the server keeps serving; the server log has the traceback, "
            f"please report it)")


class ServingClosed(RuntimeError):
    """submit() after close(): the server is shutting down; retry on another replica."""


@dataclasses.dataclass(frozen=True)
class Event:
    """Part of one request's output. The last one has `finish_reason` ("length",
    "stop" or "error"), and `result` when the request ran (tokens cut at a stop
    string) or `error` when it did not. `logprobs`: a TokenLogprobs per token of
    `tokens` when the request asked for them, else None; `prompt_logprobs`: on a
    request's first Event with tokens (or its last), its Result's prompt_logprobs when
    it asked for them, else None."""

    request_id: str
    tokens: list[int]
    text: str
    finish_reason: str | None = None
    result: Result | None = None
    error: str | None = None
    server_fault: bool = False   # the error is the server's, not the request's
    cancelled: bool = False      # ended by a cancel (its client went away, or a sibling failed)
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    @property
    def failed(self) -> bool:
        """The request's last Event, ending without an answer (an error, or it never ran)."""
        return self.finish_reason is not None and (self.result is None
                                                   or self.finish_reason == "error")


@dataclasses.dataclass(frozen=True)
class Submission:
    """A checked request, where its Events go, and its stop strings."""

    request: Request
    sink: Callable[[Event], None]
    stop: tuple[str, ...] = ()


class Observer(Protocol):
    """What the loop reports as it serves (metrics); called on the owning thread."""

    def first_token(self, seconds: float) -> None: ...
    def later_tokens(self, count: int, seconds_each: float) -> None: ...
    def finished(self, event: Event, prompt_tokens: int) -> None: ...
    def after_step(self, engine: Engine, queued: int) -> None: ...


@dataclasses.dataclass(eq=False)
class _Open:
    sub: Submission
    stream: TextStream
    submitted: float
    delivered: int = 0               # tokens handed to the stream
    last_at: float | None = None     # when tokens last arrived


_CLOSE = object()


class ServingLoop:
    """Args:
      engine: the engine this loop owns.
      tokenizer: decodes outputs (encode is the front ends' business).
      observer: optional metrics hooks.
    """

    def __init__(self, engine: Engine, tokenizer, observer: Observer | None = None):
        self.engine, self.tokenizer, self.observer = engine, tokenizer, observer
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._close_seen = False
        self._open: dict[str, _Open] = {}
        self.unavailable: str | None = None   # why requests would fail now (run() sets it)

    # ------------------------------------------------------ any thread

    def submit(self, sub: Submission) -> None:
        """Queue a request; its Events go to `sub.sink`. ServingClosed after close()."""
        with self._lock:
            if self._closed:
                raise ServingClosed(f"request {sub.request.request_id!r}: the server is "
                                    f"shutting down and takes no new requests")
            self._commands.put(("submit", sub, time.perf_counter()))

    def cancel(self, request_id: str) -> None:
        """End a request early (its client went away); its pages are freed."""
        self._commands.put(("cancel", request_id, None))

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.put(_CLOSE)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def queued(self) -> int:
        """Commands not yet taken by the loop (requests waiting to reach the engine)."""
        return self._commands.qsize()

    # ------------------------------------------------- the owning thread

    def run(self, poll_s: float = 0.05) -> None:
        """Serve until close() and every accepted request has ended. Once a second, ask
        the engine whether its KV source could serve (`unavailable`, for health checks:
        other threads read it, never the engine)."""
        engine, next_check = self.engine, 0.0
        while not (self._close_seen and not self._open and not engine.has_work):
            if (now := time.monotonic()) >= next_check:
                next_check, self.unavailable = now + 1.0, engine.kv_source_unavailable()
            self._take_commands(block_s=0.0 if engine.has_work else poll_s)
            if engine.has_work:
                try:
                    finished = engine.step()
                except Exception as e:
                    self._fail_everything(e)
                    raise
                self._deliver(finished)
            if self.observer is not None:
                self.observer.after_step(engine, self.queued + len(engine.scheduler.waiting))

    def _take_commands(self, block_s: float) -> None:
        while True:
            try:
                item = self._commands.get(timeout=block_s) if block_s else \
                    self._commands.get_nowait()
            except queue.Empty:
                return
            block_s = 0.0
            if item is _CLOSE:
                self._close_seen = True
            elif item[0] == "submit":
                self._start(item[1], item[2])
            elif (o := self._open.get(item[1])) is not None:
                result = self.engine.cancel(item[1])
                self._end(o, "error", result, f"request {item[1]!r} was cancelled",
                          cancelled=True)

    def _fail_everything(self, e: BaseException) -> None:
        """The engine failed: every request open or queued gets its last Event (an error
        naming the failure), and the loop takes no more."""
        log.exception("the engine failed; every request in flight ends with its error")
        self.close()

        def error(rid: str) -> str:
            return (f"internal error: the engine failed ({type(e).__name__}: {e}); request "
                    f"{rid!r} ended with every request in flight and the server stops; the "
                    f"server log has the traceback")
        for rid, o in list(self._open.items()):
            self._open.pop(rid)
            event = Event(rid, [], "", "error", error=error(rid), server_fault=True)
            if self.observer is not None:
                self.observer.finished(event, len(o.sub.request.prompt))
            self._send(o.sub, event)
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not _CLOSE and item[0] == "submit":
                rid = item[1].request.request_id
                self._send(item[1], Event(rid, [], "", "error", error=error(rid),
                                          server_fault=True))

    def _start(self, sub: Submission, submitted: float) -> None:
        rid = sub.request.request_id
        try:
            if rid in self._open:
                raise AdmissionError(f"request id {rid!r} is already in flight; ids must be "
                                     f"unique")
            self.engine.submit(sub.request)
        except (AdmissionError, RequestError) as e:
            self._send(sub, Event(rid, [], "", "error", error=f"{type(e).__name__}: {e}"))
            return
        except Exception as e:  # a bug: this request fails alone, the loop keeps serving
            log.exception("request %r: unexpected failure at submit", rid)
            self.engine.cancel(rid)
            self._send(sub, Event(rid, [], "", "error", error=internal_error(rid, e)))
            return
        self._open[rid] = _Open(sub, TextStream(
            self.tokenizer, sub.stop, sub.request.params.min_tokens,
            sub.request.params.include_stop_str_in_output), submitted)

    def _deliver(self, finished: list[Result]) -> None:
        now = time.perf_counter()
        ended = {r.request_id: r for r in finished}
        active = self.engine.scheduler.active
        for rid, o in list(self._open.items()):
            result = ended.get(rid)
            seq = active.get(rid)
            tokens = result.tokens if result is not None else seq.tokens if seq else None
            if tokens is None:
                continue  # waiting for admission
            logprobs = result.logprobs if result is not None else seq.logprobs
            new = tokens[o.delivered:]
            new_logprobs = (logprobs[o.delivered:len(tokens)]
                            if o.sub.request.params.logprobs is not None else None)
            prompt_logprobs = None
            if o.delivered == 0 and o.sub.request.params.prompt_logprobs is not None \
                    and (new or result is not None):   # with the first tokens, once
                prompt_logprobs = (result.prompt_logprobs if result is not None
                                   else [None, *seq.prompt_logprobs])
            if new:
                self._observe_tokens(o, len(new), now)
            o.delivered = len(tokens)
            before = len(o.stream.tokens)
            text = o.stream.feed(new)
            if o.stream.stopped:
                if result is None:
                    result = self.engine.cancel(rid)
                kept = o.stream.tokens[before:]
                self._end(o, "stop", result, None, kept, text,
                          new_logprobs and new_logprobs[:len(kept)], prompt_logprobs)
            elif result is not None:
                text += o.stream.finish()
                self._end(o, result.finish_reason, result, result.error, new, text,
                          new_logprobs, prompt_logprobs)
            elif new:
                self._send(o.sub, Event(rid, list(new), text, logprobs=new_logprobs,
                                        prompt_logprobs=prompt_logprobs))

    def _observe_tokens(self, o: _Open, count: int, now: float) -> None:
        if self.observer is not None:
            if o.last_at is None:
                self.observer.first_token(now - o.submitted)
                if count > 1:
                    self.observer.later_tokens(count - 1, 0.0)
            else:
                self.observer.later_tokens(count, (now - o.last_at) / count)
        o.last_at = now

    def _end(self, o: _Open, reason: str, result: Result | None, error: str | None,
             tokens=(), text: str = "", logprobs=None, prompt_logprobs=None,
             cancelled: bool = False) -> None:
        rid = o.sub.request.request_id
        self._open.pop(rid, None)
        if result is not None:   # cut at a stop string as the stream was
            kept = list(o.stream.tokens)
            result = dataclasses.replace(
                result, tokens=kept, finish_reason=reason, error=error,
                logprobs=None if result.logprobs is None else result.logprobs[:len(kept)])
        event = Event(rid, list(tokens), text, reason, result, error, logprobs=logprobs,
                      prompt_logprobs=prompt_logprobs, cancelled=cancelled)
        if self.observer is not None:
            self.observer.finished(event, len(o.sub.request.prompt))
        self._send(o.sub, event)

    def _send(self, sub: Submission, event: Event) -> None:
        try:
            sub.sink(event)
        except Exception:
            rid = sub.request.request_id
            log.exception("request %r: its sink failed; the request is cancelled", rid)
            if event.finish_reason is None and self._open.pop(rid, None) is not None:
                self.engine.cancel(rid)
