"""The executor's KV calls: import, export and redraft (a part of `Executor`, split out as
vLLM's model runner splits its KV-connector calls: they thread the executor's state).

    import_payloads   arrived payloads into their slots, grouped by page bucket; in
                      private mode one redraft for them all
    export_prefilled  a context worker's requests whose prefill ended, as `Export`s (their
                      prompt's and first token's log-probabilities with them)
    warm_transfers    compile both, per page bucket
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from drafter.kv_io import Export, KVPayload, export_payloads, sent_pool_ids, transfer_shapes
from drafter.mixed_step import first_logprobs_bits, prompt_logprobs_bits
from drafter.scheduler import StepPlan, row_shapes
from drafter.transfer_calls import call_groups, call_rows, pack_import_index
from unified_kv import BAD_PAGE_INDEX


class KVCalls:
    """`Executor`'s import, export and redraft calls, over its state, programs and per-slot
    arrays (set up by `Executor.__init__`)."""

    def _import(self, state, index, payloads, **static):
        """The jitted import (of its variant's copies, the one whose turn it is)."""
        variant = (tuple(sorted(static.items())), len(payloads),
                   tuple(b.shape for b in payloads[0][2]))
        return self._imports(variant, state, index, payloads, **static)

    def _export(self, state, index, **static):
        """The jitted export (of its variant's copies, the one whose turn it is)."""
        return self._exports((tuple(sorted(static.items())), index.shape), state, index,
                             **static)

    def import_payloads(self, arrivals, reset_slots=()) -> list[jax.Array]:
        """Dispatch `import_step` for each arrived payload (the first call empties
        `reset_slots` before it imports), then, in private mode, one `redraft_step` for
        them all (in shared mode each arrives with its sender's draft block).

        arrivals: (slot, payload, Request) per request (its sampling parameters, and its
        prompt for a repetition penalty's marks). Returns per request its ok (bool[] on
        the device), in order.
        """
        resets = self._no_slots()
        resets[:len(reset_slots)] = reset_slots
        for slot in reset_slots:
            self.len_bound[slot] = 0
        for slot, payload, request in arrivals:
            self.sampling.set(slot, request)
            self._mark_prompt(slot, request)
            self.len_bound[slot] = payload.target_len
            self.bytes_imported += payload.nbytes
        out = [None] * len(arrivals)
        keys = [tuple(len(p) for p in payload.logical_pages) for _, payload, _ in arrivals]
        for key, idx, padded in call_groups(keys, self.transfer_rows):
            rows = [arrivals[i][:2] for i in idx] + [(self.spec.dummy_slot,
                                                      self._empty_payload(key))] * (
                padded - len(idx))
            for i, ok in zip(idx, self._import_rows(rows, resets)):
                out[i] = ok
            resets = self._no_slots()
        if arrivals and self._redrafts:
            slots = self._no_slots()
            slots[:len(arrivals)] = [slot for slot, _, _ in arrivals]
            longest = max(payload.target_len for _, payload, _ in arrivals)
            self._redraft_rows(slots, self.table_width(longest + self.cfg.block_size))
        return out

    def export_prefilled(self, plan: StepPlan, outputs: list) -> list[Export]:
        """A context worker's step, dispatched as `run` returned `outputs`: keep each
        chunk's prompt log-probabilities (sliced on the device) for requests that ask,
        and export the requests whose prefill ended (`plan.exports`), those and their
        first token's log-probabilities leaving with the KV."""
        if not plan.prefill:
            return []
        packed, layout = outputs[0]   # the prefill call's
        layout = dict(layout, block_size=self.cfg.block_size)
        leaving = []
        for i, chunk in enumerate(plan.prefill):
            seq = chunk.seq
            if chunk.start == 0:
                self._prompt_parts[seq.slot] = []
            if seq.request.params.prompt_logprobs is not None:
                self._prompt_parts[seq.slot].append((prompt_logprobs_bits(packed, i, **layout),
                                                     chunk.num_tokens - chunk.is_last))
            if seq in plan.exports:
                leaving.append((i, seq))
        if not leaving:
            return []
        payloads = self.export([(seq.slot, len(seq.request.prompt)) for _, seq in leaving])
        return [Export(seq.request, dataclasses.replace(
                    payload, prompt_logprobs=tuple(self._prompt_parts.pop(seq.slot)),
                    first_logprobs=first_logprobs_bits(packed, i, **layout)
                    if seq.request.params.logprobs is not None else None), seq.submitted)
                for (i, seq), payload in zip(leaving, payloads)]

    def export(self, rows) -> list[KVPayload]:
        """Dispatch `export_step` for slots whose prefill just ended (in a step already
        dispatched), `transfer_rows` a call. rows: (slot, prompt_len) per request."""
        with_draft = self.cfg.draft is not None
        return export_payloads(self.spec, self.state, [(slot, n, n if with_draft else 0)
                                                       for slot, n in rows],
                               mode=self.mode, export=self._counted_export,
                               rows_per_call=self.transfer_rows)

    def warm_transfers(self, lengths, *, exports: bool, imports: bool) -> int:
        """Compile the export and/or import calls of prompts of `lengths` tokens (per
        page bucket, of every row count a call pads to) and, in private mode, the redraft
        of each table width they use. The calls take the dummy slot, as calls that
        change nothing. Returns the number of buckets."""
        with_draft = self.cfg.draft is not None
        shapes = transfer_shapes(self.spec, self.mode, lengths, with_draft=with_draft)
        dummy = self.spec.dummy_slot
        for buckets, n in shapes.items():
            for rows in row_shapes(call_rows(buckets, self.transfer_rows)):
                for _ in self._exports.copies if exports else ():
                    self.export([(dummy, n)] * rows)
                for _ in self._imports.copies if imports else ():
                    self._import_rows([(dummy, self._empty_payload(buckets))] * rows,
                                      self._no_slots())
        if imports and self._redrafts:
            block = self.cfg.block_size
            for width in sorted({self.table_width(n + block) for n in lengths}):
                self._redraft_rows(self._no_slots(), width)
        return len(shapes)

    def _counted_export(self, *args, **kwargs):
        self.calls["export"] += 1
        return self._export(*args, **kwargs)

    def _import_rows(self, rows, resets) -> tuple:
        """One `import_step` call for (slot, payload) rows of one page bucket. Scalars
        are put on this worker's devices first when they came as host values, so every
        arrival of one page bucket runs one compiled program."""
        index, payloads = [], []
        for slot, payload in rows:
            first, drafts, sums = payload.first_token, payload.drafts, payload.checksums
            if self.mode != "shared":  # any sender's block (none, without a drafter)
                drafts = self._no_drafts
            if not isinstance(first, jax.Array):
                first = jax.device_put(np.int32(first), self._scalar_sharding)
            if not isinstance(drafts, jax.Array):
                drafts = jax.device_put(np.asarray(drafts, np.int32), self._scalar_sharding)
            if not isinstance(sums, jax.Array):
                sums = jax.device_put(np.asarray(sums, np.uint32), self._scalar_sharding)
            index.append((slot, payload.target_len, payload.draft_ctx_len,
                          payload.logical_pages))
            payloads.append((first, drafts, payload.buffers, sums))
        self.calls["import"] += 1
        # the index goes as a host array, transferred by the call itself
        self.state, oks = self._import(self.state, pack_import_index(resets, index),
                                       tuple(payloads), pool_ids=tuple(rows[0][1].pool_ids),
                                       mode=self.mode)
        return oks

    def _redraft_rows(self, slots, table_width: int) -> None:
        self.calls["redraft"] += 1
        self.state = self._redraft(self.params, self.state, slots, table_width=table_width)

    def _empty_payload(self, buckets) -> KVPayload:
        """A payload of these page buckets, placed as arrivals are, with no pages (made
        once a bucket: padding rows of import calls)."""
        if buckets in self._empty_payloads:
            return self._empty_payloads[buckets]
        pool_ids, pools = sent_pool_ids(self.spec, self.mode), self.state.kv.pools
        buffers = tuple(jax.device_put(np.zeros((pools[i].shape[0], n, *pools[i].shape[2:]),
                                                pools[i].dtype), self._buffer_sharding)
                        for i, n in zip(pool_ids, buckets))
        logical = tuple(np.full(n, BAD_PAGE_INDEX, np.int32) for n in buckets)
        put = functools.partial(jax.device_put, device=self._scalar_sharding)
        payload = KVPayload(0, 0, put(np.int32(0)), self._no_drafts, pool_ids, logical,
                            buffers, put(np.zeros(len(pool_ids), np.uint32)), self.mode)
        self._empty_payloads[buckets] = payload
        return payload
