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

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from drafter.request import MAX_LOGIT_BIAS
from drafter.sampling import LOGPROB_WIDTH, Sampler
from drafter.steps import (StepState, StepConfig, at_precision, decode_rows, empty_slots,
                           plain_decode_rows, prefill_rows)

# Sampling streams: a request's prefill draw and its decode draws at one position differ.
_PREFILL_STREAM, _DECODE_STREAM = 0, 1


@flax.struct.dataclass
class StepBatch:
    """Attributes:
      reset_slots: i32[num_slots]; slots emptied first (dummy slot pads).
      prefill_slots: i32[P]; prefill_tokens: i32[P, T]; prefill_lens: i32[P]
        (0 = padding); prefill_last: bool[P], the chunk ends its prompt; prefill_next:
        i32[P], the prompt token after the chunk (0 after a last chunk). P may be 0.
      decode_slots: i32[D]; rows to decode (dummy slot pads; D <= num_slots, padded to
        few shapes by the caller; 0 in a call that does not decode).
      temperatures: f32[num_slots + 1]; seeds: u32[num_slots + 1]; top_ks:
        i32[num_slots + 1]; top_ps, min_ps, presence_penalties, frequency_penalties,
        repetition_penalties: f32[num_slots + 1]; bias_ids, bias_until: i32[num_slots + 1,
        M], bias_values: f32[num_slots + 1, M] (M = MAX_LOGIT_BIAS in a step that
        adjusts, else 0); per slot (Sampler).
    """

    reset_slots: jax.Array
    prefill_slots: jax.Array
    prefill_tokens: jax.Array
    prefill_lens: jax.Array
    prefill_last: jax.Array
    prefill_next: jax.Array
    decode_slots: jax.Array
    temperatures: jax.Array
    seeds: jax.Array
    top_ks: jax.Array
    top_ps: jax.Array
    min_ps: jax.Array
    presence_penalties: jax.Array
    frequency_penalties: jax.Array
    repetition_penalties: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    bias_until: jax.Array

    def truncation(self, ids):
        """(top_ks, top_ps, min_ps) of slots `ids` (Sampler.per_row)."""
        return self.top_ks[ids], self.top_ps[ids], self.min_ps[ids]

    def adjustment(self, ids):
        """(presence, frequency, repetition, bias ids, bias values, bias until) of slots
        `ids` (Sampler.per_row)."""
        return (self.presence_penalties[ids], self.frequency_penalties[ids],
                self.repetition_penalties[ids], self.bias_ids[ids], self.bias_values[ids],
                self.bias_until[ids])


@flax.struct.dataclass
class StepOutputs:
    """Attributes:
      first_tokens: i32[P]; prefill_ok: bool[P].
      out_tokens: i32[decode_steps, D, block_size]; num_out: i32[decode_steps, D];
        decode_ok: bool[decode_steps, D] (False: the row could not get pages, a bug in
        admission); row d is the batch's decode_slots[d].
      first_logprobs: f32[P, W]; out_logprobs: f32[decode_steps, D, block_size, W]: each
        token's `sampling.token_logprobs`, W = LOGPROB_WIDTH in a step that returns them,
        else 0; prompt_logprobs: f32[P, T, W], those of the prompt token
        each prefill position predicts (`steps.prefill_rows`).
    """

    first_tokens: jax.Array
    prefill_ok: jax.Array
    out_tokens: jax.Array
    num_out: jax.Array
    decode_ok: jax.Array
    first_logprobs: jax.Array
    out_logprobs: jax.Array
    prompt_logprobs: jax.Array


