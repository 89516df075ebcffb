"""The executor: a worker's device state and the jitted calls that run a step plan.

The engine decides (scheduler) and books results; the executor turns a
`StepPlan` into device calls and owns what they touch: the `StepState`
pytree (donated through every call), the parameters, and the per-slot host
arrays the calls read (temperatures, seeds, an upper bound of each slot's
length for table widths). It never reads device outputs itself.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from drafter.kv_io import KVPayload, export_payloads, import_step, pow2_rows
from drafter.mixed_step import StepBatch, pack_batch, packed_step, unpack_outputs
from drafter.scheduler import StepPlan
from drafter.steps import StepConfig, init_step_state
from models.layers import stack_params, unstack_params
from unified_kv import BAD_PAGE_INDEX, bucket_width, init_state


@functools.lru_cache(maxsize=64)
def _packed_step_for(cfg: StepConfig):
    """The jitted step with `cfg` bound, shared by every executor of that config: a
    static config argument would be hashed and compared on every call."""
    return jax.jit(functools.partial(packed_step, cfg=cfg),
                   static_argnames=("num_prefill", "table_width", "decode", "speculative",
                                    "greedy", "decode_steps"), donate_argnums=1,
                   compiler_options=cfg.compiler_options)


@functools.lru_cache(maxsize=64)
def _import_step_for(cfg: StepConfig):
    return jax.jit(functools.partial(import_step, cfg=cfg),
                   static_argnames=("pool_ids", "mode", "table_width"), donate_argnums=1,
                   compiler_options=cfg.compiler_options)


def _traced_on_mesh(mesh, jitted):
    """Call `jitted` with `mesh` as the context mesh, so the Pallas kernels run
    per device over the kv heads (models/attention.py)."""
    if mesh is None:
        return jitted

    @functools.wraps(jitted)
    def call(*args, **kwargs):
        with jax.set_mesh(mesh):
            return jitted(*args, **kwargs)
    return call


class Executor:
    """Args: params, cfg, mesh (None: the default device), speculative, mode
    ("shared" / "private": which pools an export sends and an import expects)."""

    def __init__(self, params, cfg: StepConfig, *, mesh, speculative: bool, mode: str):
        self.cfg, self.spec, self.mesh = cfg, cfg.spec, mesh
        self.speculative, self.mode = speculative, mode
        # Layers as the steps run them: stacked once for a scan (stacking copies), else
        # one dict of arrays per layer.
        self.params = self._place(stack_params(params) if cfg.scans_layers
                                  else unstack_params(params))
        self.state = self._place_state(init_step_state(cfg, init_state(cfg.spec, mesh=mesh)))
        on_mesh = functools.partial(_traced_on_mesh, mesh)
        self._step_fn, self._import = on_mesh(_packed_step_for(cfg)), on_mesh(_import_step_for(cfg))
        self._export = on_mesh(export_payloads)
        self._batch_sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0])
                                if mesh is None else jax.sharding.NamedSharding(
                                    mesh, jax.sharding.PartitionSpec()))
        self._sent = (None, None)  # (host, device) copy of the last packed batch
        slots = cfg.spec.num_slots + 1
        self.temperatures = np.zeros(slots, np.float32)
        self.seeds = np.zeros(slots, np.uint32)
        self.len_bound = np.zeros(slots, np.int64)  # upper bound of each slot's length
        self.bytes_imported = 0

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
                             running=jax.device_put(state.running, replicated))

    def table_width(self, max_len: int) -> int:
        pages = -(-max_len // self.spec.page_size)
        return bucket_width(pages, self.spec.max_pages_per_seq, block_pages=16)

    def set_sampling(self, slot: int, params) -> None:
        self.temperatures[slot] = params.temperature
        self.seeds[slot] = params.seed

    # ------------------------------------------------------------ steps

    def run(self, plan: StepPlan, *, prefill_rows: int, decode_steps: int) -> list:
        """Dispatch a plan's prefill chunks and decode rows (imports first, by
        `import_payloads`). Returns [(packed outputs, decode steps)] per call."""
        block = self.cfg.block_size
        for slot in plan.reset_slots:
            self.len_bound[slot] = 0
        batch = self._empty_batch(prefill_rows)
        batch.reset_slots[:len(plan.reset_slots)] = plan.reset_slots
        sampled = []
        for i, chunk in enumerate(plan.prefill):
            seq, slot = chunk.seq, chunk.seq.slot
            if chunk.start == 0:
                self.set_sampling(slot, seq.request.params)
            piece = seq.request.prompt[chunk.start:chunk.start + chunk.num_tokens]
            batch.prefill_slots[i] = slot
            batch.prefill_tokens[i, :len(piece)] = piece
            batch.prefill_lens[i] = len(piece)
            batch.prefill_last[i] = chunk.is_last
            self.len_bound[slot] = chunk.start + chunk.num_tokens
            sampled.append(slot)
        for seq in plan.decode:
            batch.decode_slots[seq.slot] = seq.slot
            sampled.append(seq.slot)
        k = decode_steps
        max_len = max([c.start + c.num_tokens + block for c in plan.prefill]
                      + [int(self.len_bound[s.slot]) + (k + 1) * block for s in plan.decode],
                      default=block)
        for seq in plan.decode:
            self.len_bound[seq.slot] += k * block
        greedy = not np.any(self.temperatures[sampled]) if sampled else True
        width = self.table_width(max_len)
        # Prefill chunks and decode rows of one plan go out as two calls: one
        # program holding both compiles ~2x longer per variant and multiplies
        # the variants (prefill row buckets x decode or not).
        outputs = []
        if plan.prefill or not plan.decode:
            outputs.append((self._call(batch, table_width=width, decode=False, greedy=greedy),
                            1))
            batch = dataclasses.replace(batch, reset_slots=self._no_slots())
        if plan.decode:
            outputs.append((self._call(dataclasses.replace(batch, **self._no_prefill()),
                                       table_width=width, decode=True, greedy=greedy,
                                       decode_steps=k), k))
        return outputs

    def run_empty(self, *, table_width: int, decode: bool = True, decode_steps: int = 1,
                  num_prefill: int = 0, greedy: bool = True) -> None:
        """A call whose rows all pad (compiles that variant; changes nothing): a decode
        call of `decode_steps` steps, or a prefill call of `num_prefill` rows (0: a
        call that only empties slots)."""
        self._call(self._empty_batch(0 if decode else num_prefill), table_width=table_width,
                   decode=decode, greedy=greedy, decode_steps=decode_steps if decode else 1)

    def warm(self, widths, *, decode_steps, prefill_rows, sampled: bool) -> None:
        """`run_empty` for every variant: each width, decode of each of `decode_steps`,
        prefill of each of `prefill_rows`; greedy, and with `sampled` also sampling."""
        for width in widths:
            for greedy in (True, False) if sampled else (True,):
                for k in decode_steps:
                    self.run_empty(table_width=width, decode_steps=k, greedy=greedy)
                for rows in prefill_rows:
                    self.run_empty(table_width=width, decode=False, num_prefill=rows,
                                   greedy=greedy)

    def _call(self, batch: StepBatch, *, table_width: int, decode: bool, greedy: bool,
              decode_steps: int = 1):
        """One jitted step on a packed batch; a batch equal to the last one is
        not sent again (steady decoding sends nothing)."""
        host = pack_batch(batch)
        last_host, last_device = self._sent
        if last_host is not None and np.array_equal(host, last_host):
            device = last_device
        else:
            device = jax.device_put(host, self._batch_sharding)
            self._sent = (host, device)
        self.state, out = self._step_fn(
            self.params, self.state, device, num_prefill=batch.prefill_slots.shape[0],
            table_width=table_width, decode=decode, speculative=self.speculative,
            greedy=greedy, decode_steps=decode_steps)
        return out

    def _empty_batch(self, num_prefill: int) -> StepBatch:
        spec, dummy = self.spec, self.spec.dummy_slot
        return StepBatch(
            reset_slots=np.full(spec.num_slots, dummy, np.int32),
            prefill_slots=np.full(num_prefill, dummy, np.int32),
            prefill_tokens=np.zeros((num_prefill, spec.max_step_tokens), np.int32),
            prefill_lens=np.zeros(num_prefill, np.int32),
            prefill_last=np.zeros(num_prefill, bool),
            decode_slots=np.full(spec.num_slots, dummy, np.int32),
            temperatures=self.temperatures, seeds=self.seeds)

    def _no_slots(self):
        return np.full(self.spec.num_slots, self.spec.dummy_slot, np.int32)

    def _no_prefill(self) -> dict:
        t = self.spec.max_step_tokens
        return dict(prefill_slots=np.zeros(0, np.int32), prefill_tokens=np.zeros((0, t), np.int32),
                    prefill_lens=np.zeros(0, np.int32), prefill_last=np.zeros(0, bool))

    def unpack(self, packed: list[tuple[np.ndarray, int]]):
        """One StepOutputs from a step's calls (host arrays): prefill rows from
        the first call, decode rows from the last."""
        unpack = functools.partial(unpack_outputs, num_slots=self.spec.num_slots,
                                   block_size=self.cfg.block_size)
        (p0, k0), (p1, k1) = packed[0], packed[-1]
        first, last = unpack(p0, decode_steps=k0), unpack(p1, decode_steps=k1)
        return dataclasses.replace(last, first_tokens=first.first_tokens,
                                   prefill_ok=first.prefill_ok)

    # ------------------------------------------------------------ KV in and out

    def import_payloads(self, arrivals, reset_slots=()) -> list[tuple[jax.Array, int]]:
        """Dispatch `import_step` for arrived payloads, one call per buffer shape; the
        first call empties `reset_slots` before it imports (none without arrivals).

        arrivals: (slot, payload, SamplingParams) per request. Returns per request
        (ok: bool[R] on the device, its row in it), in order.
        """
        groups: dict[tuple, list[int]] = {}
        for k, (_, payload, _) in enumerate(arrivals):
            key = (tuple(payload.pool_ids), tuple(b.shape for b in payload.buffers))
            groups.setdefault(key, []).append(k)
        out: list = [None] * len(arrivals)
        resets = self._no_slots()
        resets[:len(reset_slots)] = reset_slots
        for slot in reset_slots:
            self.len_bound[slot] = 0
        for members in groups.values():
            n = pow2_rows(len(members))
            rows = [arrivals[k] for k in members]
            for slot, payload, params in rows:
                self.set_sampling(slot, params)
                self.len_bound[slot] = payload.target_len
                self.bytes_imported += payload.nbytes
            ok = self._import_padded([(slot, payload) for slot, payload, _ in rows], n,
                                     rows[0][1], resets)
            for row, k in enumerate(members):
                out[k] = (ok, row)
            resets = self._no_slots()
        return out

    def warm_imports(self, payload: KVPayload) -> int:
        """Compile `import_step` for payloads shaped and placed like `payload`, at every
        row count an import call can have. Every row pads (the dummy slot, no pages,
        no resets), as padding rows do in any import: nothing changes. Returns the
        number of row counts."""
        counts = sorted({pow2_rows(n) for n in range(1, self.spec.num_slots + 1)})
        for n in counts:
            self._import_padded([], n, payload, self._no_slots())
        return len(counts)

    def _import_padded(self, rows, n: int, template: KVPayload, resets) -> jax.Array:
        """One `import_step` call of `rows` ((slot, payload) each, one buffer shape) padded
        to n rows; pads take the dummy slot and `template`'s buffers, checksums and first
        token (one call signature per source). Returns ok: bool[n] on the device."""
        pad = n - len(rows)
        ints = lambda f, fill: np.array([f(r) for r in rows] + [fill] * pad, np.int32)
        logical = tuple(np.stack([p.logical_pages[k] for _, p in rows] + [
            np.full_like(template.logical_pages[k], BAD_PAGE_INDEX)] * pad)
            for k in range(len(template.pool_ids)))
        longest = max([p.target_len for _, p in rows] or [template.target_len])
        self.state, ok = self._import(
            self.params, self.state, ints(lambda r: r[0], self.spec.dummy_slot),
            ints(lambda r: r[1].target_len, 0), ints(lambda r: r[1].draft_ctx_len, 0),
            tuple(p.first_token for _, p in rows) + (template.first_token,) * pad, logical,
            tuple(p.buffers for _, p in rows) + (template.buffers,) * pad,
            tuple(p.checksums for _, p in rows) + (template.checksums,) * pad, resets,
            pool_ids=tuple(template.pool_ids), mode=self.mode,
            table_width=self.table_width(longest + self.cfg.block_size))
        return ok

    def export(self, rows, first_call_outputs) -> list[KVPayload]:
        """Dispatch `export_step` for slots whose prefill just ended in the step's
        first call. rows: (slot, prompt_len, prefill row) per request."""
        base = self.spec.num_slots * (self.cfg.block_size + 2)
        with_draft = self.cfg.draft is not None
        return self._export(self.spec, self.state, [
            (slot, n, n if with_draft else 0, base + 2 * row) for slot, n, row in rows],
            first_call_outputs, mode=self.mode)
