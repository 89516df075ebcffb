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
"""

from __future__ import annotations

import json
from pathlib import Path

from drafter.corpus import ByteTokenizer


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or does not fit the model; names the fix."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None


class HFTokenizer:
    """A checkpoint's `tokenizer.json` through the HF `tokenizers` library.

    `encode` applies the tokenizer's own post-processor (special tokens as the
    checkpoint defines them); `decode` drops special tokens.
    """

    def __init__(self, path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json at {file}; text needs the checkpoint's "
                                 f"tokenizer (or send token ids)")
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
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = self._eos_ids(file.parent)

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

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


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