@at_precision
def mixed_step(params, state: StepState, batch: StepBatch, *, cfg: StepConfig,
               table_width: int, speculative: bool, greedy: bool,
               truncated: bool = False, decode_steps: int = 1, logprobs: bool = False,
               adjusted: bool = False) -> tuple[StepState, StepOutputs]:
    """Run one `StepBatch`. D = 0 decode rows skips decoding, P = 0 prefill rows
    skips prefill; `decode_steps` decode steps run back to back on the device (one
    host round trip for several steps). Static: `table_width` (pages every row's table
    holds, prefill and decode alike: one width keeps compiles few), `speculative`,
    `greedy`, `truncated` (sampled rows are truncated by their top_ks / top_ps /
    min_ps: `Sampler`), `decode_steps`, `logprobs` (every emitted token's
    log-probabilities: `StepOutputs`), `adjusted` (rows' logits are adjusted by their
    penalties and logit bias: `Sampler`)."""
    state = empty_slots(cfg, state, batch.reset_slots)
    kv = state.kv
    rows, block = batch.decode_slots.shape[0], cfg.block_size
    width = LOGPROB_WIDTH if logprobs else 0
    first = jnp.zeros((0,), jnp.int32)
    prefill_ok = jnp.zeros((0,), bool)
    first_logprobs = jnp.zeros((batch.prefill_slots.shape[0], width), jnp.float32)
    prompt_logprobs = jnp.zeros((*batch.prefill_tokens.shape, width), jnp.float32)
    if batch.prefill_slots.shape[0]:
        ids = batch.prefill_slots
        sampler = Sampler.per_row(batch.temperatures[ids], batch.seeds[ids],
                                  kv.target_lens[ids] + batch.prefill_lens, greedy=greedy,
                                  stream=_PREFILL_STREAM,
                                  truncation=batch.truncation(ids) if truncated else None,
                                  adjustment=batch.adjustment(ids) if adjusted else None)
        state, first, prefill_ok, *got = prefill_rows(
            params, state, ids, batch.prefill_tokens, batch.prefill_lens, batch.prefill_last,
            sampler, cfg=cfg, table_width=table_width, logprobs=logprobs,
            next_tokens=batch.prefill_next)
        if logprobs:
            first_logprobs, prompt_logprobs = got
    out_tokens = jnp.zeros((decode_steps, rows, block), jnp.int32)
    num_out = jnp.zeros((decode_steps, rows), jnp.int32)
    decode_ok = jnp.ones((decode_steps, rows), bool)
    out_logprobs = jnp.zeros((decode_steps, rows, block, width), jnp.float32)
    if rows:
        def one_step(state, _):
            return _decode_once(params, state, batch, cfg=cfg, table_width=table_width,
                                speculative=speculative, greedy=greedy, truncated=truncated,
                                logprobs=logprobs, adjusted=adjusted)

        if decode_steps == 1:  # no loop around the common case
            state, outs = one_step(state, None)
            out_tokens, num_out, decode_ok, out_logprobs = (x[None] for x in outs)
        else:
            state, (out_tokens, num_out, decode_ok, out_logprobs) = jax.lax.scan(
                one_step, state, None, length=decode_steps)
    return state, StepOutputs(first, prefill_ok, out_tokens, num_out, decode_ok,
                              first_logprobs, out_logprobs, prompt_logprobs)


def _decode_once(params, state, batch: StepBatch, *, cfg, table_width, speculative, greedy,
                 truncated, logprobs, adjusted):
    """One decode step of the batch's rows: (state, (tokens [S, block], num_out [S], ok [S],
    logprobs [S, block, W]))."""
    ids = batch.decode_slots
    sampler = Sampler.per_row(batch.temperatures[ids], batch.seeds[ids],
                              state.kv.target_lens[ids], greedy=greedy, stream=_DECODE_STREAM,
                              truncation=batch.truncation(ids) if truncated else None,
                              adjustment=batch.adjustment(ids) if adjusted else None)
    no_logprobs = jnp.zeros((ids.shape[0], cfg.block_size, 0), jnp.float32)
    if speculative:
        state, out_tokens, num_out, ok, *got = decode_rows(
            params, state, ids, sampler, cfg=cfg, table_width=table_width, logprobs=logprobs)
        return state, (out_tokens, num_out, ok, got[0] if logprobs else no_logprobs)
    state, token, ok, *got = plain_decode_rows(params, state, ids, sampler, cfg=cfg,
                                               table_width=table_width, logprobs=logprobs)
    live = (ids != cfg.spec.dummy_slot) & state.running[ids] & ok
    lps = got[0][:, None] if logprobs else no_logprobs[:, :1]
    return state, (token[:, None], jnp.where(live, 1, 0).astype(jnp.int32), ok, lps)


