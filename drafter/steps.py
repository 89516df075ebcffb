"""Jitted prefill / speculative decode / plain decode steps over the unified cache.

Each step is a pure function `(params, SpecState, batch) -> (SpecState, outputs)`
meant for `jax.jit` with the state donated and `StepConfig` static. Page
assignment, acceptance and window retirement all happen inside the step, so
rows accept different counts with no host round trip.

One speculative decode step for a row with committed length p (block B = K+1):

    positions   p        p+1      ...  p+K
    verify in   anchor   d_1      ...  d_K        target writes KV for all B
    target out  y_0      y_1      ...  y_K
    accept a = longest prefix with d_i == y_{i-1};  emit d_1..d_a, y_a
    commit      target_len = draft_ctx_len = p + a + 1
    draft ctx   KV for positions p .. p+a from the verify pass's features
    next        anchor = y_a at p+a+1; draft block -> d'_1..d'_K
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from drafter.dflash import DFlashConfig, draft_block, write_context
from models.attention import resolve_impl
from models.qwen3 import Qwen3Config, forward
from pallas_kernels.batch_tables import (bucket_width, build_batch_tables,
                                         build_batch_tables_reference)
from unified_kv import CacheSpec, KVState, allocate_pages, grow, retire_window_pages


TABLE_BUILDS = ("batch", "full_capacity")


@flax.struct.dataclass
class SpecState:
    """Attributes:
      kv: the unified cache.
      anchors: i32[num_slots + 1], each slot's last committed token (its KV not
        yet in the cache; the next step's first input).
      drafts: i32[num_slots + 1, block_size - 1], drafts following the anchor.
    """

    kv: KVState
    anchors: jax.Array
    drafts: jax.Array


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static configuration of the steps (hashable: a jit static argument)."""

    target: Qwen3Config
    spec: CacheSpec
    draft: DFlashConfig | None = None
    impl: str = "auto"
    # "batch": tables for the batch's rows only (the design). "full_capacity":
    # rebuild every slot's full-width table each step, then pick the rows; the
    # cost the design removes, kept to measure it (bench_cache_layouts.py).
    table_build: str = "batch"
    # f32 matmuls at full precision. On GPUs XLA's default rounds f32 inputs to
    # TF32, and the 1-token plain step and the K+1-token verify then round
    # differently enough to flip near-tied argmaxes: greedy speculative output
    # would stop matching plain greedy decoding. bf16 weights cost nothing extra.
    matmul_precision: str = "highest"

    def __post_init__(self):
        if self.table_build not in TABLE_BUILDS:
            raise ValueError(f"StepConfig.table_build={self.table_build!r} is unknown; "
                             f"use one of {TABLE_BUILDS}")

    @property
    def block_size(self) -> int:
        return self.draft.block_size if self.draft is not None else 1


def _at_precision(step):
    """Trace `step` under its StepConfig's matmul precision."""
    @functools.wraps(step)
    def traced(*args, cfg: StepConfig, **kwargs):
        with jax.default_matmul_precision(cfg.matmul_precision):
            return step(*args, cfg=cfg, **kwargs)
    return traced


def init_spec_state(cfg: StepConfig, kv: KVState) -> SpecState:
    slots = cfg.spec.num_slots + 1
    return SpecState(kv=kv, anchors=jnp.zeros((slots,), jnp.int32),
                     drafts=jnp.zeros((slots, max(cfg.block_size - 1, 1)), jnp.int32))


def batch_tables(cfg: StepConfig, kv: KVState, slot_ids, table_width: int):
    """Every pool's table for this batch's rows (one kernel launch)."""
    spec = cfg.spec
    scales = tuple(p.page_index_scale for p in spec.pools)
    impl = resolve_impl(cfg.impl)
    rows, width = slot_ids, table_width
    if cfg.table_build == "full_capacity":
        rows = jnp.arange(spec.num_slots + 1, dtype=jnp.int32)
        width = bucket_width(spec.max_pages_per_seq, spec.max_pages_per_seq)
    if impl == "reference":
        tables = build_batch_tables_reference(rows, kv.page_tables, table_width=width,
                                              scales=scales)
    else:
        tables = build_batch_tables(rows, kv.page_tables, table_width=width, scales=scales,
                                    interpret=impl == "interpret")
    if cfg.table_build == "full_capacity":
        tables = tuple(t[slot_ids, :table_width] for t in tables)
    return tables


