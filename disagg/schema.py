"""The request schema every front end shares: JSON lines, OpenAI completions (and the
shared checks OpenAI chat builds on: disagg/chat_schema.py).

Each turns a decoded JSON object into checked `Request`s (drafter/request.py: the
same strict checks as the Python API: no coercion) plus their stop strings: a JSON
line into one, an OpenAI request into one per choice (its prompts x `n`).
A problem raises RequestError naming the field (`.field`, in the front end's
own spelling) and the fix.

JSON line:  {"id": str | int, "prompt": str | "tokens": [int, ...],
             "max_new_tokens": int >= 1, "temperature": number >= 0, "top_p": (0, 1],
             "top_k": int >= -1, "min_p": [0, 1], "presence_penalty": [-2, 2],
             "frequency_penalty": [-2, 2], "repetition_penalty": (0, 100], "seed": int
             (absent or null: a random one), "stop": str | [str, ...] ([]: none),
             "stop_token_ids": [int, ...], "ignore_eos": bool,
             "include_stop_str_in_output": bool (the text ends with the stop string
             that ended it), "min_tokens": int in
             [0, max_new_tokens] (vLLM's: no stop before it), "prompt_logprobs": int in
             [0, 20] | null (each prompt token's, as "logprobs"), "logprobs": int in
             [0, 20] | null (each token's log-probability and this many alternatives),
             "logit_bias": {"token id": number in [-100, 100], ...} (OpenAI's form; at
             most 64), "truncate_prompt_tokens": int >= 1 (vLLM's: the prompt's last
             tokens kept)}
completion: {"model": str, "prompt": str | [int, ...] | a list of either (a batch),
             "n": int >= 1 (choices per prompt; at most MAX_CHOICES in all; sample j
             of a prompt draws with seed + j), "max_tokens": int >= 1 (0 with echo),
             "echo": bool (the prompt before the completion, with its tokens'
             log-probabilities under "logprobs"; max_tokens 0: the prompt alone),
             "temperature": number >= 0, "top_p", "presence_penalty",
             "frequency_penalty", "logit_bias", "seed": int (absent or null: random),
             "stop": str | [str, ...] ([]: none),
             "stream": bool, "stream_options": {"include_usage": bool}, "logprobs":
             int in [0, 20] | null, extensions "top_k", "min_p", "repetition_penalty",
             "min_tokens", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
             "truncate_prompt_tokens": int >= 1 (the prompt's last tokens kept),
             "prompt_logprobs": int in [0, 20] | null (vLLM's: each choice's
             "prompt_logprobs", [null, {"token id": {logprob, rank, decoded_token}}, ...])};
             OpenAI fields this server does not implement are accepted only at their
             neutral value (best_of = 1, suffix = null).
             Without "max_tokens": the server's default (`default_max_tokens`,
             `serve --default-max-tokens`), cut to the room the prompt leaves within
             max_seq_len; a "max_tokens" given that does not fit is refused.
chat:       disagg/chat_schema.py.
"""

from __future__ import annotations

import secrets

from drafter.request import Request, RequestError, SamplingParams

# Sampling fields every form takes as they are (SamplingParams checks them); null means
# the default, as in OpenAI's API.
SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "include_stop_str_in_output")
JSONL_FIELDS = {"id", "prompt", "tokens", "max_new_tokens", "temperature", "seed", "stop",
                "truncate_prompt_tokens", "stop_token_ids", "ignore_eos", "logprobs",
                "prompt_logprobs", "logit_bias", *SAMPLING_FIELDS}
# OpenAI fields accepted only at a neutral value: (allowed values, what to do instead).
NEUTRAL = {"best_of": ((1, None), "ask for n completions instead"),
           "suffix": ((None, ""), "suffixes are not implemented"),
           "user": (None, "")}
COMPLETION_FIELDS = {"model", "prompt", "n", "max_tokens", "echo", "truncate_prompt_tokens",
                     "temperature", "seed", "stop", "stream", "stream_options",
                     "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logit_bias",
                     *SAMPLING_FIELDS, *NEUTRAL}
