"""Jitted prefill / speculative decode / plain decode steps over the unified cache.

Each step is a pure function `(params, StepState, batch) -> (StepState, outputs)`
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
from drafter.sampling import (Sampler, accept, adjust, adjusted_drafts, emitted_tokens,
                              first_counts, sample, token_logprobs)
from models.attention import resolve_impl
from models.qwen3 import Qwen3Config, at_index, forward, lm_head, run_layers
from pallas_kernels.batch_tables import build_batch_tables, build_batch_tables_reference
from unified_kv import (CacheSpec, KVState, allocate_pages, grow, release_slots,
                        retire_window_pages)


# Deepest model a GPU step unrolls under layer_loop="auto" (docs/decisions.md, Layers in
# a step): an unrolled step's compile time grows with depth.
MAX_UNROLLED_GPU_LAYERS = 8
# XLA's default command-buffer commands on GPUs (what `graph_loops` extends)
GRAPH_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION")
# The kinds of jitted call an executor makes (`StepConfig.graph_calls`)
CALL_KINDS = ("prefill", "decode", "import", "export")
# XLA forms a command buffer only from a run of at least this many commands: above any
# program's length, so a call left out of `graph_calls` launches its kernels one by one
NO_GRAPH_MIN_COMMANDS = 1 << 30


@flax.struct.dataclass
class StepState:
    """The device state every step threads through (donated): the cache and each
    slot's decode position.

    Attributes:
      kv: the unified cache.
      anchors: i32[num_slots + 1], each slot's last committed token (its KV not
        yet in the cache; the next step's first input).
      drafts: i32[num_slots + 1, block_size - 1], drafts following the anchor.
      running: bool[num_slots + 1], the slot holds a request that decodes: set
        when its prefill or KV import completes, cleared when the slot is reset.
        Decode steps skip rows that are not running, so a failed import or a
        finished request in a step dispatched ahead never grows state.
      output_counts: i32[num_slots + 1, vocab], how often each token occurs among the
        slot's generated tokens (its first token included). Kept for the rows of steps
        that adjust logits (`Sampler.adjusted`: a penalized request's every call is one)
        and set by every import; other rows' counts are stale, and nothing reads them.
      prompt_seen: bool[num_slots + 1, vocab], the tokens each slot's prompt holds, for
        a repetition penalty (set by `drafter/seen.py`'s call as such a request takes its
        slot; other rows' are stale, and nothing reads them).
    """

    kv: KVState
    anchors: jax.Array
    drafts: jax.Array
    running: jax.Array
    output_counts: jax.Array
    prompt_seen: jax.Array


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static configuration of the steps (hashable: a jit static argument)."""

    target: Qwen3Config
    spec: CacheSpec
    draft: DFlashConfig | None = None
    impl: str = "auto"
    # "auto" (`matmul_precision_for`): f32 weights get f32-exact matmuls (GPUs' default
    # TF32 rounds a 1-token step and a K+1-token verify apart at near-tied argmaxes);
    # bf16 weights the default, which loses them no exactness and keeps the 1-row
    # step's matmuls in cuBLAS (docs/decisions.md, Exactness).
    matmul_precision: str = "auto"
    # How a step runs a model's layers (models/layers.py): "scan" compiles one
    # body per run of alike layers, over stacked weights read by a traced index;
    # "unrolled" traces every layer over its own weight arrays. "auto": unrolled on
    # GPUs for models of at most MAX_UNROLLED_GPU_LAYERS layers (Triton matmuls beat
    # the cuBLAS ones a GPU scan needs, `compiler_options`), scan for deeper ones
    # (an unrolled 36-layer step compiles for about a minute per program) and on
    # every other backend.
    layer_loop: str = "auto"
    # Target layers per loop trip when they scan (lax.scan's unroll): fewer trips, a
    # body that many layers long; the same arithmetic.
    scan_unroll: int = 1
    # On GPUs, XLA's command buffers (CUDA graphs) also take while loops and
    # conditionals (scanned layers, a call's decode steps): a loop then launches as
    # graph nodes, not kernel by kernel from the host. Off: it moved neither the
    # demo's serving nor the 8B-shaped steps (docs/decisions.md, Serving).
    graph_loops: bool = False
    # Copies of each step, import and export program an executor alternates between,
    # call by call (a private-mode redraft runs one program). A CUDA graph holds its
    # buffers' addresses, and XLA records it again whenever one moved; with one step in
    # flight ahead a call's output never sits where the last call's did, but may sit
    # where the call before last put its own. One: the copies did not stop the records
    # and double the steps' compiles (docs/decisions.md, Serving).
    graph_copies: int = 1
    # The kinds of call (CALL_KINDS) whose programs launch as CUDA graphs on GPUs; the
    # others launch their kernels one by one. A transfer's buffers are new every call,
    # so its graph is recorded every time; every kind stays a graph all the same, since
    # launching a transfer kernel by kernel made the handoff slower (docs/decisions.md,
    # Serving).
    graph_calls: tuple[str, ...] = CALL_KINDS

    @property
    def scans_layers(self) -> bool:
        return scans_layers(self.layer_loop, self.target, self.draft)

    @property
    def compiler_options(self) -> dict:
        """XLA options the jitted steps compile with. Scanned layers on GPUs take
        cuBLAS matmuls fused with their weight slice (dynamic-slice fusion): XLA's
        Triton matmuls cannot read a slice of the stacked weights in place, so each
        layer's weights would be copied out of the stack before use. With
        `graph_loops`, command buffers take while loops and conditionals too."""
        if jax.default_backend() != "gpu":
            return {}
        out = {}
        if self.scans_layers:
            out.update(xla_gpu_enable_triton_gemm=False, xla_gpu_enable_dynamic_slice_fusion=True)
        if self.graph_loops:
            out["xla_gpu_enable_command_buffer"] = ",".join(GRAPH_COMMANDS + ("WHILE", "CONDITIONAL"))
        return out

    def compiler_options_for(self, kind: str) -> dict:
        """`compiler_options` for the programs of one kind of call (CALL_KINDS): on GPUs,
        a kind left out of `graph_calls` forms no command buffer."""
        unknown = sorted(set(self.graph_calls) - set(CALL_KINDS) | {kind} - set(CALL_KINDS))
        if unknown:
            raise ValueError(f"graph_calls: unknown call kind(s) {unknown}; the kinds are "
                             f"{list(CALL_KINDS)}")
        out = self.compiler_options
        if jax.default_backend() == "gpu" and kind not in self.graph_calls:
            out = dict(out, xla_gpu_graph_min_graph_size=NO_GRAPH_MIN_COMMANDS)
        return out

    @property
    def block_size(self) -> int:
        return self.draft.block_size if self.draft is not None else 1

    def device_tables(self, kv: KVState, slot_ids, table_width: int):
        """Every pool's device table for this batch's rows only, `table_width` entries
        wide, in the index the attention kernels read (one kernel launch)."""
        scales = tuple(p.page_index_scale for p in self.spec.pools)
        impl = resolve_impl(self.impl)
        if impl == "reference":
            return build_batch_tables_reference(slot_ids, kv.page_tables,
                                                table_width=table_width, scales=scales)
        return build_batch_tables(slot_ids, kv.page_tables, table_width=table_width,
                                  scales=scales, interpret=impl == "interpret")


def scans_layers(layer_loop: str, target, draft=None) -> bool:
    """Whether steps of `layer_loop` ("auto", "scan" or "unrolled") scan the layers of
    `target` (and `draft`, configs or None): "auto" scans except shallow models on GPUs
    (MAX_UNROLLED_GPU_LAYERS). Also what form a loader puts the weights in
    (`models.layers.step_params`) before any StepConfig exists."""
    if layer_loop not in ("auto", "scan", "unrolled"):
        raise ValueError(f"layer_loop {layer_loop!r} is unknown; use 'auto', 'scan' or "
                         "'unrolled'")
    if layer_loop == "auto":
        depth = max(target.num_layers, draft.num_layers if draft is not None else 0)
        return jax.default_backend() != "gpu" or depth > MAX_UNROLLED_GPU_LAYERS
    return layer_loop == "scan"


def matmul_precision_for(params, requested: str = "auto") -> str:
    """The matmul precision a step over `params` runs at: `requested`, or for
    "auto" "highest" when any floating weight is wider than 16 bits, else "default"."""
    if requested != "auto":
        return requested
    wide = any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > 2
               for x in jax.tree.leaves(params))
    return "highest" if wide else "default"


def at_precision(step):
    """Trace `step` (params first) under the matmul precision its weights call for."""
    @functools.wraps(step)
    def traced(params, *args, cfg: StepConfig, **kwargs):
        with jax.default_matmul_precision(matmul_precision_for(params, cfg.matmul_precision)):
            return step(params, *args, cfg=cfg, **kwargs)
    return traced


def init_step_state(cfg: StepConfig, kv: KVState) -> StepState:
    slots = cfg.spec.num_slots + 1
    return StepState(kv=kv, anchors=jnp.zeros((slots,), jnp.int32),
                     drafts=jnp.zeros((slots, max(cfg.block_size - 1, 1)), jnp.int32),
                     running=jnp.zeros((slots,), bool),
                     output_counts=jnp.zeros((slots, cfg.target.vocab_size), jnp.int32),
                     prompt_seen=jnp.zeros((slots, cfg.target.vocab_size), bool))


def empty_slots(cfg: StepConfig, state: StepState, slot_ids) -> StepState:
    """Empty slots: pages back to the free lists, lengths 0, not running."""
    return state.replace(kv=release_slots(cfg.spec, state.kv, slot_ids),
                         running=state.running.at[slot_ids].set(False))


def _draft(params, cfg, kv, tables, anchors, ctx_lens, active, adjustment=None):
    """The draft block after each anchor; with `adjustment` (counts, prompt_seen,
    sampler of the rows) chosen as the adjusted target would (`adjusted_drafts`)."""
    drafts, logits = draft_block(params["draft"], cfg.draft, params["target"], cfg.target,
                                 cfg.spec, kv.pools, tables, anchors, ctx_lens, active,
                                 impl=cfg.impl)
    # The anchor is at position ctx_lens; draft 0 at the one after it.
    return drafts if adjustment is None else adjusted_drafts(logits, *adjustment, ctx_lens + 1)


def prefill_rows(params, state: StepState, slot_ids, tokens, num_tokens, is_last,
                 sampler: Sampler, *, cfg: StepConfig, table_width: int,
                 logprobs: bool = False, next_tokens=None):
    """Prefill one chunk per row: target KV, draft context KV, and on a row's
    last chunk its first token (the anchor) and first draft block; the row then
    runs (`StepState.running`).

    Args:
      slot_ids: i32[B]; tokens: i32[B, T]; num_tokens: i32[B] (0 = padding);
      is_last: bool[B] the chunk ends the prompt; next_tokens: i32[B], the prompt token
      after each chunk (read with `logprobs`; any value for a last chunk).
    Returns:
      (state, first_tokens i32[B], ok bool[B]); a row with ok False changed nothing.
      With `logprobs`, a fourth: f32[B, LOGPROB_WIDTH], each first token's
      `token_logprobs`, and a fifth: f32[B, T, LOGPROB_WIDTH], the `token_logprobs` of
      the prompt token each position predicts (position j: tokens[:, j + 1], the last
      position next_tokens; a last chunk's last valid position predicts the first token,
      not a prompt token, and its row is not one).
    """
    spec, kv = cfg.spec, state.kv
    active = slot_ids != spec.dummy_slot
    starts = kv.target_lens[slot_ids]
    ends = starts + num_tokens
    kv, ok = grow(spec, kv, slot_ids, ends, ends)
    num_tokens = jnp.where(ok, num_tokens, 0)
    tables = cfg.device_tables(kv, slot_ids, table_width)
    feature_layers = cfg.draft.target_layer_ids if cfg.draft else ()
    x, pools, feats = run_layers(params["target"], cfg.target, spec, kv.pools, tables, tokens,
                                 starts, num_tokens, feature_layers=feature_layers,
                                 impl=cfg.impl, scan_unroll=cfg.scan_unroll)
    if cfg.draft is not None:
        pools = write_context(params["draft"], cfg.draft, spec, pools, tables, feats, starts,
                              num_tokens)
    kv = kv.replace(pools=pools)
    # The head at each row's last position alone, in every variant, so asking for
    # log-probabilities never changes a first token; the head over the whole chunk (a
    # matmul of vocab columns a token) runs only for a prompt's log-probabilities.
    last = lm_head(params["target"], cfg.target, at_index(x, jnp.maximum(num_tokens - 1, 0)))
    # Nothing generated yet: the first token sees its logit bias and its prompt.
    nothing = jnp.zeros((slot_ids.shape[0], 0), jnp.int32)
    first = sample(adjust(last, jnp.zeros(last.shape[::2], jnp.int32),
                          state.prompt_seen[slot_ids], nothing, sampler, ends)[:, 0], sampler)
    done = is_last & active & ok
    anchors = state.anchors.at[slot_ids].set(jnp.where(done, first, state.anchors[slot_ids]))
    counts, adjustment = state.output_counts, None
    if sampler.adjusted:
        counts = first_counts(counts, slot_ids, first, done)
        adjustment = (counts[slot_ids], state.prompt_seen[slot_ids], sampler)
    drafts = state.drafts
    if cfg.draft is not None:
        new = _draft(params, cfg, kv, tables, first, ends, done, adjustment)
        drafts = drafts.at[slot_ids].set(jnp.where(done[:, None], new, drafts[slot_ids]))
    kv = retire_window_pages(spec, kv, slot_ids)
    running = state.running.at[slot_ids].set(done | state.running[slot_ids])
    out = (state.replace(kv=kv, anchors=anchors, drafts=drafts,
                         running=idle_dummy(cfg, running), output_counts=counts), first, ok)
    if not logprobs:
        return out
    following = jnp.concatenate([tokens[:, 1:], next_tokens[:, None]], axis=1)
    return out + (token_logprobs(last[:, 0], first),
                  token_logprobs(lm_head(params["target"], cfg.target, x), following))


def idle_dummy(cfg: StepConfig, running):
    """`running` with the dummy slot (padding rows' target) never running."""
    return running.at[cfg.spec.dummy_slot].set(False)


def decode_rows(params, state: StepState, slot_ids, sampler: Sampler, *, cfg: StepConfig,
                table_width: int, logprobs: bool = False):
    """One speculative step: verify, accept, commit, extend draft context, draft.
    Rows whose slot is not running (padding, reset, failed import) do nothing.

    Returns:
      (state, out_tokens i32[B, block_size], num_out i32[B], ok bool[B]);
      out_tokens[b, :num_out[b]] are the committed tokens (accepted drafts,
      then the bonus). Rows not running and rows with ok False emit nothing.
      With `logprobs`, a fifth: f32[B, block_size, LOGPROB_WIDTH], each emitted
      token's `token_logprobs` (token j is drawn from verify position j's logits).
    """
    spec, kv, block = cfg.spec, state.kv, cfg.block_size
    active = (slot_ids != spec.dummy_slot) & state.running[slot_ids]
    p = kv.target_lens[slot_ids]
    kv, ok = allocate_pages(spec, kv, jnp.where(active, slot_ids, spec.dummy_slot),
                            p + block, p + block)
    live = active & ok
    tokens = jnp.concatenate([state.anchors[slot_ids][:, None], state.drafts[slot_ids]], axis=1)
    tables = cfg.device_tables(kv, slot_ids, table_width)
    verify_len = jnp.where(live, block, 0).astype(jnp.int32)
    logits, pools, feats = forward(params["target"], cfg.target, spec, kv.pools, tables, tokens,
                                   p, verify_len, feature_layers=cfg.draft.target_layer_ids,
                                   impl=cfg.impl, scan_unroll=cfg.scan_unroll)
    scored = adjust(logits, state.output_counts[slot_ids], state.prompt_seen[slot_ids],
                    tokens[:, 1:], sampler, p + 1)
    accepted, bonus = accept(scored, tokens[:, 1:], sampler)
    num_out = jnp.where(live, accepted + 1, 0).astype(jnp.int32)
    pools = write_context(params["draft"], cfg.draft, spec, pools, tables, feats, p, num_out)
    new_len = jnp.where(live, p + num_out, p)
    kv = kv.replace(
        pools=pools,
        target_lens=kv.target_lens.at[slot_ids].set(new_len),
        draft_ctx_lens=kv.draft_ctx_lens.at[slot_ids].set(
            jnp.where(live, new_len, kv.draft_ctx_lens[slot_ids])))
    out_tokens = emitted_tokens(tokens, accepted, bonus)
    counts, adjustment = state.output_counts, None
    if sampler.adjusted:
        kept = (jnp.arange(block)[None] < num_out[:, None]).astype(jnp.int32)
        counts = counts.at[slot_ids[:, None], out_tokens].add(kept)
        adjustment = (counts[slot_ids], state.prompt_seen[slot_ids], sampler)
    drafts = _draft(params, cfg, kv, tables, bonus, new_len, live, adjustment)
    kv = retire_window_pages(spec, kv, jnp.where(active, slot_ids, spec.dummy_slot))
    state = state.replace(
        kv=kv,
        anchors=state.anchors.at[slot_ids].set(jnp.where(live, bonus, state.anchors[slot_ids])),
        drafts=state.drafts.at[slot_ids].set(jnp.where(live[:, None], drafts,
                                                       state.drafts[slot_ids])),
        output_counts=counts)
    out = (state, out_tokens, num_out, ok | ~active)
    return out + (token_logprobs(logits, out_tokens),) if logprobs else out


def plain_decode_rows(params, state: StepState, slot_ids, sampler: Sampler, *,
                      cfg: StepConfig, table_width: int, logprobs: bool = False):
    """Non-speculative decode: the anchor goes in, one new token comes out.

    Returns (state, tokens i32[B], ok bool[B]); rows not running emit nothing. With
    `logprobs`, a fourth: f32[B, LOGPROB_WIDTH], each token's `token_logprobs`.
    """
    spec, kv = cfg.spec, state.kv
    active = (slot_ids != spec.dummy_slot) & state.running[slot_ids]
    rows = jnp.where(active, slot_ids, spec.dummy_slot)
    p = kv.target_lens[slot_ids]
    kv, ok = grow(spec, kv, rows, p + 1, p + 1)
    live = active & ok
    tables = cfg.device_tables(kv, slot_ids, table_width)
    logits, pools, _ = forward(params["target"], cfg.target, spec, kv.pools, tables,
                               state.anchors[slot_ids][:, None], p,
                               live.astype(jnp.int32), impl=cfg.impl,
                               scan_unroll=cfg.scan_unroll)
    no_drafts = jnp.zeros((slot_ids.shape[0], 0), jnp.int32)
    token = sample(adjust(logits[:, :1], state.output_counts[slot_ids],
                          state.prompt_seen[slot_ids], no_drafts, sampler, p + 1)[:, 0],
                   sampler)
    counts = state.output_counts
    if sampler.adjusted:
        counts = counts.at[slot_ids, token].add(live.astype(jnp.int32))
    kv = retire_window_pages(spec, kv.replace(pools=pools), rows)
    anchors = state.anchors.at[slot_ids].set(jnp.where(live, token, state.anchors[slot_ids]))
    out = (state.replace(kv=kv, anchors=anchors, output_counts=counts), token, ok | ~active)
    return out + (token_logprobs(logits[:, 0], token),) if logprobs else out


def redraft_rows(params, state: StepState, slot_ids, *, cfg: StepConfig, table_width: int,
                 active=None):
    """Draft a fresh block after each row's anchor from the cache as it stands
    (after a request's KV was imported)."""
    kv = state.kv
    if active is None:
        active = slot_ids != cfg.spec.dummy_slot
    tables = cfg.device_tables(kv, slot_ids, table_width)
    new = _draft(params, cfg, kv, tables, state.anchors[slot_ids], kv.draft_ctx_lens[slot_ids],
                 active)
    return state.replace(drafts=state.drafts.at[slot_ids].set(
        jnp.where(active[:, None], new, state.drafts[slot_ids])))
