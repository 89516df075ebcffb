"""Write the fixed held-out evaluation prompt set (drafter/data/eval_prompts.json).

    PYTHONPATH=. python -m drafter.make_prompts

Prompts are windows of held-out stdlib files (never trained on: the split is
by file), cut at a line start, at lengths 128 .. 8192 tokens, BOS first.
"""

from __future__ import annotations

import json

import numpy as np

from drafter.corpus import BOS, load_split
from drafter.default import PROMPTS_FILE

LENGTHS = {128: 8, 512: 6, 2048: 4, 8192: 3}  # prompt length -> how many


def main():
    docs = load_split("heldout")
    stream = np.concatenate(docs).astype(np.int64)
    rng = np.random.default_rng(2026)
    prompts = []
    for length, count in LENGTHS.items():
        for _ in range(count):
            start = int(rng.integers(0, len(stream) - length - 1))
            while start > 0 and stream[start - 1] != ord("\n"):  # start on a line
                start -= 1
            prompts.append({"length": length,
                            "tokens": [BOS] + stream[start:start + length - 1].tolist()})
    PROMPTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    PROMPTS_FILE.write_text(json.dumps({"source": "python stdlib, held-out files",
                                        "prompts": prompts}))
    print(f"wrote {len(prompts)} prompts to {PROMPTS_FILE}")


if __name__ == "__main__":
    main()
