"""The single-temperature steps: every real row of a call at one temperature, keys split
from one key, every row treated as running. What tests, evaluation and benchmarks drive
directly; the engine runs `drafter/mixed_step.py`'s per-row steps instead."""

from __future__ import annotations

from drafter.sampling import Sampler
from drafter.steps import (StepConfig, StepState, at_precision, idle_dummy, decode_rows,
                           plain_decode_rows, prefill_rows)


@at_precision
def prefill_step(params, state: StepState, slot_ids, tokens, num_tokens, is_last, key, *,
                 cfg: StepConfig, table_width: int, temperature: float = 0.0):
    """`prefill_rows` with every row at one temperature (keys split from `key`)."""
    sampler = Sampler.uniform(slot_ids.shape[0], temperature, key)
    return prefill_rows(params, state, slot_ids, tokens, num_tokens, is_last, sampler, cfg=cfg,
                        table_width=table_width)


def _uniform_running(cfg, state, slot_ids):
    """The single-temperature steps treat every real row in `slot_ids` as running."""
    real = slot_ids != cfg.spec.dummy_slot
    return state.replace(running=idle_dummy(cfg, state.running.at[slot_ids].set(
        real | state.running[slot_ids])))


@at_precision
def decode_step(params, state: StepState, slot_ids, key, *, cfg: StepConfig, table_width: int,
                temperature: float = 0.0):
    """`decode_rows` for every real row of `slot_ids`, at one temperature."""
    state = _uniform_running(cfg, state, slot_ids)
    return decode_rows(params, state, slot_ids,
                       Sampler.uniform(slot_ids.shape[0], temperature, key), cfg=cfg,
                       table_width=table_width)


@at_precision
def plain_decode_step(params, state: StepState, slot_ids, key, *, cfg: StepConfig,
                      table_width: int, temperature: float = 0.0):
    """`plain_decode_rows` for every real row of `slot_ids`, at one temperature."""
    state = _uniform_running(cfg, state, slot_ids)
    return plain_decode_rows(params, state, slot_ids,
                             Sampler.uniform(slot_ids.shape[0], temperature, key), cfg=cfg,
                             table_width=table_width)
