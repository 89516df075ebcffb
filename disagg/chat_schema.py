"""The OpenAI chat request schema (the shared checks: disagg/schema.py).

chat:       {"model": str, "messages": [{"role": "system" | "user" | "assistant",
             "content": str | [{"type": "text", "text": str}, ...] (the texts joined)},
             ...] (non-empty), "max_tokens" | "max_completion_tokens": int >= 1 (one of
             them; default as for a completion), "n", "temperature",
             "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_tokens", "logit_bias", "seed", "stop", "stream",
             "stream_options", "stop_token_ids", "ignore_eos",
             "include_stop_str_in_output" as for a completion,
             "logprobs": bool, "top_logprobs": int in [0, 20] (with "logprobs": true)};
             vLLM's "add_generation_prompt": bool (default true),
             "continue_final_message": bool (default false; not with the former: the
             final message is left open, for the model to continue) and
             "chat_template_kwargs": {name: value} (template variables, such as Qwen3's
             "enable_thinking"), "truncate_prompt_tokens" as for a completion;
             neutral-only OpenAI fields as for a completion, plus
             tools = null, tool_choice = "none", response_format = {"type": "text"}.
             The prompt is the messages rendered by the checkpoint's chat template
             (`chat_prompt`); a tokenizer without one refuses every chat request,
             naming /v1/completions as the way in.
"""

from __future__ import annotations

from disagg.schema import (DEFAULT_MAX_TOKENS, NEUTRAL, SAMPLING_FIELDS, check_fields,
                           check_openai_options, choice_requests, fitting_default_max,
                           num_choices, stop_strings, truncated_prompt)
from drafter.request import MAX_LOGPROBS, Request, RequestError
from drafter.tokenizer import SPECIAL_TOKENS, ChatTemplateError

CHAT_NEUTRAL = {**{k: v for k, v in NEUTRAL.items() if k not in ("best_of", "suffix")},
                "tools": ((None,), "tool calls are not implemented"),
                "tool_choice": ((None, "none"), "tool calls are not implemented"),
                "response_format": ((None, {"type": "text"}),
                                    "structured output is not implemented")}
CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
CHAT_FIELDS = {*CHAT_OPTIONS, "truncate_prompt_tokens", "model", "messages", "n", "max_tokens",
               "max_completion_tokens", "temperature", "seed", "stop", "stream",
               "stream_options", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs",
               "logit_bias", *SAMPLING_FIELDS, *CHAT_NEUTRAL}
CHAT_ROLES = ("system", "user", "assistant")
# Template variables a request's chat_template_kwargs may not set
TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", *SPECIAL_TOKENS})
MESSAGE_FORM = '{"role": "system" | "user" | "assistant", "content": "text"}'


def no_chat_template(model_name: str) -> str:
    """The refusal of a chat request to a model whose checkpoint has no chat template."""
    return (f"model {model_name!r} has no chat template (its checkpoint ships none: no "
            f"chat_template.jinja, no chat_template.json, no \"chat_template\" in "
            f"tokenizer_config.json), so chat messages cannot be turned into a prompt; "
            f"send the prompt as text to POST /v1/completions instead, or serve a "
            f"checkpoint whose tokenizer has a chat template (--target DIR)")


def chat_messages(rid: str, obj: dict) -> list[dict]:
    if "messages" not in obj:
        raise RequestError(f"request {rid!r}: \"messages\" is missing; give a list of "
                           f"{MESSAGE_FORM}", "messages")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"request {rid!r}: \"messages\" must be a non-empty list of "
                           f"{MESSAGE_FORM}, got {messages!r:.80}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"request {rid!r}: \"{where}\" must be an object "
                               f"{MESSAGE_FORM}, got {type(m).__name__}", where)
        unknown = sorted(set(m) - {"role", "content"})
        if unknown:
            raise RequestError(f"request {rid!r}: \"{where}\" has unknown fields {unknown}; "
                               f"a message holds only \"role\" and \"content\"",
                               f"{where}.{unknown[0]}")
        for key in ("role", "content"):
            if key not in m:
                raise RequestError(f"request {rid!r}: \"{where}.{key}\" is missing; a "
                                   f"message is {MESSAGE_FORM}", f"{where}.{key}")
        role, content = m["role"], m["content"]
        if role not in CHAT_ROLES or not isinstance(role, str):
            fix = " (\"developer\" instructions go in a \"system\" message)" \
                if role == "developer" else " (tool calls are not implemented)" \
                if role in ("tool", "function") else ""
            raise RequestError(f"request {rid!r}: \"{where}.role\" is {role!r}; use one of "
                               f"{', '.join(CHAT_ROLES)}{fix}", f"{where}.role")
        if isinstance(content, list):
            content = _text_parts(rid, content, f"{where}.content")
        if not isinstance(content, str):
            raise RequestError(f"request {rid!r}: \"{where}.content\" must be a string or a "
                               f"list of text parts, got {type(content).__name__}",
                               f"{where}.content")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:   # a lone surrogate ("\\ud800") decodes from JSON
            raise RequestError(f"request {rid!r}: \"{where}.content\" is not valid Unicode "
                               f"({e})", f"{where}.content") from None
        out.append({"role": role, "content": content})
    return out


