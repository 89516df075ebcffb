"""The OpenAI response objects the HTTP front end (disagg/http.py) answers with: error
bodies, completions and chat completions, whole or as streamed chunks."""

from __future__ import annotations

from disagg.loop import Event


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class CompletionFormat:
    """The response objects of /v1/completions (`object` "text_completion"); a choice
    carries `text`, its finish_reason and its `token_ids`; the last streamed chunk
    carries the finish_reason and acceptance_length."""

    id_prefix, whole_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def choice(self, text: str, finish_reason, token_ids, *, whole: bool) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "token_ids": token_ids}

    def head(self) -> list[dict]:
        """Streamed choices sent before the first token."""
        return []

    def pieces(self, event: Event) -> list[tuple[dict, dict]]:
        """Streamed (choice, extra fields) for one Event."""
        finished = event.finish_reason is not None
        if not (event.text or event.tokens or finished):
            return []
        extra = {"acceptance_length": event.result.acceptance_length} if finished else {}
        return [(self.choice(event.text, event.finish_reason, event.tokens, whole=False),
                 extra)]


class ChatFormat(CompletionFormat):
    """The response objects of /v1/chat/completions: "chat.completion" with a `message`
    {role, content}; streamed as "chat.completion.chunk": the role first (empty
    content), then content deltas, then an empty delta with the finish_reason and
    acceptance_length."""

    id_prefix, whole_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def choice(self, text, finish_reason, token_ids, *, whole, delta=None) -> dict:
        body = {"message": {"role": "assistant", "content": text}} if whole else \
            {"delta": {"content": text} if delta is None else delta}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason,
                "token_ids": token_ids}

    def head(self) -> list[dict]:
        return [self.choice("", None, [], whole=False,
                            delta={"role": "assistant", "content": ""})]

    def pieces(self, event: Event) -> list[tuple[dict, dict]]:
        out = []
        if event.text or event.tokens:
            out.append((self.choice(event.text, None, event.tokens, whole=False), {}))
        if event.finish_reason is not None:
            out.append((self.choice("", event.finish_reason, [], whole=False, delta={}),
                        {"acceptance_length": event.result.acceptance_length}))
        return out