# ---------------------------------------------------------------- one transfer each way
#
# The host sends a step's batch as one i32 vector and reads its outputs as one:
# every separate array is a host <-> device copy of its own, and at small batch
# those copies, not the device, bound the step rate.
#
#   batch   [reset S | decode D | prefill slots P | lens P | last P | next P | tokens P*T |
#            temperature bits S+1 | seeds S+1 | top_k S+1 | top_p bits S+1 |
#            min_p bits S+1 | presence, frequency, repetition penalty bits S+1 each |
#            bias ids (S+1) x M | bias value bits (S+1) x M | bias until (S+1) x M]
#            (M = MAX_LOGIT_BIAS in a step that adjusts logits, else 0)
#   outputs [decode steps K x rows D x (block + 2): tokens, num_out, ok |
#            prefill P x 2: first, ok | logprob bits: K x D x block x W, then P x W,
#            then P x T x W (the prompt's)]
#            (W = LOGPROB_WIDTH in a step that returns log-probabilities, else 0)

def pack_batch(batch: StepBatch) -> np.ndarray:
    """A host StepBatch (numpy fields) as one i32 vector."""
    parts = [batch.reset_slots, batch.decode_slots, batch.prefill_slots, batch.prefill_lens,
             np.asarray(batch.prefill_last, np.int32), batch.prefill_next,
             np.asarray(batch.prefill_tokens).ravel(),
             np.asarray(batch.temperatures, np.float32).view(np.int32),
             np.asarray(batch.seeds, np.uint32).view(np.int32), batch.top_ks,
             np.asarray(batch.top_ps, np.float32).view(np.int32),
             np.asarray(batch.min_ps, np.float32).view(np.int32),
             np.asarray(batch.presence_penalties, np.float32).view(np.int32),
             np.asarray(batch.frequency_penalties, np.float32).view(np.int32),
             np.asarray(batch.repetition_penalties, np.float32).view(np.int32),
             batch.bias_ids, np.asarray(batch.bias_values, np.float32).view(np.int32),
             batch.bias_until]
    return np.concatenate([np.asarray(p, np.int32).ravel() for p in parts])


def unpack_batch(packed, *, num_slots: int, num_decode: int, num_prefill: int, chunk: int,
                 bias_width: int) -> StepBatch:
    """Inverse of `pack_batch`, inside jit."""
    sizes = [num_slots, num_decode, num_prefill, num_prefill, num_prefill, num_prefill,
             num_prefill * chunk,
             *[num_slots + 1] * 8, *[(num_slots + 1) * bias_width] * 3]
    cuts = np.cumsum(sizes)[:-1].tolist()
    (reset, decode, slots, lens, last, following, tokens, temps, seeds, top_ks, top_ps,
     min_ps, presence, frequency, repetition, bias_ids, bias_values,
     bias_until) = jnp.split(packed, cuts)
    as_f32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
    return StepBatch(reset_slots=reset, prefill_slots=slots,
                     prefill_tokens=tokens.reshape(num_prefill, chunk), prefill_lens=lens,
                     prefill_last=last.astype(bool), prefill_next=following,
                     decode_slots=decode,
                     temperatures=as_f32(temps),
                     seeds=jax.lax.bitcast_convert_type(seeds, jnp.uint32),
                     top_ks=top_ks, top_ps=as_f32(top_ps), min_ps=as_f32(min_ps),
                     presence_penalties=as_f32(presence), frequency_penalties=as_f32(frequency),
                     repetition_penalties=as_f32(repetition),
                     bias_ids=bias_ids.reshape(num_slots + 1, bias_width),
                     bias_values=as_f32(bias_values).reshape(num_slots + 1, bias_width),
                     bias_until=bias_until.reshape(num_slots + 1, bias_width))


