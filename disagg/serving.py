"""Serving a stream of JSON-line requests through one engine, batched across the stream.

    reader thread: line -> parse (disagg/schema.py) -> ServingLoop.submit
    this thread:   ServingLoop.run (disagg/loop.py): requests join the running
                   batch; each finished request is written as one JSON line

One line in, exactly one line out, carrying the request's id (its line
number when it has none). A bad line gets an error line naming the problem;
it never stops the server or touches another request, an unexpected
exception while reading it (a bug) included: that is logged with its
traceback and answered as an internal error. SIGINT or SIGTERM
stops the reading: every line already read is served to its end, then the
server returns. The line schema is `disagg.schema.parse_line`'s.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading

from disagg.loop import Event, ServingClosed, ServingLoop, Submission, internal_error
from disagg.schema import parse_line, request_id_of
from drafter.engine import Engine
from drafter.request import RequestError
from unified_kv import AdmissionError

__all__ = ["serve_json_lines", "answer_of", "install_drain_handlers"]
log = logging.getLogger(__name__)


def answer_of(event: Event, text: str) -> dict:
    """The JSON line for a request's last Event; `text` is its whole output text."""
    if event.result is None:
        return {"id": event.request_id, "error": event.error}
    r = event.result
    answer = {"id": r.request_id, "tokens": r.tokens, "text": text,
              "finish_reason": r.finish_reason, "acceptance_length": r.acceptance_length,
              "usage": {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens)},
              "time_to_first_token_s": r.time_to_first_token_s,
              "decode_time_s": r.decode_time_s}
    if r.logprobs is not None:
        answer["logprobs"] = [_logprob_entry(t, lp) for t, lp in zip(r.tokens, r.logprobs)]
    if r.prompt_logprobs is not None:   # the first prompt token's: null
        answer["prompt_logprobs"] = [None if lp is None else _logprob_entry(t, lp)
                                     for t, lp in zip(r.prompt, r.prompt_logprobs)]
    if r.error is not None:
        answer["error"] = r.error
        answer["retryable"] = r.retryable   # sent again, it may be served (Result)
    return answer


def _logprob_entry(token: int, lp) -> dict:
    return {"token": token, "logprob": lp.logprob, "rank": lp.rank,
            "top_logprobs": [list(x) for x in lp.top]}


def install_drain_handlers(name: str, on_stop) -> dict:
    """The first SIGINT / SIGTERM calls `on_stop` (the accepted requests finish); a second
    stops now (SystemExit 130, what is in flight is lost). On the main thread only
    (elsewhere nothing is installed). Returns the previous handlers, for `signal.signal`
    to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    signals_seen = []

    def on_signal(signum, frame) -> None:
        signals_seen.append(signum)
        if len(signals_seen) > 1:
            print(f"{name}: {signal.Signals(signum).name} again: stopping now; requests in "
                  f"flight are lost", file=sys.stderr, flush=True)
            raise SystemExit(130)
        print(f"{name}: {signal.Signals(signum).name}: finishing the requests already "
              f"accepted, then stopping (again to stop now)", file=sys.stderr, flush=True)
        on_stop()

    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def serve_json_lines(engine: Engine, path: str, tokenizer, *, out=None) -> int:
    """Serve every line of `path` ("-": stdin); returns the number of error lines."""
    out = out or sys.stdout
    source = sys.stdin.buffer if path == "-" else open(path, "rb")
    loop = ServingLoop(engine, tokenizer)
    lock = threading.Lock()
    errors = 0
    stop = threading.Event()
    busy = threading.Lock()   # held while the reader turns a line into a submission

    def write(obj) -> None:
        nonlocal errors
        with lock:
            errors += "error" in obj
            print(json.dumps(obj), file=out, flush=True)

    def sink_of_a_line():
        parts: list[str] = []   # this submission's text (ids may repeat across lines)

        def sink(event: Event) -> None:  # on the loop's thread
            parts.append(event.text)
            if event.finish_reason is not None:
                write(answer_of(event, "".join(parts)))
        return sink

    def read() -> None:
        try:
            for line_no, raw in enumerate(source, 1):
                if stop.is_set():
                    return
                if not raw.strip():
                    continue
                with busy:
                    if not serve_line(raw, line_no):
                        return
        except (OSError, ValueError):
            if not stop.is_set():  # the source closed under a stopping server: done
                raise
        finally:
            loop.close()

    def serve_line(raw: bytes, line_no: int) -> bool:
        """Submit one line, or answer it with its error; False once the server stops."""
        rid = f"line-{line_no}"
        try:
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise RequestError(f"request {rid!r}: the line is not UTF-8 ({e})")
            except (json.JSONDecodeError, RecursionError) as e:
                raise RequestError(f"request {rid!r}: not JSON ({e})")
            rid = request_id_of(obj, line_no)
            request, stops = parse_line(obj, line_no, engine, tokenizer)
            loop.submit(Submission(request, sink_of_a_line(), stops))
        except (RequestError, AdmissionError) as e:
            write({"id": rid, "error": f"{type(e).__name__}: {e}"})
        except ServingClosed as e:   # read as the server stopped: still answered
            write({"id": rid, "error": f"ServingClosed: {e}"})
            return False
        except Exception as e:  # a bug: this line fails alone, the next is served
            log.exception("request %r: unexpected failure reading its line", rid)
            write({"id": rid, "error": internal_error(rid, e)})
        return True

    def on_stop() -> None:
        stop.set()
        loop.close()

    reader = threading.Thread(target=read, name="jsonl-reader", daemon=True)
    handlers = install_drain_handlers("serve", on_stop)
    try:
        reader.start()
        loop.run()
        # A line read as the server stopped is answered before the process exits.
        if busy.acquire(timeout=60):
            busy.release()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if source is not sys.stdin.buffer:
            source.close()
    return errors
