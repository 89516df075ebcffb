"""Requests and results: the one schema the Python API, JSON lines and HTTP share.

A request is a prompt of token ids plus its own sampling parameters. Values
are checked strictly (no coercion: `"3"`, `2.9` and `true` are not counts)
and every error names the request, the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# The most likely tokens a request may ask for beside each generated token (vLLM's
# default limit); the step returns this many for every token (drafter/sampling.py).
MAX_LOGPROBS = 20
# Logit bias entries a request may give (each step carries every slot's, padded to this).
MAX_LOGIT_BIAS = 64


class RequestError(ValueError):
    """A request that can never be served as given; names the field and the fix.

    `field`: the request field at fault (a SamplingParams field, "prompt" or
    "request_id"), or None when the problem is not one field's.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def _is_int_type(t: type) -> bool:
    return issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))


def _is_int(x) -> bool:
    return _is_int_type(type(x))


def _is_number(x) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Attributes:
      max_new_tokens: tokens to generate at most (the first token included).
      temperature: 0 = greedy; > 0 samples (losslessly, under speculation).
      top_p: sample from the most likely tokens whose probabilities reach top_p
        (0 < top_p <= 1; 1 = every token).
      top_k: sample from the top_k most likely tokens (0 or -1 = every token).
      min_p: sample from the tokens at least min_p x the most likely one's
        probability (0 <= min_p <= 1; 0 = every token). The three truncate the
        distribution a sampled request draws from (drafter/sampling.py, `truncate_row`);
        a greedy request (temperature 0) takes the most likely token whatever they are.
      presence_penalty: subtracted from the logit of every token the request has
        generated (-2 to 2, OpenAI's range; 0 = none).
      frequency_penalty: subtracted from a token's logit once for each time the request
        has generated it (-2 to 2; 0 = none). The two apply before temperature and
        truncation, to greedy requests too; the first token has nothing before it
        (drafter/sampling.py, `adjust`).
      repetition_penalty: vLLM's (and HF's): the logit of every token in the prompt or
        generated so far is divided by it where positive, multiplied where not (> 0,
        at most 100; 1 = none), after the logit bias and before the other two.
      logit_bias: (token id, bias) pairs added to those tokens' logits before every
        draw, greedy included (bias in [-100, 100]; -100 all but bans a token, 100
        all but forces it); at most MAX_LOGIT_BIAS of them, ids distinct. A dict
        {id: bias} is taken as its items.
      seed: the request's PRNG seed (its draws do not depend on its batch).
      stop_token_ids: generation ends after any of these (kept in the output).
      ignore_eos: keep going past the model's end-of-sequence token.
      include_stop_str_in_output: vLLM's: a text front end's output text ends with the
        stop string that ended it, rather than before it (the engine has no stop
        strings: disagg/textstream.py).
      min_tokens: vLLM's: the first min_tokens generated tokens are never a stop id or
        (unless ignore_eos) an end-of-sequence id, which are banned from those draws
        (0 <= min_tokens <= max_new_tokens; 0 = none); stop strings end a request
        only after them. The banned ids share the logit bias's MAX_LOGIT_BIAS entries.
      logprobs: None, or return each generated token's log-probability and those of
        this many most likely tokens at its position (0 to MAX_LOGPROBS), from the
        target's raw logits (before temperature and truncation): `Result.logprobs`.
      prompt_logprobs: None, or the same for each prompt token after the first, from the
        prefill's logits (vLLM's; OpenAI's echo with logprobs): `Result.prompt_logprobs`.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        # One form for every caller (a dict, or lists from JSON): pairs in a tuple. Values
        # are not converted; `validate` checks them.
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        if isinstance(bias, (list, tuple, type({}.items()))):
            bias = tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in bias)
        object.__setattr__(self, "logit_bias", bias)

    def validate(self, request_id: str, vocab_size: int) -> None:
        where = f"request {request_id!r}"
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise RequestError(f"{where}: max_new_tokens must be an integer >= 1, got "
                               f"{self.max_new_tokens!r}", "max_new_tokens")
        t = self.temperature
        if not _is_number(t) or t < 0:
            raise RequestError(f"{where}: temperature must be a finite number >= 0 "
                               f"(0 = greedy), got {t!r}", "temperature")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"{where}: top_p must be a number in (0, 1] (1 = every token), "
                               f"got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or not -1 <= self.top_k < 2**31:
            raise RequestError(f"{where}: top_k must be an integer >= 1, or 0 or -1 for every "
                               f"token, got {self.top_k!r}", "top_k")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"{where}: min_p must be a number in [0, 1] (0 = every token), "
                               f"got {self.min_p!r}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise RequestError(f"{where}: {name} must be a number in [-2, 2] (0 = none), "
                                   f"got {value!r}", name)
        r = self.repetition_penalty
        if not _is_number(r) or not 0 < r <= 100:
            raise RequestError(f"{where}: repetition_penalty must be a number in (0, 100] "
                               f"(1 = none), got {r!r}", "repetition_penalty")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise RequestError(f"{where}: seed must be an integer in [0, 2**32), got "
                               f"{self.seed!r}", "seed")
        bad = [s for s in self.stop_token_ids if not _is_int(s) or not 0 <= s < vocab_size]
        if bad:
            raise RequestError(f"{where}: stop_token_ids {bad[:5]} are not token ids in "
                               f"[0, {vocab_size})", "stop_token_ids")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{where}: {name} must be true or false, got "
                                   f"{getattr(self, name)!r}", name)
        if (not _is_int(self.min_tokens) or not 0 <= self.min_tokens
                or _is_int(self.max_new_tokens) and self.min_tokens > self.max_new_tokens):
            raise RequestError(f"{where}: min_tokens must be an integer in [0, max_new_tokens="
                               f"{self.max_new_tokens}], got {self.min_tokens!r}", "min_tokens")
        self._validate_logit_bias(where, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{where}: {name} must be an integer in [0, {MAX_LOGPROBS}] "
                                   f"(the most likely tokens returned beside each token), or "
                                   f"null for none, got {value!r}", name)

    def stop_ids(self, eos_token_ids) -> frozenset:
        """The ids that end this request: its stop ids, and the model's end-of-sequence
        ids unless it ignores them."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos
                                                 else frozenset(eos_token_ids))

    def early_bans(self, request_id: str, eos_token_ids) -> tuple[int, ...]:
        """The ids its first min_tokens tokens may not be (none without min_tokens).
        RequestError if they and its logit bias overflow MAX_LOGIT_BIAS entries."""
        if not self.min_tokens:
            return ()
        bans = tuple(sorted(self.stop_ids(eos_token_ids)))
        if len(bans) + len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(
                f"request {request_id!r}: min_tokens bans its {len(bans)} stop ids (stop_token_ids "
                f"and the end-of-sequence ids) beside {len(self.logit_bias)} logit_bias entries: "
                f"at most {MAX_LOGIT_BIAS} in all; give fewer", "min_tokens")
        return bans

    def _validate_logit_bias(self, where: str, vocab_size: int) -> None:
        bias = self.logit_bias
        form = "(token id, bias) pairs, or {token id: bias}"
        if not isinstance(bias, tuple) or not all(isinstance(p, tuple) and len(p) == 2
                                                  for p in bias):
            raise RequestError(f"{where}: logit_bias must be {form}, got {bias!r}",
                               "logit_bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"{where}: logit_bias has {len(bias)} entries; give at most "
                               f"{MAX_LOGIT_BIAS}", "logit_bias")
        ids = [t for t, _ in bias]
        bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"{where}: logit_bias ids {bad[:5]!r} are not token ids in "
                               f"[0, {vocab_size})", "logit_bias")
        if len(set(ids)) != len(ids):
            raise RequestError(f"{where}: logit_bias gives a token id twice; give each once",
                               "logit_bias")
        bad = [v for _, v in bias if not _is_number(v) or not -100 <= v <= 100]
        if bad:
            raise RequestError(f"{where}: logit_bias values {bad[:5]!r} must be numbers in "
                               f"[-100, 100]", "logit_bias")


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: an id unique among those in flight, prompt token ids, parameters."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams = SamplingParams()

    @classmethod
    def make(cls, request_id: str, prompt, params: SamplingParams | None = None, *,
             vocab_size: int, reserved_ids=()) -> "Request":
        """A checked request. `reserved_ids` are ids no prompt may hold (the
        drafter's mask token). Raises RequestError."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request id must be a non-empty string, got {request_id!r}",
                               "request_id")
        where = f"request {request_id!r}"
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
            raise RequestError(f"{where}: prompt must be a list of token ids, got "
                               f"{type(prompt).__name__}", "prompt")
        prompt = list(prompt)
        if not prompt:
            raise RequestError(f"{where}: empty prompt; give at least one token", "prompt")
        # One pass over the entries, then array checks (a long prompt is checked on the
        # serving thread); entry by entry only to name what is wrong.
        if not all(_is_int_type(t) for t in set(map(type, prompt))):
            not_ints = [t for t in prompt if not _is_int(t)]
            raise RequestError(f"{where}: prompt holds non-integer entries {not_ints[:5]!r}; "
                               f"give token ids", "prompt")
        ids = np.asarray(prompt)
        if ids.dtype.kind not in "iu" or ((ids < 0) | (ids >= vocab_size)).any():
            bad = [int(t) for t in prompt if not 0 <= t < vocab_size]
            raise RequestError(f"{where}: token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {vocab_size})", "prompt")
        reserved = np.intersect1d(ids, np.asarray(reserved_ids, ids.dtype)).tolist()
        if reserved:
            raise RequestError(f"{where}: token ids {reserved} are reserved (the drafter's "
                               f"mask token) and may not appear in a prompt", "prompt")
        params = params or SamplingParams()
        params.validate(request_id, vocab_size)
        return cls(request_id, tuple(ids.tolist()), params)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability under the target's raw logits, the most likely tokens
    at its position with theirs, most likely first (as many as the request asked), and
    the token's rank there (1: the most likely; ties share the better rank)."""

    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int

    @classmethod
    def of_row(cls, row, top: int) -> "TokenLogprobs":
        """From a step's row (`sampling.token_logprobs`: the token's log-probability,
        MAX_LOGPROBS ids, their log-probabilities, its rank), keeping `top` of them."""
        ids, logprobs = row[1:1 + MAX_LOGPROBS], row[1 + MAX_LOGPROBS:1 + 2 * MAX_LOGPROBS]
        return cls(float(row[0]), tuple((int(i), float(x)) for i, x in
                                        zip(ids[:top], logprobs[:top]) if i >= 0),
                   int(row[1 + 2 * MAX_LOGPROBS]))


