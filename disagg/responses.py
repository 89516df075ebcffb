"""The OpenAI response objects the HTTP front end (disagg/http.py) answers with: error
bodies, completions and chat completions, whole or as streamed chunks."""

from __future__ import annotations

import dataclasses

from disagg.loop import Event


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def usage(results, n: int) -> dict:
    """OpenAI's usage of choices' Results (prompt-major, n per prompt): each prompt
    counted once, every choice's completion tokens."""
    prompt = sum(len(r.prompt) for r in results[::n])
    completion = sum(len(r.tokens) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def pooled_acceptance(results) -> float:
    """Tokens kept per decode step over every choice's steps (a lone choice's AL)."""
    steps = [a for r in results for a in r.acceptance]
    return float(sum(steps) / len(steps)) if steps else 0.0


class CompletionFormat:
    """The response objects of /v1/completions (`object` "text_completion"); a choice
    carries its `index`, `text`, finish_reason, `token_ids` and, when asked for, its
    tokens' `logprobs` (OpenAI's legacy form: tokens, token_logprobs, top_logprobs,
    text_offset); a streamed chunk holds one choice, and a choice's last chunk carries
    its finish_reason and, beside it, the choice's acceptance_length. With echo, a
    choice's text (its first chunk's, streamed) starts with its prompt decoded, and its
    logprobs with the prompt's tokens (the first one's null); with max_tokens 0 the
    prompt is all it holds (`prepare`). With vLLM's prompt_logprobs, a choice (its first
    chunk, streamed) carries `prompt_logprobs`: null for the first prompt token, then
    per token {"token id": {logprob, rank, decoded_token}} for the token itself and the
    prompt_logprobs most likely tokens at its position.

    A token's text is the token decoded alone (a piece of a character whose bytes span
    tokens reads U+FFFD); text offsets add up those texts."""

    id_prefix, whole_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._offsets: dict[int, int] = {}   # per choice: its tokens' text so far
        self.echo = self.echo_only = False
        self.echo_top = self.prompt_top = None
        self._prompts: list = []
        self._echoed: set[int] = set()
        self._prompts_scored: set[int] = set()

    def prepare(self, body: dict, requests) -> None:
        """Learn what a request's choices (its checked engine Requests, in order) echo."""
        self.echo = body.get("echo") is True
        self.echo_only = self.echo and body.get("max_tokens") == 0
        # each form's own count: the engine scored the prompt with the larger
        self.echo_top, self.prompt_top = body.get("logprobs"), body.get("prompt_logprobs")
        self._prompts = [r.prompt for r in requests]

    def reported(self, result):
        """A choice's Result as the response counts it: with max_tokens 0, no tokens."""
        if not self.echo_only:
            return result
        return dataclasses.replace(result, tokens=[], acceptance=[],
                                   logprobs=None if result.logprobs is None else [])

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def choice(self, index: int, text: str, finish_reason, token_ids, *, whole: bool,
               logprobs=None, prompt_logprobs=None) -> dict:
        if self.echo_only:   # whatever ended the one token generated: the length did
            text, token_ids, logprobs = "", [], logprobs and []
            finish_reason = finish_reason and "length"
        scored = None
        if (self.prompt_top is not None and prompt_logprobs is not None
                and index not in self._prompts_scored):
            self._prompts_scored.add(index)
            scored = self.scored_prompt(self._prompts[index], prompt_logprobs)
        if self.echo and index not in self._echoed:   # the prompt first, once
            self._echoed.add(index)
            prompt = list(self._prompts[index])
            text = self.tokenizer.decode(prompt) + text
            if logprobs is not None:
                logprobs = [None if lp is None else
                            dataclasses.replace(lp, top=lp.top[:self.echo_top])
                            for lp in prompt_logprobs] + list(logprobs)
            token_ids_with_prompt = prompt + list(token_ids)
        else:
            token_ids_with_prompt = token_ids
        out = {"index": index, "text": text,
               "logprobs": self.logprobs(index, token_ids_with_prompt, logprobs),
               "finish_reason": finish_reason, "token_ids": token_ids}
        if scored is not None:
            out["prompt_logprobs"] = scored
        return out

    def scored_prompt(self, prompt, prompt_logprobs) -> list:
        """vLLM's prompt_logprobs form: null, then per prompt token its own entry and
        those of the prompt_logprobs most likely tokens (ranks 1, 2, ...)."""
        out = [None]
        for token, lp in zip(list(prompt)[1:], prompt_logprobs[1:]):
            entries = {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": self.token_text(token)}}
            for rank, (t, x) in enumerate(lp.top[:self.prompt_top], start=1):
                entries.setdefault(str(t), {"logprob": x, "rank": rank,
                                            "decoded_token": self.token_text(t)})
            out.append(entries)
        return out

    def logprobs(self, index: int, token_ids, logprobs) -> dict | None:
        """OpenAI's legacy form; an entry None (an echoed prompt's first token) is null."""
        if logprobs is None:
            return None
        texts = [self.token_text(t) for t in token_ids]
        offsets, at = [], self._offsets.get(index, 0)
        for piece in texts:
            offsets.append(at)
            at += len(piece)
        self._offsets[index] = at
        return {"tokens": texts,
                "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
                "top_logprobs": [None if lp is None else self._top(t, lp)
                                 for t, lp in zip(token_ids, logprobs)],
                "text_offset": offsets}

    def _top(self, token: int, lp) -> dict:
        """The most likely tokens' texts and log-probabilities, most likely first, and the
        chosen token's too (OpenAI's rule: up to logprobs + 1 entries); tokens whose
        texts collide keep the first."""
        top = {}
        for t, x in lp.top:
            top.setdefault(self.token_text(t), x)
        top.setdefault(self.token_text(token), lp.logprob)
        return top

    def head(self, index: int) -> list[dict]:
        """Choice `index`'s streamed choices sent before its first token."""
        return []

    def pieces(self, index: int, event: Event) -> list[tuple[dict, dict]]:
        """Streamed (choice, extra fields) for one Event of choice `index`."""
        finished = event.finish_reason is not None
        if not (event.text or event.tokens or finished):
            return []
        extra = ({"acceptance_length": self.reported(event.result).acceptance_length}
                 if finished else {})
        if self.echo_only and index in self._echoed and not finished:
            return []   # the token generated for an echo alone is not reported
        return [(self.choice(index, event.text, event.finish_reason, event.tokens,
                             whole=False, logprobs=event.logprobs,
                             prompt_logprobs=event.prompt_logprobs), extra)]


class ChatFormat(CompletionFormat):
    """The response objects of /v1/chat/completions: "chat.completion" with a `message`
    {role, content}; streamed as "chat.completion.chunk": the role first (empty
    content), then content deltas, then an empty delta with the finish_reason and
    acceptance_length; a choice's `logprobs` in OpenAI's chat form."""

    id_prefix, whole_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def choice(self, index, text, finish_reason, token_ids, *, whole, delta=None,
               logprobs=None, prompt_logprobs=None) -> dict:
        """(`prompt_logprobs`: unused; a chat echoes nothing.)"""
        body = {"message": {"role": "assistant", "content": text}} if whole else \
            {"delta": {"content": text} if delta is None else delta}
        return {"index": index, **body, "logprobs": self.logprobs(index, token_ids, logprobs),
                "finish_reason": finish_reason, "token_ids": token_ids}

    def logprobs(self, index: int, token_ids, logprobs) -> dict | None:
        """OpenAI's chat form: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        if logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            # the token's own bytes: a piece of a character is not U+FFFD's
            return {"token": text, "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token))}
        return {"content": [{**entry(t, lp.logprob),
                             "top_logprobs": [entry(u, x) for u, x in lp.top]}
                            for t, lp in zip(token_ids, logprobs)]}

    def head(self, index: int) -> list[dict]:
        return [self.choice(index, "", None, [], whole=False,
                            delta={"role": "assistant", "content": ""})]

    def pieces(self, index: int, event: Event) -> list[tuple[dict, dict]]:
        out = []
        if event.text or event.tokens:
            out.append((self.choice(index, event.text, None, event.tokens, whole=False,
                                    logprobs=event.logprobs), {}))
        if event.finish_reason is not None:
            out.append((self.choice(index, "", event.finish_reason, [], whole=False,
                                    delta={}),
                        {"acceptance_length": event.result.acceptance_length}))
        return out
