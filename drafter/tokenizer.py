"""Text <-> token ids: the embedded pair's bytes, or a checkpoint's own `tokenizer.json`.

Every tokenizer here has `encode(text) -> list[int]`, `decode(ids) -> str`,
`vocab_size` and `eos_token_ids` (the ids that end generation). A checkpoint's
tokenizer is read by the HF `tokenizers` library, so text is split exactly as
the model was trained; the embedded pair keeps its byte-level tokenizer.

End-of-sequence ids come from the checkpoint, first found of:
`generation_config.json` "eos_token_id" (an id or a list), `config.json`
"eos_token_id", `tokenizer_config.json` "eos_token" (a token looked up in
the vocabulary). None found: generation ends only by length, stop ids or
stop strings.

A checkpoint's chat template is, first found: `chat_template.jinja`,
`chat_template.json` "chat_template", `tokenizer_config.json` "chat_template"
(a string, or a list of {"name", "template"} of which "default" is taken).
It is rendered by jinja2 as HF transformers renders it (`ChatTemplate`) and
its text is encoded without the post-processor's special tokens (the template
writes them). None found: `chat_template` is None; no template is invented.
The embedded byte tokenizer has none.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from drafter.corpus import ByteTokenizer


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or does not fit the model; names the fix."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None


class ChatTemplateError(ValueError):
    """A chat template that refused or failed on the messages given (names why)."""


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                  "cls_token", "mask_token")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


class ChatTemplate:
    """A checkpoint's chat template, rendered as HF transformers renders it.

    jinja2's sandboxed environment with trim_blocks, lstrip_blocks and loop
    controls; `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` filter
    that does not escape HTML, and `{% generation %}` blocks rendered as their
    body. The variables are `messages`, `add_generation_prompt` and the
    tokenizer's special tokens (`bos_token`, `eos_token`, ...) as strings.
    TokenizerError at construction if it does not compile (naming `origin`).
    """

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str):
        try:
            import jinja2
            from jinja2 import nodes
            from jinja2.ext import Extension, loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise TokenizerError("rendering the chat template needs the `jinja2` package: "
                                 "pip install jinja2") from None

        class GenerationBlocks(Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_body"), [], [], body) \
                    .set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationBlocks, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"{origin}: the chat template does not compile ({e})") \
                from None
        self.source, self.special_tokens, self.origin = source, dict(special_tokens), origin

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, variables=None) -> str:
        """The prompt text of `messages`; with `continue_final_message`, cut just after the
        last message's content, so the model continues it (HF's rule); `variables`: more
        template variables (a request's chat_template_kwargs, such as Qwen3's
        enable_thinking; they never replace `messages`, `add_generation_prompt` or the
        special tokens). ChatTemplateError if the template refuses the messages (its
        `raise_exception`) or fails on them, or the final message to continue is not in
        the text."""
        try:
            text = self._template.render({**(variables or {}), "messages": messages,
                                          "add_generation_prompt": add_generation_prompt,
                                          **self.special_tokens})
        except Exception as e:  # the checkpoint's template code, run on the request's data
            import jinja2
            why = str(e) if type(e) is jinja2.exceptions.TemplateError \
                else f"{type(e).__name__}: {e}"
            raise ChatTemplateError(f"the model's chat template refused these messages: "
                                    f"{why}") from None
        if not continue_final_message:
            return text
        final = str(messages[-1].get("content", "")).strip() if messages else ""
        if not final or final not in text:
            raise ChatTemplateError("continue_final_message is set, but the model's chat "
                                    "template does not render the final message's content "
                                    "as it is, so it cannot be continued")
        return text[:text.rindex(final) + len(final)]


def _token_text(value):
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(root: Path) -> ChatTemplate | None:
    """The chat template shipped in checkpoint directory `root` (module rules), or None."""
    config_file = root / "tokenizer_config.json"
    config = _read_json(config_file)
    special = {name: text for name in SPECIAL_TOKENS
               if (text := _token_text(config.get(name))) is not None}
    source, origin = None, None
    if (root / "chat_template.jinja").is_file():
        source, origin = (root / "chat_template.jinja").read_text(), root / "chat_template.jinja"
    elif (root / "chat_template.json").is_file():
        origin = root / "chat_template.json"
        source = _read_json(origin).get("chat_template")
    elif config.get("chat_template") is not None:
        source, origin = config["chat_template"], config_file
    if source is None:
        return None
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise TokenizerError(f"{origin}: chat_template lists templates "
                                 f"{sorted(map(str, named))} but none named \"default\"; "
                                 f"this server renders the default one")
        source = named["default"]
    if not isinstance(source, str):
        raise TokenizerError(f"{origin}: chat_template must be a string (a jinja template), "
                             f"got {type(source).__name__}")
    return ChatTemplate(source, special, str(origin))


def _byte_level_bytes() -> dict[str, int]:
    """The ByteLevel pre-tokenizer's printable character -> byte (GPT-2's map, inverted):
    how a byte-level BPE token spells its bytes."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_OF = _byte_level_bytes()


