"""OpenAI-compatible HTTP front end over a ServingLoop (starlette + uvicorn, Prometheus).

    POST /v1/completions        OpenAI completions; "stream": true answers with server-sent
                                events
    POST /v1/chat/completions   OpenAI chat completions, the messages rendered by the
                                checkpoint's chat template (none: 400, never an invented one);
                                streamed likewise
    POST /tokenize              {"prompt": text} or {"messages": [...]} -> {"tokens", "count",
                                "max_model_len"} (as vLLM answers)
    POST /detokenize            {"tokens": [ids]} -> {"prompt": text}
    GET  /v1/models             the one model served (with its max_model_len, as vLLM)
    GET  /health                200 {"status": "ready"} once compiled; 503 {"status": "starting"},
                                or {"status": "unavailable", "reason"} while a context worker
                                in another process cannot be reached or is silent
    GET  /metrics               Prometheus text format (disagg/metrics.py)

Rules:
  * the HTTP server runs on its own thread and asyncio loop and never touches
    the engine: requests go through `ServingLoop.submit`, one engine request per
    choice (prompts x `n`); their Events come back through `call_soon_threadsafe`
    onto the HTTP request's own asyncio queue;
  * a bad request gets HTTP 400 with an OpenAI error body {"error": {"message",
    "type": "invalid_request_error", "param", "code"}} naming the field and the
    fix, and touches nothing else; so does a max_tokens that does not fit;
  * a request without max_tokens gets `default_max_tokens`, at most the room its
    prompt leaves (disagg/schema.py);
  * a client that goes away mid-request, streamed or not, cancels it (its pages
    are freed); so does a choice that fails to the rest of its request;
  * a request whose KV could not come (`Result.retryable`) gets HTTP 503, another
    fault of the server's 500;
  * a body larger than a batch of prompts within max_seq_len needs gets HTTP 413, and
    prompts are parsed off the event loop, so one large request stalls no stream;
  * every wait for a request's next Event is bounded by `request_timeout_s`
    (then the request is cancelled: 504, or an error event when streaming);
  * the response's `usage` counts each prompt once and every choice's completion
    tokens; extensions: "acceptance_length" (tokens kept per decode step over every
    choice's steps, 1..block size; higher is better) and each choice's "token_ids";
  * a streamed answer ends with `data: [DONE]`; a chunk holds one choice; a chat
    choice's first chunk carries the role, its last one the finish_reason (with an
    empty delta).

starlette, uvicorn and prometheus-client are imported when a server is made;
a missing one is named with the command that installs it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

from disagg.chat_schema import parse_chat
from disagg.http_thread import require_http
from disagg.loop import Event, ServingClosed, ServingLoop, Submission
from disagg.metrics import ServingMetrics
from disagg.responses import (ChatFormat, CompletionFormat, error_body, pooled_acceptance,
                              usage)
from disagg.schema import (DEFAULT_MAX_TOKENS, DEFAULT_REQUEST_TIMEOUT_S, MAX_CHOICES,
                           parse_completion)
from disagg.tokenize_schema import parse_detokenize, parse_tokenize
from drafter.request import RequestError
from unified_kv import AdmissionError

log = logging.getLogger(__name__)
PATHS = ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
         "POST /detokenize", "GET /v1/models", "GET /health", "GET /metrics")


async def _disconnect(request) -> None:
    """Returns once the client has disconnected (its body was read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def failure_status(event) -> int:
    """The HTTP status of a request that failed: 503 when the failure passes (its KV did
    not come: `Result.retryable`; sent again it may be served), 500 for another fault of
    the server's, 400 for the request's own."""
    if event.result is not None and event.result.retryable:
        return 503
    return 500 if event.result is not None or event.server_fault else 400


async def _http_error(request, exc):
    """Starlette's own refusals (no such path, a method the path does not take) in
    OpenAI's error shape, as every other answer here."""
    allowed = (exc.headers or {}).get("Allow")
    fix = (f"; use {allowed}" if allowed else f"; the paths are {', '.join(PATHS)}"
           if exc.status_code == 404 else "")
    return _refuse(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}{fix}",
                   None, "not_found_error" if exc.status_code == 404 else
                   "invalid_request_error")


async def _server_error(request, exc):
    log.exception("an HTTP handler failed")
    return _refuse(500, f"internal error: {type(exc).__name__}: {exc}; the server log has the "
                        f"traceback; please report it", None, "server_error")


def _refuse(status, message, param=None, kind="invalid_request_error"):
    from starlette.responses import Response
    # ASCII JSON: a field name may hold a lone surrogate, which UTF-8 cannot carry
    return Response(json.dumps(error_body(message, param, kind)), status_code=status,
                    media_type="application/json")


