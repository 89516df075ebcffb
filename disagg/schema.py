"""The request schema every front end shares: JSON lines and OpenAI completions.

Both turn a decoded JSON object into one checked `Request` (drafter/request.py:
the same strict checks as the Python API: no coercion) plus its stop strings.
A problem raises RequestError naming the field (`.field`, in the front end's
own spelling) and the fix.

JSON line:  {"id": str | int, "prompt": str | "tokens": [int, ...],
             "max_new_tokens": int >= 1, "temperature": number >= 0, "seed": int,
             "stop": str | [str, ...], "stop_token_ids": [int, ...], "ignore_eos": bool}
completion: {"model": str, "prompt": str | [int, ...], "max_tokens": int >= 1,
             "temperature": number >= 0, "seed": int, "stop": str | [str, ...],
             "stream": bool, "stream_options": {"include_usage": bool},
             extensions "stop_token_ids", "ignore_eos"}; OpenAI fields this server
             does not implement are accepted only at their neutral value (n = 1,
             echo = false, logprobs = null, top_p = 1, penalties = 0, ...).
"""

from __future__ import annotations

from drafter.request import Request, RequestError, SamplingParams

JSONL_FIELDS = {"id", "prompt", "tokens", "max_new_tokens", "temperature", "seed", "stop",
                "stop_token_ids", "ignore_eos"}
# OpenAI fields accepted only at a neutral value: (allowed values, what to do instead).
NEUTRAL = {"n": ((1, None), "send one request per completion"),
           "best_of": ((1, None), "send one request per completion"),
           "echo": ((False, None), "the prompt is not echoed; prepend it yourself"),
           "logprobs": ((None,), "log probabilities are not returned"),
           "top_p": ((1, 1.0, None), "use temperature"),
           "frequency_penalty": ((0, 0.0, None), "penalties are not implemented"),
           "presence_penalty": ((0, 0.0, None), "penalties are not implemented"),
           "logit_bias": ((None,), "logit bias is not implemented"),
           "suffix": ((None, ""), "suffixes are not implemented"),
           "user": (None, "")}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "seed", "stop", "stream",
                     "stream_options", "stop_token_ids", "ignore_eos", *NEUTRAL}
MAX_STOP_STRINGS = 16
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


def _stop_strings(rid: str, stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"request {rid!r}: \"stop\" must be a non-empty string or a list "
                           f"of them, got {stop!r}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"request {rid!r}: {len(stops)} stop strings; give at most "
                           f"{MAX_STOP_STRINGS}", "stop")
    return tuple(stops)


def _check_fields(rid: str, obj, allowed: set) -> None:
    if not isinstance(obj, dict):
        raise RequestError(f"request {rid!r}: a request must be a JSON object, got "
                           f"{type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise RequestError(f"request {rid!r}: unknown fields {unknown}; use {sorted(allowed)}",
                           unknown[0])


def _text_prompt(rid: str, text, tokenizer) -> list[int]:
    if not text:
        raise RequestError(f"request {rid!r}: empty prompt; give at least one character",
                           "prompt")
    try:
        return tokenizer.encode(text)
    except UnicodeEncodeError as e:   # a lone surrogate ("\\ud800") decodes from JSON
        raise RequestError(f"request {rid!r}: \"prompt\" is not valid Unicode ({e})",
                           "prompt") from None


def _make(rid: str, prompt, obj: dict, engine, max_tokens_field: str, default_max: int,
          default_temperature: float) -> Request:
    stops = obj.get("stop_token_ids", [])
    if not isinstance(stops, list):
        raise RequestError(f"request {rid!r}: \"stop_token_ids\" must be a list of token ids",
                           "stop_token_ids")
    params = SamplingParams(max_new_tokens=obj.get(max_tokens_field, default_max),
                            temperature=obj.get("temperature", default_temperature),
                            seed=obj.get("seed", 0), stop_token_ids=tuple(stops),
                            ignore_eos=obj.get("ignore_eos", False))
    for name in ("max_new_tokens", "temperature", "seed", "ignore_eos"):
        value = getattr(params, name)
        if value is None:
            field = max_tokens_field if name == "max_new_tokens" else name
            raise RequestError(f"request {rid!r}: \"{field}\" is null; leave it out for the "
                               f"default or give a value", field)
    return engine.make_request(rid, prompt, params)


def request_id_of(obj, line_no: int) -> str:
    """A JSON line's id (its line number, "line-N", when it has none)."""
    rid = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        return f"line-{line_no}"
    return str(rid)


def parse_line(obj, line_no: int, engine, tokenizer) -> tuple[Request, tuple[str, ...]]:
    """A JSON line's checked Request and stop strings."""
    rid = request_id_of(obj, line_no)
    _check_fields(rid, obj, JSONL_FIELDS)
    if ("prompt" in obj) == ("tokens" in obj):
        raise RequestError(f"request {rid!r}: give exactly one of \"prompt\" (text) and "
                           f"\"tokens\" (token ids)", "prompt")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise RequestError(f"request {rid!r}: \"prompt\" must be a string, got "
                               f"{type(obj['prompt']).__name__}; send ids as \"tokens\"",
                               "prompt")
        prompt = _text_prompt(rid, obj["prompt"], tokenizer)
    else:
        prompt = obj["tokens"]
        if not isinstance(prompt, list):
            raise RequestError(f"request {rid!r}: \"tokens\" must be a list of token ids",
                               "tokens")
    stop = _stop_strings(rid, obj.get("stop"))
    return _make(rid, prompt, obj, engine, "max_new_tokens", 64, 0.0), stop


def parse_completion(obj, rid: str, engine, tokenizer) -> tuple[Request, tuple[str, ...]]:
    """An OpenAI completion request's checked Request and stop strings (RequestError's
    `.field` uses OpenAI's names). Defaults as OpenAI's: max_tokens 16, temperature 1."""
    try:
        _check_fields(rid, obj, COMPLETION_FIELDS)
        for name, (allowed, fix) in NEUTRAL.items():
            if allowed is not None and name in obj and obj[name] not in allowed:
                raise RequestError(f"request {rid!r}: {name}={obj[name]!r} is not supported "
                                   f"({fix}); leave it out", name)
        for name in ("stream",):
            if not isinstance(obj.get(name, False), bool):
                raise RequestError(f"request {rid!r}: \"{name}\" must be true or false", name)
        options = obj.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError(f"request {rid!r}: \"stream_options\" may hold only "
                               f"\"include_usage\"", "stream_options")
        if "prompt" not in obj:
            raise RequestError(f"request {rid!r}: \"prompt\" is missing; give text or a list "
                               f"of token ids", "prompt")
        prompt = obj["prompt"]
        if isinstance(prompt, str):
            prompt = _text_prompt(rid, prompt, tokenizer)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list))
                                                         for p in prompt):
            raise RequestError(f"request {rid!r}: \"prompt\" holds {len(prompt)} prompts; "
                               f"send one prompt (text or token ids) per request", "prompt")
        elif not isinstance(prompt, list):
            raise RequestError(f"request {rid!r}: \"prompt\" must be text or a list of token "
                               f"ids, got {type(prompt).__name__}", "prompt")
        stop = _stop_strings(rid, obj.get("stop"))
        return _make(rid, prompt, obj, engine, "max_tokens", 16, 1.0), stop
    except RequestError as e:
        raise RequestError(str(e).replace("max_new_tokens", "max_tokens"),
                           OPENAI_NAMES.get(e.field, e.field)) from None
