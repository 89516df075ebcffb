"""The executor: a worker's device state and the jitted calls that run a step plan.

The engine decides (scheduler) and books results; the executor turns a
`StepPlan` into device calls and owns what they touch: the `StepState`
pytree (donated through every call), the parameters, and the per-slot host
arrays the calls read (sampling parameters, an upper bound of each slot's
length for table widths). It never reads device outputs itself. Its KV calls (import,
export, redraft) are drafter/executor_kv.py's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools

import jax
import numpy as np

from drafter.executor_kv import KVCalls
from drafter.kv_io import receiver_shardings
from drafter.mixed_step import StepBatch, pack_batch, unpack_outputs
from drafter.programs import (Copies, export_step_for, import_step_for, mark_step_for,
                              packed_step_for, redraft_step_for, traced_on_mesh)
from drafter.scheduler import StepPlan
from drafter.seen import pack_prompt, prompt_bucket
from drafter.slot_sampling import SlotSampling
from drafter.steps import StepConfig, init_step_state
from models.layers import step_params
from unified_kv import bucket_width, init_state


class CacheMemoryError(MemoryError):
    """The device could not hold a worker's KV cache."""


def cache_memory_message(spec, error) -> str:
    """What a failed cache allocation says: the pools' sizes, the device's memory in use
    (where it reports it), and what to change."""
    sizes = [pool.nbytes for pool in spec.pools]
    stats = jax.devices()[0].memory_stats() or {}
    held = (f"; {stats['bytes_in_use'] / 2**30:.2f} of the device's "
            f"{stats['bytes_limit'] / 2**30:.2f} GiB were in use (weights and other arrays)"
            if "bytes_limit" in stats else "")
    return (f"the KV cache does not fit on the device: its {len(sizes)} pools take "
            f"{sum(sizes) / 2**30:.2f} GiB, the largest {max(sizes) / 2**30:.2f} GiB in one "
            f"piece{held}. Give it less memory (memory_budget_bytes; serve: --kv-memory-mib "
            f"or a lower --kv-memory-fraction), fewer slots or a shorter max_seq_len; where "
            f"enough memory is free but not in one piece, make the engine before other large "
            f"arrays, or set TF_GPU_ALLOCATOR=cuda_malloc_async. ({str(error)[:300]})")