def sample(logits, temperature: float, key):
    """Greedy at temperature 0, else a draw from softmax(logits / T). logits [..., V]."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _draft(params, cfg, kv, tables, anchors, ctx_lens, active):
    drafts, _ = draft_block(params["draft"], cfg.draft, params["target"], cfg.target, cfg.spec,
                            kv.pools, tables, anchors, ctx_lens, active, impl=cfg.impl)
    return drafts


@_at_precision
def prefill_step(params, state: SpecState, slot_ids, tokens, num_tokens, is_last, key, *,
                 cfg: StepConfig, table_width: int, temperature: float = 0.0):
    """Prefill one chunk per row: target KV, draft context KV, and on a row's
    last chunk its first token (the anchor) and first draft block.

    Args:
      slot_ids: i32[B]; tokens: i32[B, T]; num_tokens: i32[B] (0 = padding);
      is_last: bool[B] the chunk ends the prompt.
    Returns:
      (state, first_tokens i32[B], ok bool[B]); a row with ok False changed nothing.
    """
    spec, kv = cfg.spec, state.kv
    active = slot_ids != spec.dummy_slot
    starts = kv.target_lens[slot_ids]
    ends = starts + num_tokens
    kv, ok = grow(spec, kv, slot_ids, ends, ends)
    num_tokens = jnp.where(ok, num_tokens, 0)
    tables = batch_tables(cfg, kv, slot_ids, table_width)
    feature_layers = cfg.draft.target_layer_ids if cfg.draft else ()
    logits, pools, feats = forward(params["target"], cfg.target, spec, kv.pools, tables, tokens,
                                   starts, num_tokens, feature_layers=feature_layers,
                                   impl=cfg.impl)
    if cfg.draft is not None:
        pools = write_context(params["draft"], cfg.draft, spec, pools, tables, feats, starts,
                              num_tokens)
    kv = kv.replace(pools=pools)
    last = jnp.take_along_axis(logits, jnp.maximum(num_tokens - 1, 0)[:, None, None], axis=1)
    first = sample(last[:, 0], temperature, key)
    done = is_last & active & ok
    anchors = state.anchors.at[slot_ids].set(jnp.where(done, first, state.anchors[slot_ids]))
    drafts = state.drafts
    if cfg.draft is not None:
        new = _draft(params, cfg, kv, tables, first, ends, done)
        drafts = drafts.at[slot_ids].set(jnp.where(done[:, None], new, drafts[slot_ids]))
    kv = retire_window_pages(spec, kv, slot_ids)
    return SpecState(kv=kv, anchors=anchors, drafts=drafts), first, ok


def accept(logits, drafts, temperature: float, key):
    """How many drafts each row accepts, and the token that follows them.

    Greedy: the longest prefix with d_i == argmax y_{i-1}; the bonus is
    y_a. Sampling (drafts are argmax, a one-hot proposal): accept d_i with
    probability P_{i-1}(d_i); at the first rejection draw from P with d_i
    removed; if all pass, draw the bonus from P_K. Both are lossless.
    Returns (accepted i32[B], bonus i32[B]).
    """
    batch, block, _ = logits.shape
    if temperature == 0.0:
        y = jnp.argmax(logits, axis=-1).astype(jnp.int32)                 # [B, K+1]
        match = drafts == y[:, :-1]
        accepted = jnp.cumprod(match, axis=1).sum(axis=1).astype(jnp.int32)
        return accepted, jnp.take_along_axis(y, accepted[:, None], axis=1)[:, 0]
    key_u, key_s = jax.random.split(key)
    probs = jax.nn.softmax(logits / temperature, axis=-1)                 # [B, K+1, V]
    p_draft = jnp.take_along_axis(probs[:, :-1], drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(key_u, p_draft.shape)
    accepted = jnp.cumprod(u < p_draft, axis=1).sum(axis=1).astype(jnp.int32)
    p_next = jnp.take_along_axis(probs, accepted[:, None, None], axis=1)[:, 0]   # [B, V]
    rejected = jnp.take_along_axis(
        jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1),
        accepted[:, None], axis=1)[:, 0]
    residual = jnp.where((accepted < block - 1)[:, None]
                         & (jnp.arange(probs.shape[-1])[None] == rejected[:, None]), 0.0, p_next)
    bonus = jax.random.categorical(key_s, jnp.log(residual), axis=-1).astype(jnp.int32)
    return accepted, bonus


def emitted_tokens(tokens, accepted, bonus):
    """i32[B, K+1]: the accepted drafts tokens[:, 1:a+1], then the bonus, then 0s."""
    cols = jnp.arange(tokens.shape[1])[None]
    out = jnp.where(cols < accepted[:, None],
                    jnp.concatenate([tokens[:, 1:], bonus[:, None]], axis=1), 0)
    return jnp.where(cols == accepted[:, None], bonus[:, None], out)


@_at_precision
def decode_step(params, state: SpecState, slot_ids, key, *, cfg: StepConfig, table_width: int,
                temperature: float = 0.0):
    """One speculative step: verify, accept, commit, extend draft context, draft.

    Returns:
      (state, out_tokens i32[B, block_size], num_out i32[B], ok bool[B]);
      out_tokens[b, :num_out[b]] are the committed tokens (accepted drafts,
      then the bonus). Padding rows and rows with ok False emit nothing.
    """
    spec, kv, block = cfg.spec, state.kv, cfg.block_size
    active = slot_ids != spec.dummy_slot
    p = kv.target_lens[slot_ids]
    kv, ok = allocate_pages(spec, kv, slot_ids, p + block, p + block)
    live = active & ok
    tokens = jnp.concatenate([state.anchors[slot_ids][:, None], state.drafts[slot_ids]], axis=1)
    tables = batch_tables(cfg, kv, slot_ids, table_width)
    verify_len = jnp.where(live, block, 0).astype(jnp.int32)
    logits, pools, feats = forward(params["target"], cfg.target, spec, kv.pools, tables, tokens,
                                   p, verify_len, feature_layers=cfg.draft.target_layer_ids,
                                   impl=cfg.impl)
    accepted, bonus = accept(logits, tokens[:, 1:], temperature, key)
    num_out = jnp.where(live, accepted + 1, 0).astype(jnp.int32)
    pools = write_context(params["draft"], cfg.draft, spec, pools, tables, feats, p, num_out)
    new_len = p + num_out
    kv = kv.replace(
        pools=pools,
        target_lens=kv.target_lens.at[slot_ids].set(new_len),
        draft_ctx_lens=kv.draft_ctx_lens.at[slot_ids].set(new_len))
    out_tokens = emitted_tokens(tokens, accepted, bonus)
    drafts = _draft(params, cfg, kv, tables, bonus, new_len, live)
    kv = retire_window_pages(spec, kv, slot_ids)  # also zeroes the dummy slot's lengths
    state = SpecState(
        kv=kv,
        anchors=state.anchors.at[slot_ids].set(jnp.where(live, bonus, state.anchors[slot_ids])),
        drafts=state.drafts.at[slot_ids].set(jnp.where(live[:, None], drafts,
                                                       state.drafts[slot_ids])))
    return state, out_tokens, num_out, ok


@_at_precision
def plain_decode_step(params, state: SpecState, slot_ids, key, *, cfg: StepConfig,
                      table_width: int, temperature: float = 0.0):
    """Non-speculative decode: the anchor goes in, one new token comes out.

    Returns (state, tokens i32[B], ok bool[B]).
    """
    spec, kv = cfg.spec, state.kv
    active = slot_ids != spec.dummy_slot
    p = kv.target_lens[slot_ids]
    kv, ok = grow(spec, kv, slot_ids, p + 1, p + 1)
    live = active & ok
    tables = batch_tables(cfg, kv, slot_ids, table_width)
    logits, pools, _ = forward(params["target"], cfg.target, spec, kv.pools, tables,
                               state.anchors[slot_ids][:, None], p,
                               live.astype(jnp.int32), impl=cfg.impl)
    token = sample(logits[:, 0], temperature, key)
    kv = retire_window_pages(spec, kv.replace(pools=pools), slot_ids)
    anchors = state.anchors.at[slot_ids].set(jnp.where(live, token, state.anchors[slot_ids]))
    return state.replace(kv=kv, anchors=anchors), token, ok


@_at_precision
def redraft_step(params, state: SpecState, slot_ids, *, cfg: StepConfig, table_width: int):
    """Draft a fresh block after each row's anchor from the cache as it stands
    (a generation worker does this after receiving a request's KV)."""
    kv = state.kv
    active = slot_ids != cfg.spec.dummy_slot
    tables = batch_tables(cfg, kv, slot_ids, table_width)
    new = _draft(params, cfg, kv, tables, state.anchors[slot_ids], kv.draft_ctx_lens[slot_ids],
                 active)
    return state.replace(drafts=state.drafts.at[slot_ids].set(
        jnp.where(active[:, None], new, state.drafts[slot_ids])))
