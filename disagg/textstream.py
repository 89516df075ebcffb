"""A request's output as text, released piece by piece, cut at stop strings.

Rules:
  * the text released so far is always a prefix of the final text: a piece
    is released only once later tokens cannot change it. Held back: a tail
    that decodes to U+FFFD (a character whose bytes are not all here yet) and
    a tail that could be the start of a stop string;
  * a stop string ends the request at its first occurrence; the text ends
    just before it (the stop string is not returned, as in OpenAI's API) and
    the tokens end with the first token that completes it (with include_stop, the text
    ends with the stop string, vLLM's include_stop_str_in_output). With min_tokens, only
    an occurrence that ends past the text of the first min_tokens tokens counts
    (vLLM's rule: stops take effect after min_tokens);
  * tokens are decoded together from the first generated one (never piece by
    piece: a multi-byte character or a merged word may span two steps); the
    prefix rule needs a tokenizer whose decoding of more tokens extends that
    of fewer (byte-level ones do: the embedded pair's, Qwen's).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    """Feed committed tokens; get the newly final text and whether a stop string ended it."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens, self.include_stop = min_tokens, include_stop
        self.tokens: list[int] = []
        self.text = ""           # the text released so far
        self.stopped = False     # a stop string was found (no more tokens are taken)
        self._floor = 0          # a stop must end past this many characters

    def feed(self, new_tokens) -> str:
        """Take newly committed tokens; returns the text they make final."""
        if self.stopped or not new_tokens:
            return ""
        before = len(self.tokens)
        self.tokens.extend(int(t) for t in new_tokens)
        if before < self.min_tokens <= len(self.tokens):
            self._floor = len(self.tokenizer.decode(self.tokens[:self.min_tokens]))
        decoded = self.tokenizer.decode(self.tokens)
        found = self._first_stop(decoded)
        if found is not None:
            self.stopped = True
            self._trim_tokens(before)
            return self._release(decoded[:found[1] if self.include_stop else found[0]])
        end = len(decoded)
        while end > len(self.text) and decoded[end - 1] == REPLACEMENT:
            end -= 1
        end -= self._stop_prefix_len(decoded[:end])
        return self._release(decoded[:max(end, len(self.text))])

    def finish(self) -> str:
        """The request ended (length, stop id, EOS): release everything held back."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.tokens))

    def _release(self, upto: str) -> str:
        piece = upto[len(self.text):]
        self.text = upto
        return piece

    def _first_stop(self, decoded: str, count: int | None = None) -> tuple[int, int] | None:
        """Where the first stop string that counts starts and ends in `decoded`, the text
        of the first `count` tokens (all of them by default)."""
        if (len(self.tokens) if count is None else count) < self.min_tokens:
            return None
        # Earlier text was searched already; a stop may straddle the old end.
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [(i, i + len(s)) for s in self.stop
                if (i := decoded.find(s, max(start, self._floor - len(s) + 1))) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """The longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _trim_tokens(self, before: int) -> None:
        """Keep tokens up to the first one whose text contains a stop string."""
        for k in range(before + 1, len(self.tokens) + 1):
            if self._first_stop(self.tokenizer.decode(self.tokens[:k]), k) is not None:
                del self.tokens[k:]
                return