class CompletionsApp:
    """The starlette app of one served model (`app`), and whether it is ready."""

    def __init__(self, loop: ServingLoop, metrics: ServingMetrics, model_name: str, *,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS):
        require_http()
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        self.loop, self.metrics, self.model_name = loop, metrics, model_name
        self.request_timeout_s, self.default_max_tokens = request_timeout_s, default_max_tokens
        # Room for a batch of MAX_CHOICES prompts that each fit max_seq_len, as text (a
        # token takes a few bytes) or as ids, and no more: parsing is the server's work,
        # whoever sends the bytes.
        self.max_body_bytes = max(1 << 20, 32 * MAX_CHOICES * loop.engine.spec.max_seq_len)
        self.ready = threading.Event()
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_page, methods=["GET"]),
        ], exception_handlers={HTTPException: _http_error, Exception: _server_error})

    # ----------------------------------------------------------- routes

    async def health(self, request):
        from starlette.responses import JSONResponse
        if self.loop.closed:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if not self.ready.is_set():
            return JSONResponse({"status": "starting"}, status_code=503)
        if (reason := self.loop.unavailable) is not None:   # a peer down: send elsewhere
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "model": self.model_name})

    async def models(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created,
             "owned_by": "unified-kv-dflash",
             "max_model_len": self.loop.engine.spec.max_seq_len}]})

    async def metrics_page(self, request):
        from starlette.responses import Response
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    async def completions(self, request):
        return await self._serve(
            request, CompletionFormat(self.loop.tokenizer), lambda body, rid: parse_completion(
                body, rid, self.loop.engine, self.loop.tokenizer,
                default_max_tokens=self.default_max_tokens))

    async def chat_completions(self, request):
        return await self._serve(
            request, ChatFormat(self.loop.tokenizer), lambda body, rid: parse_chat(
                body, rid, self.loop.engine, self.loop.tokenizer, self.model_name,
                default_max_tokens=self.default_max_tokens))

    async def tokenize(self, request):
        def answer(body, rid):
            ids = parse_tokenize(body, rid, self.loop.tokenizer, self.model_name)
            return {"tokens": ids, "count": len(ids),
                    "max_model_len": self.loop.engine.spec.max_seq_len}
        return await self._answer(request, "tok", answer)

    async def detokenize(self, request):
        def answer(body, rid):
            ids = parse_detokenize(body, rid, self.loop.engine.cfg.target.vocab_size)
            return {"prompt": self.loop.tokenizer.decode(ids)}
        return await self._answer(request, "detok", answer)

    # --------------------------------------------------------- internals

    async def _body(self, request):
        """(the request's JSON body, None) or (None, the refusal to answer with)."""
        # A body past the bound is read to its end (so the client, still sending, gets
        # the 413 rather than a reset connection) but held only up to the bound.
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= self.max_body_bytes:
                chunks.append(chunk)
        if size > self.max_body_bytes:
            return None, _refuse(413, f"the request body is {size:,} bytes, over this "
                                      f"server's {self.max_body_bytes:,} ({MAX_CHOICES} "
                                      f"prompts of up to max_seq_len="
                                      f"{self.loop.engine.spec.max_seq_len} tokens); send "
                                      f"fewer or shorter prompts a request")
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            return None, _refuse(400, f"the request body is not JSON ({e}); send a JSON object")
        model = body.get("model") if isinstance(body, dict) else None
        if model is not None and not isinstance(model, str):
            return None, _refuse(400, f"\"model\" must be a string, got {model!r}"[:300]
                                      + f"; use {self.model_name!r}", "model")
        if model is not None and model != self.model_name:
            return None, _refuse(404, f"model {model!r} is not served here; use "
                                      f"{self.model_name!r} (GET /v1/models)", "model",
                                 "not_found_error")
        return body, None

    async def _answer(self, request, prefix: str, answer):
        """A JSON answer made off the event loop by answer(body, rid) (tokenizing takes a
        while); RequestError -> 400 naming the field."""
        from starlette.responses import JSONResponse
        body, refusal = await self._body(request)
        if refusal is not None:
            return refusal
        rid = f"{prefix}-{uuid.uuid4().hex}"
        try:
            out = await asyncio.get_running_loop().run_in_executor(None, answer, body, rid)
        except RequestError as e:
            return _refuse(400, str(e), e.field)
        return JSONResponse(out)

    async def _serve(self, request, fmt: CompletionFormat, parse):
        """Parse, check, submit every choice; answer whole or as server-sent events in
        `fmt`."""
        from starlette.responses import StreamingResponse
        rid = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        body, refusal = await self._body(request)
        if refusal is not None:
            return refusal
        aio = asyncio.get_running_loop()
        try:   # tokenizing a long prompt takes a while: off the loop, so streams flow on
            subs = await aio.run_in_executor(None, self._parse_and_check, parse, body, rid)
        except RequestError as e:
            return _refuse(400, str(e), e.field)
        except AdmissionError as e:  # named in the request's own spelling
            field = "max_completion_tokens" if "max_completion_tokens" in body else \
                "max_tokens"
            return _refuse(400, str(e).replace("max_new_tokens", field), field)
        fmt.prepare(body, [req for req, _ in subs])
        choices = _Choices(self.loop, [req.request_id for req, _ in subs], body.get("n") or 1)
        try:
            for i, (req, stops) in enumerate(subs):
                self.loop.submit(Submission(req, choices.sink(aio, i), stops))
                choices.open.add(i)
        except ServingClosed as e:
            choices.cancel_open()
            return _refuse(503, str(e), None, "server_error")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if body.get("stream", False):
            return StreamingResponse(self._stream(rid, fmt, choices, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(rid, fmt, choices, request)

    def _parse_and_check(self, parse, body, rid):
        subs = parse(body, rid)
        for req, _ in subs:
            self.loop.engine.scheduler.check_fits(req)
        return subs

    async def _next(self, choices: "_Choices") -> tuple[int, Event]:
        """The next (choice index, Event); on timeout every open choice is cancelled."""
        try:
            i, event = await asyncio.wait_for(choices.events.get(), self.request_timeout_s)
        except asyncio.TimeoutError:
            choices.cancel_open()
            raise
        if event.finish_reason is not None:
            choices.open.discard(i)
        return i, event

    def _envelope(self, rid: str, obj: str, choices: list, **extra) -> dict:
        return {"id": rid, "object": obj, "created": int(time.time()),
                "model": self.model_name, "choices": choices, **extra}

    async def _whole(self, rid: str, fmt: CompletionFormat, choices: "_Choices", request):
        from starlette.responses import JSONResponse
        # The events are collected in one task raced against the client's disconnect, which
        # no event would tell (a stream notices it at its next write).
        collect = asyncio.ensure_future(self._collect(choices))
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return _refuse(499, f"request {rid!r}: the client went away; it was cancelled")
            try:
                pieces, last = collect.result()
            except asyncio.TimeoutError:
                return _refuse(504, f"request {rid!r}: no progress within "
                                    f"{self.request_timeout_s:g}s; it was cancelled", None,
                               "timeout_error")
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
            choices.cancel_open()   # the rest of a request with a failed choice too
        failed = [e for e in last.values() if e.failed]
        if failed:
            status = failure_status(failed[0])
            return _refuse(status, failed[0].error, None,
                           "server_error" if status >= 500 else "invalid_request_error")
        out = [fmt.choice(i, "".join(pieces[i]), last[i].finish_reason, last[i].result.tokens,
                          whole=True, logprobs=last[i].result.logprobs,
                          prompt_logprobs=last[i].result.prompt_logprobs)
               for i in range(len(choices.ids))]
        results = [fmt.reported(last[i].result) for i in range(len(choices.ids))]
        return JSONResponse(self._envelope(rid, fmt.whole_object, out,
                                           usage=usage(results, choices.n),
                                           acceptance_length=pooled_acceptance(results)))

    async def _collect(self, choices: "_Choices") -> tuple[dict, dict]:
        """({index: every Event's text}, {index: its last Event}) of a request answered
        whole: until every choice ends, or one fails."""
        pieces: dict = {i: [] for i in range(len(choices.ids))}
        last: dict = {}
        while len(last) < len(choices.ids):
            i, event = await self._next(choices)
            pieces[i].append(event.text)
            if event.finish_reason is not None:
                last[i] = event
                if event.failed:
                    break
        return pieces, last

    async def _stream(self, rid: str, fmt: CompletionFormat, choices: "_Choices",
                      include_usage: bool):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        results: dict = {}
        total = len(choices.ids)
        try:
            for i in range(total):
                for choice in fmt.head(i):
                    yield sse(self._envelope(rid, fmt.chunk_object, [choice]))
            while len(results) < total:
                try:
                    i, event = await self._next(choices)
                except asyncio.TimeoutError:
                    yield sse(error_body(f"request {rid!r}: no progress within "
                                         f"{self.request_timeout_s:g}s; it was cancelled",
                                         None, "timeout_error"))
                    break
                if event.failed:
                    yield sse(error_body(event.error, None, "server_error"))
                    break
                for choice, extra in fmt.pieces(i, event):
                    yield sse(self._envelope(rid, fmt.chunk_object, [choice], **extra))
                if event.finish_reason is not None:
                    results[i] = fmt.reported(event.result)
            if len(results) == total and include_usage:
                yield sse(self._envelope(rid, fmt.chunk_object, [], usage=usage(
                    [results[i] for i in range(total)], choices.n)))
            yield "data: [DONE]\n\n"
        finally:   # a client gone, a timeout or a failed choice: free the rest
            choices.cancel_open()


class _Choices:
    """The engine requests answering one HTTP request, by choice index (prompt-major, `n`
    per prompt), and the queue their Events arrive on as (index, Event)."""

    def __init__(self, loop: ServingLoop, ids: list[str], n: int):
        self.loop, self.ids, self.n = loop, ids, n
        self.events: asyncio.Queue = asyncio.Queue()
        self.open: set[int] = set()   # submitted and not yet ended

    def sink(self, aio, index: int):
        def put(event: Event) -> None:  # on the engine's thread
            aio.call_soon_threadsafe(self.events.put_nowait, (index, event))
        return put

    def cancel_open(self) -> None:
        for i in sorted(self.open):
            self.loop.cancel(self.ids[i])
        self.open.clear()