MAX_STOP_STRINGS = 16
# A stop string's length bound: the text stream checks every tail up to it each step.
MAX_STOP_CHARS = 256
# max_tokens of an HTTP request that gives none. Every request reserves pages for its
# whole max_tokens at admission, so "the room the prompt leaves" (up to max_seq_len,
# 9216 by default) would let one such request hold about a quarter of the embedded
# pair's full-attention pool at serve's defaults, and a slot for as long. 256 answers
# a chat turn or a function body, and keeps a prompt of up to 768 tokens within the
# 1024-token windows the embedded pair was trained on. A request that wants more
# says so in max_tokens.
DEFAULT_MAX_TOKENS = 256
# Seconds an HTTP request may wait for its next tokens before it is cancelled (a 504).
DEFAULT_REQUEST_TIMEOUT_S = 600.0
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}
# Choices one HTTP request may ask for (prompts x n): each is a request of the engine's.
MAX_CHOICES = 64


def stop_strings(rid: str, stop) -> tuple[str, ...]:
    if stop is None or stop == []:   # OpenAI's and vLLM's "no stop strings" too
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"request {rid!r}: \"stop\" must be a non-empty string or a list "
                           f"of them, got {stop!r}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"request {rid!r}: {len(stops)} stop strings; give at most "
                           f"{MAX_STOP_STRINGS}", "stop")
    if (longest := max(len(s) for s in stops)) > MAX_STOP_CHARS:
        raise RequestError(f"request {rid!r}: a stop string of {longest} characters; give "
                           f"at most {MAX_STOP_CHARS} each", "stop")
    return tuple(stops)


def _logit_bias(rid: str, bias) -> tuple:
    """OpenAI's {"token id": bias} as (id, bias) pairs (JSON keys are strings: a key must
    spell a token id in decimal); SamplingParams checks ids and values."""
    if bias is None:
        return ()
    if not isinstance(bias, dict) or not all(k.isdecimal() and k.isascii() for k in bias):
        raise RequestError(f"request {rid!r}: \"logit_bias\" must map token ids (as "
                           f"decimal strings, e.g. {{\"50\": -100}}) to biases, got "
                           f"{bias!r}"[:300], "logit_bias")
    return tuple((int(k), v) for k, v in bias.items())


def check_fields(rid: str, obj, allowed: set) -> None:
    if not isinstance(obj, dict):
        raise RequestError(f"request {rid!r}: a request must be a JSON object, got "
                           f"{type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise RequestError(f"request {rid!r}: unknown fields {unknown}; use {sorted(allowed)}",
                           unknown[0])


def check_openai_options(rid: str, obj: dict, neutral: dict) -> None:
    """Neutral-only fields at their neutral value (of the same JSON type), `stream` a
    boolean, `stream_options` only {"include_usage": bool}."""
    for name, (allowed, fix) in neutral.items():
        if allowed is not None and name in obj and not any(
                type(obj[name]) is type(a) and obj[name] == a for a in allowed):
            raise RequestError(f"request {rid!r}: {name}={obj[name]!r} is not supported "
                               f"({fix}); leave it out", name)
    if not isinstance(obj.get("stream", False), bool):
        raise RequestError(f"request {rid!r}: \"stream\" must be true or false", "stream")
    if obj.get("user") is not None and not isinstance(obj["user"], str):   # OpenAI's: a string
        raise RequestError(f"request {rid!r}: \"user\" must be a string (an end user's id; "
                           f"it is not used here), got {type(obj['user']).__name__}", "user")
    if obj.get("stream_options") is not None and obj.get("stream") is not True:
        raise RequestError(f"request {rid!r}: \"stream_options\" is for streamed answers; "
                           f"give \"stream\": true, or leave it out", "stream_options")
    options = obj.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise RequestError(f"request {rid!r}: \"stream_options\" may hold only "
                           f"\"include_usage\": true or false", "stream_options")


def text_prompt(rid: str, text, tokenizer) -> list[int]:
    if not text:
        raise RequestError(f"request {rid!r}: empty prompt; give at least one character",
                           "prompt")
    try:
        return tokenizer.encode(text)
    except UnicodeEncodeError as e:   # a lone surrogate ("\\ud800") decodes from JSON
        raise RequestError(f"request {rid!r}: \"prompt\" is not valid Unicode ({e})",
                           "prompt") from None


def request_seed(obj: dict) -> int:
    """The request's "seed", or without one (absent or null, as in OpenAI's API) a fresh
    random one: unseeded samples differ from request to request, as OpenAI's and vLLM's
    do; a seed given makes a request's draws repeat."""
    seed = obj.get("seed")
    return secrets.randbits(32) if seed is None else seed


