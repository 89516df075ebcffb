"""Serving a stream of JSON-line requests through one engine, batched across the stream.

    reader thread: lines -> queue          engine loop (this thread):
                                             take every waiting line -> parse -> submit
                                             engine.step()  (requests join the running batch)
                                             print each finished request as one JSON line

One line in, exactly one line out, carrying the request's id (its line
number when it has none). A bad line gets an error line naming the problem;
it never stops the server or touches another request. SIGINT or SIGTERM
stops the reading: every line already read is served to its end, then the
server returns.

Line schema (strict: no coercion):
    {"id": str | int, "prompt": str | "tokens": [int, ...],
     "max_new_tokens": int >= 1, "temperature": number >= 0, "seed": int,
     "stop_token_ids": [int, ...], "ignore_eos": bool}
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading

from drafter.engine import Engine
from drafter.request import Request, RequestError, SamplingParams
from unified_kv import AdmissionError

FIELDS = {"id", "prompt", "tokens", "max_new_tokens", "temperature", "seed", "stop_token_ids",
          "ignore_eos"}


def request_id_of(obj, line_no: int) -> str:
    rid = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        return f"line-{line_no}"
    return str(rid)


def parse_request(obj, line_no: int, engine: Engine, tokenizer) -> Request:
    """A checked Request from one decoded JSON value (RequestError names the problem)."""
    rid = request_id_of(obj, line_no)
    if not isinstance(obj, dict):
        raise RequestError(f"request {rid!r}: a line must be a JSON object, got "
                           f"{type(obj).__name__}")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise RequestError(f"request {rid!r}: unknown fields {unknown}; use {sorted(FIELDS)}")
    if ("prompt" in obj) == ("tokens" in obj):
        raise RequestError(f"request {rid!r}: give exactly one of \"prompt\" (text) and "
                           f"\"tokens\" (token ids)")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise RequestError(f"request {rid!r}: \"prompt\" must be a string, got "
                               f"{type(obj['prompt']).__name__}; send ids as \"tokens\"")
        if not obj["prompt"]:
            raise RequestError(f"request {rid!r}: empty prompt; give at least one character")
        prompt = tokenizer.encode(obj["prompt"])
    else:
        prompt = obj["tokens"]
        if not isinstance(prompt, list):
            raise RequestError(f"request {rid!r}: \"tokens\" must be a list of token ids")
    stops = obj.get("stop_token_ids", [])
    if not isinstance(stops, list):
        raise RequestError(f"request {rid!r}: \"stop_token_ids\" must be a list of token ids")
    params = SamplingParams(max_new_tokens=obj.get("max_new_tokens", 64),
                            temperature=obj.get("temperature", 0.0), seed=obj.get("seed", 0),
                            stop_token_ids=tuple(stops), ignore_eos=obj.get("ignore_eos", False))
    return engine.make_request(rid, prompt, params)


def _read_lines(source, lines: queue.Queue) -> None:
    try:
        for line_no, raw in enumerate(source, 1):
            lines.put((line_no, raw))
    finally:
        lines.put(None)


def _drop_unread(lines: queue.Queue, keep) -> None:
    """Put back only the lines already read (the reader's end marker is dropped):
    they are served; nothing more is read."""
    kept = []
    while True:
        try:
            item = lines.get_nowait()
        except queue.Empty:
            break
        if keep(item):
            kept.append(item)
    for item in kept:
        lines.put(item)
    lines.put(None)


def serve_json_lines(engine: Engine, path: str, tokenizer, *, out=None) -> int:
    """Serve every line of `path` ("-": stdin); returns the number of error lines."""
    out = out or sys.stdout
    source = sys.stdin.buffer if path == "-" else open(path, "rb")
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(source, lines), daemon=True)
    reader.start()
    errors, eof, done_reading = 0, False, False
    stop = threading.Event()

    def write(obj) -> None:
        print(json.dumps(obj), file=out, flush=True)

    def on_signal(signum, frame) -> None:
        print(f"serve: {signal.Signals(signum).name}: serving the lines already read, then "
              f"stopping", file=sys.stderr, flush=True)
        stop.set()

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not eof or engine.has_work:
            if stop.is_set() and not eof:
                eof = True  # stop reading; drain what was read
                _drop_unread(lines, keep=lambda item: item is not None)
            block = not engine.has_work  # idle: wait for the next line
            while not done_reading:
                try:
                    item = lines.get(timeout=0.05) if block else lines.get_nowait()
                except queue.Empty:
                    break
                block = False
                if item is None:
                    eof = done_reading = True
                    break
                line_no, raw = item
                if not raw.strip():
                    continue
                rid = f"line-{line_no}"
                try:
                    try:
                        obj = json.loads(raw.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        raise RequestError(f"request {rid!r}: the line is not UTF-8 ({e})")
                    except json.JSONDecodeError as e:
                        raise RequestError(f"request {rid!r}: not JSON ({e})")
                    rid = request_id_of(obj, line_no)
                    engine.submit(parse_request(obj, line_no, engine, tokenizer))
                except (RequestError, AdmissionError) as e:
                    errors += 1
                    write({"id": rid, "error": f"{type(e).__name__}: {e}"})
            for result in engine.step():
                if result.ok:
                    write({"id": result.request_id, "tokens": result.tokens,
                           "text": tokenizer.decode(result.tokens),
                           "finish_reason": result.finish_reason,
                           "acceptance_length": result.acceptance_length,
                           "usage": {"prompt_tokens": len(result.prompt),
                                     "completion_tokens": len(result.tokens)},
                           "time_to_first_token_s": result.time_to_first_token_s,
                           "decode_time_s": result.decode_time_s})
                else:
                    errors += 1
                    write({"id": result.request_id, "error": result.error})
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if source is not sys.stdin.buffer:
            source.close()
    return errors