def pack_outputs(out: StepOutputs):
    decode = jnp.concatenate([out.out_tokens, out.num_out[..., None],
                              out.decode_ok[..., None].astype(jnp.int32)], axis=-1)
    prefill = jnp.stack([out.first_tokens, out.prefill_ok.astype(jnp.int32)], axis=1)
    logprob_bits = [jax.lax.bitcast_convert_type(x, jnp.int32).ravel()
                    for x in (out.out_logprobs, out.first_logprobs, out.prompt_logprobs)]
    return jnp.concatenate([decode.ravel(), prefill.ravel(), *logprob_bits])


def _output_sizes(*, num_decode: int, block_size: int, decode_steps: int, num_prefill: int,
                  chunk: int, logprobs: bool) -> list[int]:
    """Sizes of the packed outputs' five parts, in order."""
    width = LOGPROB_WIDTH if logprobs else 0
    return [decode_steps * num_decode * (block_size + 2), num_prefill * 2,
            decode_steps * num_decode * block_size * width, num_prefill * width,
            num_prefill * chunk * width]


def first_logprobs_bits(packed, row: int, **layout):
    """Prefill row `row`'s first-token `token_logprobs` as i32 bits [LOGPROB_WIDTH], sliced
    from a call's packed outputs where they lie (a device array stays one: no read).
    `layout`: `unpack_outputs`'s keywords, log-probabilities on."""
    start = sum(_output_sizes(**layout)[:3]) + row * LOGPROB_WIDTH
    return packed[start:start + LOGPROB_WIDTH]


def prompt_logprobs_bits(packed, row: int, **layout):
    """Prefill row `row`'s prompt `token_logprobs` as i32 bits [T x LOGPROB_WIDTH] (every
    position of its chunk; the valid ones first), sliced as `first_logprobs_bits`."""
    size = layout["chunk"] * LOGPROB_WIDTH
    start = sum(_output_sizes(**layout)[:4]) + row * size
    return packed[start:start + size]


def unpack_outputs(packed: np.ndarray, *, num_decode: int, block_size: int,
                   decode_steps: int, num_prefill: int, chunk: int,
                   logprobs: bool) -> StepOutputs:
    """Inverse of `pack_outputs`, on the host."""
    width = LOGPROB_WIDTH if logprobs else 0
    sizes = _output_sizes(num_decode=num_decode, block_size=block_size,
                          decode_steps=decode_steps, num_prefill=num_prefill, chunk=chunk,
                          logprobs=logprobs)
    decode, prefill, out_logprobs, first_logprobs, prompt_logprobs = np.split(
        packed, np.cumsum(sizes)[:-1])
    decode = decode.reshape(decode_steps, num_decode, block_size + 2)
    prefill = prefill.reshape(num_prefill, 2)
    return StepOutputs(first_tokens=prefill[:, 0], prefill_ok=prefill[:, 1].astype(bool),
                       out_tokens=decode[..., :block_size], num_out=decode[..., block_size],
                       decode_ok=decode[..., block_size + 1].astype(bool),
                       first_logprobs=first_logprobs.view(np.float32).reshape(num_prefill,
                                                                              width),
                       out_logprobs=out_logprobs.view(np.float32).reshape(
                           decode_steps, num_decode, block_size, width),
                       prompt_logprobs=prompt_logprobs.view(np.float32).reshape(
                           num_prefill, chunk, width))


def packed_step(params, state: StepState, packed, *, cfg: StepConfig, num_prefill: int,
                num_decode: int, table_width: int, speculative: bool, greedy: bool,
                truncated: bool = False, decode_steps: int = 1, logprobs: bool = False,
                adjusted: bool = False):
    """`mixed_step` on a packed batch, returning packed outputs."""
    batch = unpack_batch(packed, num_slots=cfg.spec.num_slots, num_decode=num_decode,
                         num_prefill=num_prefill, chunk=cfg.spec.max_step_tokens,
                         bias_width=MAX_LOGIT_BIAS if adjusted else 0)
    state, out = mixed_step(params, state, batch, cfg=cfg, table_width=table_width,
                            speculative=speculative, greedy=greedy,
                            truncated=truncated, decode_steps=decode_steps,
                            logprobs=logprobs, adjusted=adjusted)
    return state, pack_outputs(out)