class HFTokenizer:
    """A checkpoint's `tokenizer.json` through the HF `tokenizers` library.

    `encode` applies the tokenizer's own post-processor (special tokens as the
    checkpoint defines them) unless `add_special_tokens=False`; `decode` drops
    special tokens; `encode_chat` renders messages with the checkpoint's
    `chat_template` (None: it has none) and encodes the text as it stands.
    """

    def __init__(self, path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json at {file}; text needs the checkpoint's "
                                 f"tokenizer: copy the model's tokenizer.json (and "
                                 f"tokenizer_config.json) there")
        try:
            import tokenizers
        except ImportError:
            raise TokenizerError("reading tokenizer.json needs the `tokenizers` package: "
                                 "pip install tokenizers") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises its own exception type
            raise TokenizerError(f"{file}: the tokenizers library cannot read it ({e})") from None
        self.path = file
        # the parsed decoder's own JSON (a Sequence, or one decoder), not the file again
        decoder = json.loads(self._tok.decoder.__getstate__()) if self._tok.decoder else {}
        parts = decoder.get("decoders") or [decoder]
        self._byte_level = any(isinstance(d, dict) and d.get("type") == "ByteLevel"
                               for d in parts)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = self._eos_ids(file.parent)
        self.chat_template = load_chat_template(file.parent)

    def _eos_ids(self, root: Path) -> tuple[int, ...]:
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(root / name).get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise TokenizerError(f"{root / name}: eos_token_id must be an id or a "
                                         f"list of ids, got {eos!r}")
                return tuple(ids)
        token = _read_json(root / "tokenizer_config.json").get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and (i := self._tok.token_to_id(token)) is not None:
            return (i,)
        return ()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_chat(self, messages: list[dict], **options) -> list[int]:
        """The prompt ids of `messages` ([{"role", "content"}, ...]), by default with the
        assistant's turn opened (`options`: ChatTemplate.render's). ChatTemplateError if
        the template refuses them; TokenizerError if the checkpoint has no chat
        template."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.path.parent} has no chat template")
        return self.encode(self.chat_template.render(messages, **options),
                           add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE token's own bytes (part of a
        character's, for a token that splits one: not U+FFFD's), else its text alone."""
        piece = self._tok.id_to_token(int(token))
        if self._byte_level and piece is not None and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self._tok.decode([int(token)], skip_special_tokens=False).encode()


def load_tokenizer(target_dir=None, *, model_vocab_size: int | None = None):
    """The tokenizer of the target checkpoint in `target_dir` (its tokenizer.json);
    None: the embedded pair's byte tokenizer. TokenizerError if the tokenizer's
    vocabulary is larger than the model's (its ids would fall outside the
    embedding)."""
    tok = ByteTokenizer() if target_dir is None else HFTokenizer(target_dir)
    if model_vocab_size is not None and tok.vocab_size > model_vocab_size:
        raise TokenizerError(f"the tokenizer has {tok.vocab_size} tokens but the model's "
                             f"vocab_size is {model_vocab_size}: they do not belong together; "
                             f"use the tokenizer.json shipped with the target checkpoint")
    return tok
