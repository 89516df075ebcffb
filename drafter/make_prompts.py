"""Write the fixed held-out prompt sets.

    PYTHONPATH=. python -m drafter.make_prompts

Prompts are windows of held-out stdlib files (never trained on: the split is
by file), cut at a line start, at lengths 128 .. 8192 tokens, BOS first.

  * drafter/data/eval_prompts.json (`SHIPPED`): the demo's and the serving
    benchmarks' prompts, a few per length;
  * drafter/data/acceptance_prompts.json (`ACCEPTANCE_PER_LENGTH` per length):
    what `drafter.evaluate` measures acceptance on. A continuation's acceptance
    varies 2-8 tokens a step from prompt to prompt, so a length's figure needs
    many prompts. Each length's shipped prompts come first, then windows drawn
    after them from the same generator, so the shipped set is its subset.
"""

from __future__ import annotations

import base64
import json
import zlib

import numpy as np

from drafter.corpus import BOS, load_split
from drafter.default import ACCEPTANCE_PROMPTS_FILE, PROMPTS_FILE

SHIPPED = {128: 8, 512: 6, 2048: 4, 8192: 3}  # prompt length -> how many
ACCEPTANCE_PER_LENGTH = 16
SEED = 2026


def draw(stream: np.ndarray, rng, length: int) -> list[int]:
    """One window of `length` tokens (BOS and length - 1 bytes) starting on a line."""
    start = int(rng.integers(0, len(stream) - length - 1))
    while start > 0 and stream[start - 1] != ord("\n"):  # start on a line
        start -= 1
    return [BOS] + stream[start:start + length - 1].tolist()


def prompt_sets(stream: np.ndarray) -> tuple[list[dict], list[dict]]:
    """(shipped, acceptance) prompts of the held-out byte stream."""
    rng = np.random.default_rng(SEED)
    shipped = [{"length": n, "tokens": draw(stream, rng, n)}
               for n, count in SHIPPED.items() for _ in range(count)]
    acceptance = []
    for n, count in SHIPPED.items():
        acceptance += [p for p in shipped if p["length"] == n]
        acceptance += [{"length": n, "tokens": draw(stream, rng, n)}
                       for _ in range(ACCEPTANCE_PER_LENGTH - count)]
    return shipped, acceptance


def encode(prompt: dict) -> dict:
    """A prompt as the acceptance file stores it (`drafter.default.decode_tokens`)."""
    packed = zlib.compress(np.asarray(prompt["tokens"], "<u2").tobytes(), 9)
    return {"length": prompt["length"], "tokens": base64.b64encode(packed).decode()}


def main():
    stream = np.concatenate(load_split("heldout")).astype(np.int64)
    shipped, acceptance = prompt_sets(stream)
    source = "python stdlib, held-out files"
    PROMPTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    PROMPTS_FILE.write_text(json.dumps({"source": source, "prompts": shipped}))
    ACCEPTANCE_PROMPTS_FILE.write_text(json.dumps(
        {"source": source, "encoding": "tokens: base64 of zlib of little-endian uint16",
         "prompts": [encode(p) for p in acceptance]}))
    print(f"wrote {len(shipped)} prompts to {PROMPTS_FILE} and {len(acceptance)} to "
          f"{ACCEPTANCE_PROMPTS_FILE}")


if __name__ == "__main__":
    main()