def _make(rid: str, prompt, obj: dict, engine, max_tokens_field: str, default_max: int,
          default_temperature: float) -> Request:
    stops = obj.get("stop_token_ids", [])
    if not isinstance(stops, list):
        raise RequestError(f"request {rid!r}: \"stop_token_ids\" must be a list of token ids",
                           "stop_token_ids")
    params = SamplingParams(max_new_tokens=obj.get(max_tokens_field, default_max),
                            temperature=obj.get("temperature", default_temperature),
                            seed=request_seed(obj), stop_token_ids=tuple(stops),
                            ignore_eos=obj.get("ignore_eos", False),
                            logprobs=obj.get("logprobs"),
                            prompt_logprobs=obj.get("prompt_logprobs"),
                            logit_bias=_logit_bias(rid, obj.get("logit_bias")),
                            **{name: obj[name] for name in SAMPLING_FIELDS
                               if obj.get(name) is not None})
    for name in ("max_new_tokens", "temperature", "ignore_eos"):
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
    check_fields(rid, obj, JSONL_FIELDS)
    if ("prompt" in obj) == ("tokens" in obj):
        raise RequestError(f"request {rid!r}: give exactly one of \"prompt\" (text) and "
                           f"\"tokens\" (token ids)", "prompt")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise RequestError(f"request {rid!r}: \"prompt\" must be a string, got "
                               f"{type(obj['prompt']).__name__}; send ids as \"tokens\"",
                               "prompt")
        prompt = text_prompt(rid, obj["prompt"], tokenizer)
    else:
        prompt = obj["tokens"]
        if not isinstance(prompt, list):
            raise RequestError(f"request {rid!r}: \"tokens\" must be a list of token ids",
                               "tokens")
    stop = stop_strings(rid, obj.get("stop"))
    return _make(rid, truncated_prompt(rid, prompt, obj), obj, engine, "max_new_tokens", 64,
                 0.0), stop


def _prompts(rid: str, prompt, tokenizer) -> list[list[int]]:
    """A completion's prompts: text, token ids, or OpenAI's batch form (a list of texts
    or of token-id lists)."""
    if isinstance(prompt, str):
        return [text_prompt(rid, prompt, tokenizer)]
    if not isinstance(prompt, list):
        raise RequestError(f"request {rid!r}: \"prompt\" must be text or a list of token "
                           f"ids, got {type(prompt).__name__}", "prompt")
    if not (prompt and all(isinstance(p, (str, list)) for p in prompt)):
        return [prompt]   # token ids (Request.make checks them)
    if len(prompt) > MAX_CHOICES:
        raise RequestError(f"request {rid!r}: \"prompt\" holds {len(prompt)} prompts; send "
                           f"at most {MAX_CHOICES} per request", "prompt")
    return [text_prompt(rid, p, tokenizer) if isinstance(p, str) else p for p in prompt]


def num_choices(rid: str, obj: dict, num_prompts: int) -> int:
    """`n` (completions per prompt), checked; at most MAX_CHOICES choices in all."""
    n = obj.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RequestError(f"request {rid!r}: \"n\" must be an integer >= 1, got {n!r}", "n")
    if n * num_prompts > MAX_CHOICES:
        raise RequestError(f"request {rid!r}: {num_prompts} prompt(s) x n={n} is "
                           f"{n * num_prompts} completions; ask for at most {MAX_CHOICES} per "
                           f"request", "n")
    return n


def choice_requests(rid: str, prompt, obj: dict, engine, field: str, default_max, n: int,
                    first_index: int, total: int) -> list[Request]:
    """The n Requests of one prompt, choices first_index.. of `total`: a request's only
    choice keeps the id `rid`, else choice k is f"{rid}-{k}"; sample j of a prompt draws
    with seed + j (the first sample's checks ran on the seed as given); unseeded, each
    draws its own random seed."""
    out = []
    for j in range(n):
        seeded = j and obj.get("seed") is not None
        fields = dict(obj, seed=(obj["seed"] + j) % 2**32) if seeded else obj
        out.append(_make(rid if total == 1 else f"{rid}-{first_index + j}", prompt, fields,
                         engine, field, default_max, 1.0))
    return out


