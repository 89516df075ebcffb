"""The OpenAI response objects the HTTP front end (disagg/http.py) answers with: error
bodies, completions and chat completions, whole or as streamed chunks."""

from __future__ import annotations

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
    carries its `index`, `text`, finish_reason and `token_ids`; a streamed chunk holds
    one choice, and a choice's last chunk carries its finish_reason and, beside it, the
    choice's acceptance_length."""

    id_prefix, whole_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def choice(self, index: int, text: str, finish_reason, token_ids, *, whole: bool) -> dict:
        return {"index": index, "text": text, "logprobs": None,
                "finish_reason": finish_reason, "token_ids": token_ids}

    def head(self, index: int) -> list[dict]:
        """Choice `index`'s streamed choices sent before its first token."""
        return []

    def pieces(self, index: int, event: Event) -> list[tuple[dict, dict]]:
        """Streamed (choice, extra fields) for one Event of choice `index`."""
        finished = event.finish_reason is not None
        if not (event.text or event.tokens or finished):
            return []
        extra = {"acceptance_length": event.result.acceptance_length} if finished else {}
        return [(self.choice(index, event.text, event.finish_reason, event.tokens,
                             whole=False), extra)]


class ChatFormat(CompletionFormat):
    """The response objects of /v1/chat/completions: "chat.completion" with a `message`
    {role, content}; streamed as "chat.completion.chunk": the role first (empty
    content), then content deltas, then an empty delta with the finish_reason and
    acceptance_length."""

    id_prefix, whole_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def choice(self, index, text, finish_reason, token_ids, *, whole, delta=None) -> dict:
        body = {"message": {"role": "assistant", "content": text}} if whole else \
            {"delta": {"content": text} if delta is None else delta}
        return {"index": index, **body, "logprobs": None, "finish_reason": finish_reason,
                "token_ids": token_ids}

    def head(self, index: int) -> list[dict]:
        return [self.choice(index, "", None, [], whole=False,
                            delta={"role": "assistant", "content": ""})]

    def pieces(self, index: int, event: Event) -> list[tuple[dict, dict]]:
        out = []
        if event.text or event.tokens:
            out.append((self.choice(index, event.text, None, event.tokens, whole=False), {}))
        if event.finish_reason is not None:
            out.append((self.choice(index, "", event.finish_reason, [], whole=False,
                                    delta={}),
                        {"acceptance_length": event.result.acceptance_length}))
        return out