def logprob_rows(bits):
    """A sender's first-token log-probabilities (i32 bits: `KVPayload.first_logprobs`) as
    the f32[1, width] rows `Scheduler.emit` takes; None stays None."""
    return None if bits is None else np.asarray(bits, np.int32).view(np.float32)[None]


def prompt_logprob_rows(parts, width: int) -> np.ndarray:
    """A sender's prompt log-probabilities (`KVPayload.prompt_logprobs`: (i32 bits, rows)
    per prefill chunk, read to the host) as f32[prompt length - 1, width] rows."""
    rows = [np.asarray(bits, np.int32).view(np.float32).reshape(-1, width)[:n]
            for bits, n in parts]
    return np.concatenate(rows) if rows else np.zeros((0, width), np.float32)


@dataclasses.dataclass
class Result:
    """One finished request.

    Attributes:
      tokens: generated tokens, the first included; at most max_new_tokens.
      acceptance: tokens kept per decode step (AL = their mean; tokens past a
        stop or max_new_tokens are not counted).
      finish_reason: "length", "stop" (a stop id or EOS), or "error".
      error: what went wrong, naming the request, when finish_reason is "error".
      token_times_s: when each token reached the host, from submission.
      logprobs: a TokenLogprobs per token when the request asked for them, else None.
      prompt_logprobs: when the request asked for them, one per prompt token: None for
        the first (nothing predicts it), then a TokenLogprobs each; else None.
      retryable: the error is the server's and passing (its KV did not come: a peer
        unreachable, hung or slow, or a buffer damaged on the way); the same request sent
        again may be served. False for every other ending.
    """

    request_id: str
    prompt: list[int]
    tokens: list[int]
    acceptance: list[int]
    time_to_first_token_s: float
    decode_time_s: float
    finish_reason: str = "length"
    error: str | None = None
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    retryable: bool = False

    @property
    def acceptance_length(self) -> float:
        return float(np.mean(self.acceptance)) if self.acceptance else 0.0

    @property
    def ok(self) -> bool:
        return self.finish_reason != "error"
