"""One engine step: reset finished slots, prefill chunks and decode rows in one jitted call.

The scheduler's plan for a step becomes one `StepBatch`; `mixed_step` runs it
as a single dispatch with the state donated:

    reset_slots    release pages, clear `running`      (finished / newly admitted)
    prefill rows   one chunk each (<= max_step_tokens)  -> first token on a last chunk
    decode rows    one speculative (or plain) step each -> committed tokens

Prefill and decode rows are distinct slots, so running them in one call gives
exactly the tokens of running them in separate calls. Sampling keys are folded
from each request's seed and position, so a request draws the same numbers
whatever else shares its step.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from drafter.steps import (Sampler, SpecState, StepConfig, _at_precision, decode_rows,
                           plain_decode_rows, prefill_rows)
from unified_kv import release_slots

# Sampling streams: a request's prefill draw and its decode draws at one position differ.
_PREFILL_STREAM, _DECODE_STREAM = 0, 1


@flax.struct.dataclass
class StepBatch:
    """Attributes:
      reset_slots: i32[num_slots]; slots emptied first (dummy slot pads).
      prefill_slots: i32[P]; prefill_tokens: i32[P, T]; prefill_lens: i32[P]
        (0 = padding); prefill_last: bool[P], the chunk ends its prompt. P may be 0.
      decode_slots: i32[num_slots]; rows to decode (dummy slot pads).
      temperatures: f32[num_slots + 1]; seeds: u32[num_slots + 1], per slot.
    """

    reset_slots: jax.Array
    prefill_slots: jax.Array
    prefill_tokens: jax.Array
    prefill_lens: jax.Array
    prefill_last: jax.Array
    decode_slots: jax.Array
    temperatures: jax.Array
    seeds: jax.Array


@flax.struct.dataclass
class StepOutputs:
    """Attributes:
      first_tokens: i32[P]; prefill_ok: bool[P].
      out_tokens: i32[num_slots, block_size]; num_out: i32[num_slots];
      decode_ok: bool[num_slots] (False: the row could not get pages, a bug in admission).
    """

    first_tokens: jax.Array
    prefill_ok: jax.Array
    out_tokens: jax.Array
    num_out: jax.Array
    decode_ok: jax.Array


def reset_slots(cfg: StepConfig, state: SpecState, slot_ids) -> SpecState:
    """Empty slots: pages back to the free lists, lengths 0, not running."""
    return state.replace(kv=release_slots(cfg.spec, state.kv, slot_ids),
                         running=state.running.at[slot_ids].set(False))


@_at_precision
def mixed_step(params, state: SpecState, batch: StepBatch, *, cfg: StepConfig,
               table_width: int, decode: bool, speculative: bool,
               greedy: bool) -> tuple[SpecState, StepOutputs]:
    """Run one `StepBatch`. `decode` False skips decoding (no running rows);
    P = 0 prefill rows skips prefill. Static: `table_width` (pages every row's
    table holds, prefill and decode alike: one width keeps compiles few),
    `decode`, `speculative`, `greedy`."""
    state = reset_slots(cfg, state, batch.reset_slots)
    kv = state.kv
    num_slots, block = batch.decode_slots.shape[0], cfg.block_size
    first = jnp.zeros((0,), jnp.int32)
    prefill_ok = jnp.zeros((0,), bool)
    if batch.prefill_slots.shape[0]:
        ids = batch.prefill_slots
        sampler = Sampler.per_row(batch.temperatures[ids], batch.seeds[ids],
                                  kv.target_lens[ids] + batch.prefill_lens, greedy=greedy,
                                  stream=_PREFILL_STREAM)
        state, first, prefill_ok = prefill_rows(
            params, state, ids, batch.prefill_tokens, batch.prefill_lens, batch.prefill_last,
            sampler, cfg=cfg, table_width=table_width)
    out_tokens = jnp.zeros((num_slots, block), jnp.int32)
    num_out = jnp.zeros((num_slots,), jnp.int32)
    decode_ok = jnp.ones((num_slots,), bool)
    if decode:
        ids = batch.decode_slots
        sampler = Sampler.per_row(batch.temperatures[ids], batch.seeds[ids],
                                  state.kv.target_lens[ids], greedy=greedy,
                                  stream=_DECODE_STREAM)
        if speculative:
            state, out_tokens, num_out, decode_ok = decode_rows(
                params, state, ids, sampler, cfg=cfg, table_width=table_width)
        else:
            state, token, decode_ok = plain_decode_rows(params, state, ids, sampler, cfg=cfg,
                                                        table_width=table_width)
            live = (ids != cfg.spec.dummy_slot) & state.running[ids] & decode_ok
            out_tokens, num_out = token[:, None], jnp.where(live, 1, 0).astype(jnp.int32)
    return state, StepOutputs(first, prefill_ok, out_tokens, num_out, decode_ok)