def _text_parts(rid: str, parts: list, where: str) -> str:
    """OpenAI's content parts [{"type": "text", "text": str}, ...] as the one text they
    join to (as vLLM joins them); images, audio and files are not supported."""
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text" and set(part) == {
                "type", "text"} and isinstance(part["text"], str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"request {rid!r}: \"{where}[{j}]\" is a {kind!r} part; only "
                               f"text parts {{\"type\": \"text\", \"text\": str}} are "
                               f"supported (no images, audio or files)", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def parse_chat(obj, rid: str, engine, tokenizer, model_name: str, *,
               default_max_tokens: int = DEFAULT_MAX_TOKENS
               ) -> list[tuple[Request, tuple[str, ...]]]:
    """An OpenAI chat completion request's checked Requests and stop strings, `n` of them
    (RequestError's `.field` uses OpenAI's names, a message's as "messages[i].role").
    Defaults: temperature 1; max tokens as for a completion (`default_max_tokens`, at
    most the room the prompt leaves)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError(no_chat_template(model_name), None)
    field = "max_tokens"
    try:
        check_fields(rid, obj, CHAT_FIELDS)
        check_openai_options(rid, obj, CHAT_NEUTRAL)
        if "max_tokens" in obj and "max_completion_tokens" in obj:
            raise RequestError(f"request {rid!r}: give one of \"max_completion_tokens\" and "
                               f"\"max_tokens\", not both", "max_completion_tokens")
        if "max_completion_tokens" in obj:
            field = "max_completion_tokens"
        obj = dict(obj, logprobs=_chat_logprobs(rid, obj))
        prompt = truncated_prompt(rid, chat_prompt(rid, obj, tokenizer), obj)
        stop = stop_strings(rid, obj.get("stop"))
        default_max = fitting_default_max(rid, prompt, obj, field, engine,
                                          default_max_tokens, "messages")
        n = num_choices(rid, obj, 1)
        return [(req, stop) for req in choice_requests(rid, prompt, obj, engine, field,
                                                        default_max, n, 0, n)]
    except RequestError as e:
        raise RequestError(str(e).replace("max_new_tokens", field),
                           field if e.field == "max_new_tokens" else e.field) from None


def chat_prompt(rid: str, obj: dict, tokenizer) -> list[int]:
    """The prompt ids of a request's "messages", rendered by the model's chat template
    with its options: "add_generation_prompt" (default true: the assistant's turn
    opened), "continue_final_message" (default false: the final message left open for
    the model to continue; not with add_generation_prompt) and "chat_template_kwargs"
    (more template variables, such as Qwen3's {"enable_thinking": false}), vLLM's."""
    messages = chat_messages(rid, obj)
    options = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        options[name] = obj.get(name, default)
        if not isinstance(options[name], bool):
            raise RequestError(f"request {rid!r}: \"{name}\" must be true or false, got "
                               f"{options[name]!r}", name)
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise RequestError(f"request {rid!r}: \"continue_final_message\" leaves the final "
                           f"message open and \"add_generation_prompt\" opens a new turn; "
                           f"set \"add_generation_prompt\": false to continue the final "
                           f"message", "continue_final_message")
    variables = obj.get("chat_template_kwargs")
    variables = {} if variables is None else variables
    if not isinstance(variables, dict):
        raise RequestError(f"request {rid!r}: \"chat_template_kwargs\" must be an object of "
                           f"template variables, got {variables!r:.80}", "chat_template_kwargs")
    taken = sorted(set(variables) & TEMPLATE_NAMES)
    if taken:
        raise RequestError(f"request {rid!r}: \"chat_template_kwargs\" may not set {taken}: "
                           f"the messages, the generation prompt and the special tokens come "
                           f"from the request and the model", "chat_template_kwargs")
    try:
        return tokenizer.encode_chat(messages, variables=variables, **options)
    except ChatTemplateError as e:
        raise RequestError(f"request {rid!r}: {e}", "messages") from None


def _chat_logprobs(rid: str, obj: dict) -> int | None:
    """Chat's "logprobs": true with "top_logprobs": N as a SamplingParams.logprobs."""
    wanted, top = obj.get("logprobs"), obj.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):   # 1 == True: no coercion
        raise RequestError(f"request {rid!r}: \"logprobs\" must be true or false, got "
                           f"{wanted!r}", "logprobs")
    if top is not None and wanted is not True:
        raise RequestError(f"request {rid!r}: \"top_logprobs\" needs \"logprobs\": true",
                           "top_logprobs")
    if not wanted:
        return None
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
        raise RequestError(f"request {rid!r}: \"top_logprobs\" must be an integer in "
                           f"[0, {MAX_LOGPROBS}], got {top!r}", "top_logprobs")
    return top or 0