class Executor(KVCalls):
    """Args: params, cfg, mesh (None: the default device), speculative, mode
    ("shared" / "private": which pools an export sends and an import expects),
    transfer_rows (requests of one page bucket an export or import call takes; a call
    runs `padded_rows` of them), eos_token_ids (the model's end-of-sequence ids: a request's
    min_tokens bans them)."""

    def __init__(self, params, cfg: StepConfig, *, mesh, speculative: bool, mode: str,
                 transfer_rows: int = 1, eos_token_ids=()):
        self.cfg, self.spec, self.mesh = cfg, cfg.spec, mesh
        self.transfer_rows = transfer_rows
        self.speculative, self.mode = speculative, mode
        # The cache first: each pool is one array, so it needs one free block of its
        # size, which converting the weights below (copies, then frees) would break up.
        self.state = self._allocate_state()
        # Layers as the steps run them (stacked for a scan, else one dict per layer;
        # projections fused), converted once: it copies every layer weight (step-form
        # weights stay as they are, shared with whoever passed them).
        self.params = self._place(step_params(params, cfg.scans_layers))
        on_mesh = functools.partial(traced_on_mesh, mesh)
        if cfg.graph_copies < 1:
            raise ValueError(f"graph_copies is {cfg.graph_copies}; it must be at least 1")
        copies = range(cfg.graph_copies)
        self._steps = {kind: Copies(on_mesh(packed_step_for(cfg, kind, c)) for c in copies)
                       for kind in ("prefill", "decode")}
        self._imports = Copies(on_mesh(import_step_for(cfg, c)) for c in copies)
        self._exports = Copies(on_mesh(export_step_for(cfg, c)) for c in copies)
        self._redraft = on_mesh(redraft_step_for(cfg))
        self._mark = on_mesh(mark_step_for(cfg))
        self._buffer_sharding, self._scalar_sharding = receiver_shardings(mesh)
        slots = cfg.spec.num_slots + 1
        self.sampling = SlotSampling(slots, eos_token_ids)
        self.len_bound = np.zeros(slots, np.int64)  # upper bound of each slot's length
        # a context worker's: per slot, (prompt log-probability bits on the device, rows)
        # per prefill chunk so far
        self._prompt_parts: dict[int, list] = {}
        self.bytes_imported = 0
        # Jitted calls dispatched, by kind (prefill, decode, export, import, redraft): on
        # one GPU a call's host launch, not its device time, bounds small batches.
        self.calls = collections.Counter()
        # A receiver drafts its arrivals' first block itself only without the sender's
        # draft KV (private mode); in shared mode the sender's block arrives with the KV.
        self._redrafts = cfg.draft is not None and mode == "private"
        self._empty_payloads: dict = {}
        self._no_drafts = jax.device_put(np.zeros(self.state.drafts.shape[1:], np.int32),
                                         self._scalar_sharding)

    def _allocate_state(self):
        """The fresh state, allocated now (not at a later step's first read), or a
        CacheMemoryError naming the cache's size and what to change."""
        try:
            return jax.block_until_ready(self._place_state(
                init_step_state(self.cfg, init_state(self.spec, mesh=self.mesh))))
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise CacheMemoryError(cache_memory_message(self.spec, e)) from e

    def _place(self, params):
        if self.mesh is None:
            return params
        return jax.device_put(params, jax.sharding.NamedSharding(
            self.mesh, jax.sharding.PartitionSpec()))

    def _place_state(self, state):
        # Commit the fresh state where the steps' outputs will live: jit keys its
        # cache on committed-ness, and an uncommitted first state would make
        # every step compile twice on its first use.
        if self.mesh is None:
            return jax.device_put(state, jax.devices()[0])
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return state.replace(anchors=jax.device_put(state.anchors, replicated),
                             drafts=jax.device_put(state.drafts, replicated),
                             running=jax.device_put(state.running, replicated),
                             output_counts=jax.device_put(state.output_counts, replicated),
                             prompt_seen=jax.device_put(state.prompt_seen, replicated))

    def table_width(self, max_len: int) -> int:
        pages = -(-max_len // self.spec.page_size)
        return bucket_width(pages, self.spec.max_pages_per_seq, block_pages=16)

    # ------------------------------------------------------------ steps

    def run(self, plan: StepPlan, *, prefill_rows: int, decode_rows: int,
            decode_steps: int) -> list:
        """Dispatch a plan's prefill chunks (in a call of `prefill_rows` rows) and decode
        rows (in one of `decode_rows`, plan.decode's order; imports first, by
        `import_payloads`). Returns [(packed outputs, their layout)] per call, the layout
        as `unpack_outputs` takes it."""
        block = self.cfg.block_size
        for slot in plan.reset_slots:
            self.len_bound[slot] = 0
        batch = self._empty_batch(prefill_rows, 0)
        batch.reset_slots[:len(plan.reset_slots)] = plan.reset_slots
        sampled = []
        for i, chunk in enumerate(plan.prefill):
            seq, slot = chunk.seq, chunk.seq.slot
            if chunk.start == 0:
                self.sampling.set(slot, seq.request)
                self._mark_prompt(slot, seq.request)
            piece = seq.request.prompt[chunk.start:chunk.start + chunk.num_tokens]
            batch.prefill_slots[i] = slot
            batch.prefill_tokens[i, :len(piece)] = piece
            batch.prefill_lens[i] = len(piece)
            batch.prefill_last[i] = chunk.is_last
            if not chunk.is_last:   # the token its last position predicts
                batch.prefill_next[i] = seq.request.prompt[chunk.start + chunk.num_tokens]
            self.len_bound[slot] = chunk.start + chunk.num_tokens
            sampled.append(slot)
        decode_slots = self._no_slots(decode_rows)
        for row, seq in enumerate(plan.decode):
            decode_slots[row] = seq.slot
            sampled.append(seq.slot)
        k = decode_steps
        max_len = max([c.start + c.num_tokens + block for c in plan.prefill]
                      + [int(self.len_bound[s.slot]) + (k + 1) * block for s in plan.decode],
                      default=block)
        for seq in plan.decode:
            self.len_bound[seq.slot] += k * block
        variant = self.sampling.variant(sampled)
        # a prefill call's log-probabilities are also its prompt positions'
        prefill_variant = dict(variant, logprobs=variant["logprobs"] or self.sampling.wants(
            [c.seq.slot for c in plan.prefill], prompt=True))
        chunk = self.spec.max_step_tokens
        width = self.table_width(max_len)
        # Prefill chunks and decode rows of one plan go out as two calls: one
        # program holding both compiles ~2x longer per variant and multiplies
        # the variants (prefill row buckets x decode or not).
        outputs = []
        if plan.prefill or not plan.decode:
            outputs.append((self._call(batch, table_width=width, **prefill_variant),
                            dict(decode_steps=1, num_decode=0, num_prefill=prefill_rows,
                                 chunk=chunk, logprobs=prefill_variant["logprobs"])))
            batch = dataclasses.replace(batch, reset_slots=self._no_slots())
        if plan.decode:
            outputs.append((self._call(dataclasses.replace(batch, decode_slots=decode_slots,
                                                           **self._no_prefill()),
                                       table_width=width, decode_steps=k, **variant),
                            dict(decode_steps=k, num_decode=decode_rows, num_prefill=0,
                                 chunk=chunk, logprobs=variant["logprobs"])))
        return outputs

    def _mark_prompt(self, slot: int, request) -> None:
        """Dispatch the mark of `request`'s prompt in `slot` if it has a repetition
        penalty (drafter/seen.py): as it takes the slot, before any call draws for it."""
        if request.params.repetition_penalty != 1:
            self._mark_call(pack_prompt(slot, request.prompt, prompt_bucket(len(request.prompt))))

    def warm_marks(self, max_len: int) -> None:
        """Compile the mark call of every prompt bucket up to `max_len` tokens (calls on
        the dummy slot, which change nothing read)."""
        bucket = prompt_bucket(1)
        while bucket <= prompt_bucket(max_len):
            self._mark_call(pack_prompt(self.spec.dummy_slot, [], bucket))
            bucket *= 2

    def _mark_call(self, index) -> None:
        self.calls["mark"] += 1
        self.state = self._mark(self.state, index)

    def warm(self, widths, *, decode_steps, decode_rows, prefill_rows, sampled: bool,
             logprobs: bool = False, adjusted: bool = False) -> None:
        """Compile every variant, every copy of it, by calls whose rows all pad (they
        change nothing): each width, decode of each of `decode_steps` over each of
        `decode_rows`, prefill of each of `prefill_rows` (0: a call that only empties
        slots); greedy, and with `sampled` also sampling, with and without truncation;
        each of those also returning log-probabilities with `logprobs`, and each of those
        also adjusting logits (penalties, logit bias) with `adjusted`."""
        samplings = [(True, False)] + ([(False, False), (False, True)] if sampled else [])
        calls = ([(k, 0, d) for k in decode_steps for d in decode_rows]
                 + [(1, n, 0) for n in prefill_rows])
        for width, (greedy, truncated), lp, adj, (k, rows, d), _ in itertools.product(
                widths, samplings, (False, True)[:1 + logprobs], (False, True)[:1 + adjusted],
                calls, range(self.cfg.graph_copies)):
            self._call(self._empty_batch(rows, d), table_width=width, greedy=greedy,
                       truncated=truncated, decode_steps=k, logprobs=lp, adjusted=adj)

    def _call(self, batch: StepBatch, *, table_width: int, greedy: bool,
              truncated: bool = False, decode_steps: int = 1, logprobs: bool = False,
              adjusted: bool = False):
        """One jitted step on a packed batch. The batch goes as a host array, transferred
        by the call itself: a `device_put` of its own costs more host time than the
        call's transfer, and a call must always take it in one form (a host array and a
        device array of it compile apart). Only a call that adjusts logits carries the
        slots' logit bias. A call with decode rows is a decode call, one without a prefill
        call (it may only empty slots)."""
        num_decode = batch.decode_slots.shape[0]
        self.calls[self._kind(num_decode)] += 1
        if adjusted:
            batch = dataclasses.replace(batch, **self.sampling.batch_fields(adjusted=True))
        self.state, out = self._step_fn(
            self.params, self.state, pack_batch(batch),
            num_prefill=batch.prefill_slots.shape[0], num_decode=num_decode,
            table_width=table_width, speculative=self.speculative,
            greedy=greedy, truncated=truncated, decode_steps=decode_steps, logprobs=logprobs,
            adjusted=adjusted)
        return out

    def _step_fn(self, params, state, batch, **static):
        """The jitted step (of its variant's copies, the one whose turn it is)."""
        steps = self._steps[self._kind(static["num_decode"])]
        return steps(tuple(sorted(static.items())), params, state, batch, **static)

    @staticmethod
    def _kind(num_decode: int) -> str:
        return "decode" if num_decode else "prefill"

    def _empty_batch(self, num_prefill: int, num_decode: int) -> StepBatch:
        spec, dummy = self.spec, self.spec.dummy_slot
        return StepBatch(
            reset_slots=np.full(spec.num_slots, dummy, np.int32),
            prefill_slots=np.full(num_prefill, dummy, np.int32),
            prefill_tokens=np.zeros((num_prefill, spec.max_step_tokens), np.int32),
            prefill_lens=np.zeros(num_prefill, np.int32),
            prefill_last=np.zeros(num_prefill, bool),
            prefill_next=np.zeros(num_prefill, np.int32),
            decode_slots=self._no_slots(num_decode),
            **self.sampling.batch_fields(adjusted=False))

    def _no_slots(self, rows: int | None = None):
        """`rows` padding slot ids (default: one per slot)."""
        rows = self.spec.num_slots if rows is None else rows
        return np.full(rows, self.spec.dummy_slot, np.int32)

    def _no_prefill(self) -> dict:
        t = self.spec.max_step_tokens
        return dict(prefill_slots=np.zeros(0, np.int32), prefill_tokens=np.zeros((0, t), np.int32),
                    prefill_lens=np.zeros(0, np.int32), prefill_last=np.zeros(0, bool),
                    prefill_next=np.zeros(0, np.int32))

    def unpack(self, packed: list[tuple[np.ndarray, dict]]):
        """One StepOutputs from a step's calls (host arrays, with their layouts): prefill
        rows from the first call, decode rows from the last."""
        unpack = functools.partial(unpack_outputs, block_size=self.cfg.block_size)
        (p0, layout0), (p1, layout1) = packed[0], packed[-1]
        first, last = unpack(p0, **layout0), unpack(p1, **layout1)
        return dataclasses.replace(last, first_tokens=first.first_tokens,
                                   prefill_ok=first.prefill_ok,
                                   first_logprobs=first.first_logprobs,
                                   prompt_logprobs=first.prompt_logprobs)