def parse_completion(obj, rid: str, engine, tokenizer, *,
                     default_max_tokens: int = DEFAULT_MAX_TOKENS
                     ) -> list[tuple[Request, tuple[str, ...]]]:
    """An OpenAI completion request's checked Requests and stop strings, one per choice:
    per prompt (text, ids, or a batch of them), `n` of them (RequestError's `.field`
    uses OpenAI's names). Defaults: max_tokens `default_max_tokens`, at most the room
    the prompt leaves (`fitting_default_max`); temperature 1 (OpenAI's)."""
    try:
        check_fields(rid, obj, COMPLETION_FIELDS)
        check_openai_options(rid, obj, NEUTRAL)
        obj = _echo(rid, obj)
        if "prompt" not in obj:
            raise RequestError(f"request {rid!r}: \"prompt\" is missing; give text or a list "
                               f"of token ids", "prompt")
        prompts = [truncated_prompt(rid, p, obj)
                   for p in _prompts(rid, obj["prompt"], tokenizer)]
        n = num_choices(rid, obj, len(prompts))
        stop = stop_strings(rid, obj.get("stop"))
        out = []
        for i, prompt in enumerate(prompts):
            default_max = fitting_default_max(rid, prompt, obj, "max_tokens", engine,
                                              default_max_tokens)
            out += choice_requests(rid, prompt, obj, engine, "max_tokens", default_max, n,
                                   i * n, n * len(prompts))
        return [(req, stop) for req in out]
    except RequestError as e:
        raise RequestError(str(e).replace("max_new_tokens", "max_tokens"),
                           OPENAI_NAMES.get(e.field, e.field)) from None


def truncated_prompt(rid: str, prompt, obj: dict):
    """`prompt` cut to its last "truncate_prompt_tokens" tokens when the request gives
    that (vLLM's left truncation: a long context keeps its end), else as it is."""
    k = obj.get("truncate_prompt_tokens")
    if k is None:
        return prompt
    if type(k) is not int or k < 1:
        raise RequestError(f"request {rid!r}: \"truncate_prompt_tokens\" must be an integer "
                           f">= 1 (the prompt tokens kept, from its end), got {k!r}",
                           "truncate_prompt_tokens")
    return prompt[-k:] if isinstance(prompt, list) else prompt


def _echo(rid: str, obj: dict) -> dict:
    """OpenAI's echo: the prompt comes back before the completion, with its tokens'
    log-probabilities when "logprobs" asks (the engine's prompt_logprobs: the larger of
    the two when vLLM's "prompt_logprobs" asks too; each form keeps its own count); with
    "max_tokens": 0, the prompt alone (the engine generates one token, not reported)."""
    echo = obj.get("echo", False)
    if echo is None or echo is False:
        return obj
    if echo is not True:
        raise RequestError(f"request {rid!r}: \"echo\" must be true or false", "echo")
    if type(obj.get("max_tokens")) is int and obj["max_tokens"] == 0:
        if obj.get("min_tokens") not in (None, 0):   # the prompt alone generates nothing
            raise RequestError(f"request {rid!r}: \"min_tokens\" must be 0 with "
                               f"\"max_tokens\": 0 (the prompt alone), got "
                               f"{obj['min_tokens']!r}", "min_tokens")
        obj = dict(obj, max_tokens=1)
    echoed, asked = obj.get("logprobs"), obj.get("prompt_logprobs")
    if asked is None or (type(asked) is int and type(echoed) is int and echoed > asked):
        return dict(obj, prompt_logprobs=echoed)
    return obj   # "prompt_logprobs" covers the echo's (or is refused by its own check)


def _room(rid: str, prompt, engine, prompt_field: str) -> int:
    """The most tokens `prompt` leaves room for within the engine's max_seq_len."""
    probe = engine.make_request(rid, prompt, SamplingParams(max_new_tokens=1))
    room = engine.spec.max_seq_len - engine.scheduler.reserved_len(probe) + 1
    if room < 1:
        raise RequestError(f"request {rid!r}: the prompt is {len(probe.prompt)} tokens, which "
                           f"leaves no room for a completion within max_seq_len="
                           f"{engine.spec.max_seq_len}; shorten the prompt", prompt_field)
    return room


def fitting_default_max(rid: str, prompt, obj: dict, field: str, engine,
                        default_max_tokens: int, prompt_field: str = "prompt") -> int | None:
    """max_tokens for a request without `field`: the server's default, cut to the room
    its prompt leaves (a default never makes a request that fits fail). None when the
    request gives `field` (its own value is checked, never cut). A prompt that leaves no
    room is refused naming `prompt_field` either way: the prompt is what is long."""
    room = _room(rid, prompt, engine, prompt_field)
    return None if field in obj else min(default_max_tokens, room)
