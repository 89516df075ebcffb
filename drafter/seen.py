"""Which tokens a request's prompt holds (`StepState.prompt_seen`), for its repetition
penalty (drafter/sampling.py, `adjust`).

One call marks a request's prompt as the request takes its slot, on whichever worker
draws its tokens (the context's for the first, the generation side's for the rest),
from the prompt the request itself carries: no transfer carries the marks. Only
requests with a repetition penalty make the call; other rows' marks are stale, and
nothing reads them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from drafter.steps import StepState
from unified_kv import pow2_at_least

# The shortest prompt bucket: shorter prompts pad to it (fewer programs to compile).
MIN_PROMPT_BUCKET = 16


def prompt_bucket(n: int) -> int:
    """The padded length a prompt of n tokens is marked at (one program per bucket)."""
    return max(MIN_PROMPT_BUCKET, pow2_at_least(n))


def pack_prompt(slot: int, prompt, bucket: int) -> np.ndarray:
    """The mark call's one host input: [slot, n, the prompt's ids padded to `bucket`]."""
    out = np.zeros(2 + bucket, np.int32)
    out[0], out[1], out[2:2 + len(prompt)] = slot, len(prompt), prompt
    return out


def mark_prompt_step(state: StepState, index) -> StepState:
    """`prompt_seen` of the slot `index` names set to its prompt's tokens (the row
    rewritten whole: no reset needed before it)."""
    slot, n, tokens = index[0], index[1], index[2:]
    vocab = state.prompt_seen.shape[1]
    # Padding positions are sent out of range and dropped.
    ids = jnp.where(jnp.arange(tokens.shape[0]) < n, tokens, vocab)
    row = jnp.zeros((vocab,), bool).at[ids].set(True, mode="drop")
    return state.replace(prompt_seen=state.prompt_seen.at[slot].set(row))
