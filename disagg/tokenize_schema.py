"""What POST /tokenize and POST /detokenize take (as vLLM's do): text or a chat's
messages in, token ids out, and token ids in, checked against the vocabulary. The
checks are the completion and chat schema's (disagg/schema.py)."""

from __future__ import annotations

from disagg.chat_schema import CHAT_OPTIONS, chat_prompt, no_chat_template
from disagg.schema import check_fields, text_prompt
from drafter.request import RequestError


def parse_tokenize(obj, rid: str, tokenizer, model_name: str) -> list[int]:
    """POST /tokenize's token ids: {"model"?, "prompt": text} or {"model"?, "messages":
    [...]} (rendered as a chat request's prompt is)."""
    check_fields(rid, obj, {"model", "prompt", "messages", *CHAT_OPTIONS})
    if ("prompt" in obj) == ("messages" in obj):
        raise RequestError(f"request {rid!r}: give exactly one of \"prompt\" (text) and "
                           f"\"messages\" (a chat)", "prompt")
    if "messages" in obj:
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError(no_chat_template(model_name), "messages")
        return chat_prompt(rid, obj, tokenizer)
    if not isinstance(obj["prompt"], str):
        raise RequestError(f"request {rid!r}: \"prompt\" must be text, got "
                           f"{type(obj['prompt']).__name__}", "prompt")
    return text_prompt(rid, obj["prompt"], tokenizer) if obj["prompt"] else []


def parse_detokenize(obj, rid: str, vocab_size: int) -> list[int]:
    """POST /detokenize's token ids: {"model"?, "tokens": [int, ...]}, each in the
    vocabulary."""
    check_fields(rid, obj, {"model", "tokens"})
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError(f"request {rid!r}: \"tokens\" must be a list of token ids, got "
                           f"{tokens!r:.80}", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"request {rid!r}: token ids {bad[:5]} are outside the vocabulary "
                           f"[0, {vocab_size})", "tokens")
    return tokens
