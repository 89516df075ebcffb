"""The engine: one request lifecycle over the jitted steps, for every serving role.

    submit(request) ─> Scheduler.schedule() ─> StepPlan ─> dispatch: import_step per arrived
         ^                                                 KV, one mixed_step (reset, prefill
         │                                                 chunks, decode rows), export_step
         └─ Results <── Scheduler.emit / finish <── read step N's outputs (after N+1 is
                                                    dispatched: the host runs one step ahead)

Roles are configurations of this one loop:
  * aggregated: prompts prefill locally, in chunks batched with decode rows;
  * generation: admitted requests get their KV from a `KVSource` (another
    mesh, several context workers, another process) and are imported by one
    jitted step each;
  * context (`export=True`): prompts prefill, then leave as `Export`s (KV
    gathered into buffers on the device) instead of decoding.

The device state is one pytree threaded through donated jitted calls; the
only host reads are each step's outputs (committed tokens, ok masks), one
`device_get` per step. Failure is data (`ok` masks) in the steps and a
Result with finish_reason "error" for the one request it concerns.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from typing import Protocol

import jax
import numpy as np

from drafter.kv_io import KVPayload, export_payload, import_step, sent_pool_ids
from drafter.mixed_step import StepBatch, pack_batch, packed_step, unpack_outputs
from drafter.request import Request, RequestError, Result, SamplingParams
from drafter.scheduler import Phase, Scheduler, Sequence
from drafter.steps import StepConfig, init_spec_state
from pallas_kernels.batch_tables import bucket_width
from unified_kv import AdmissionError, init_state

__all__ = ["Engine", "Export", "KVSource", "Result", "Request", "SamplingParams"]


class KVSource(Protocol):
    """Where a generation engine's admitted requests get their KV."""

    def fetch(self, request: Request) -> None:
        """Start producing `request`'s KV (it is admitted here: room is reserved)."""

    def poll(self, timeout: float) -> list[tuple[str, "KVPayload | BaseException"]]:
        """Arrived payloads (on this engine's devices) or failures, by request id;
        waits up to `timeout` seconds for the first one."""


@dataclasses.dataclass
class Export:
    """A context engine's prefilled request, leaving with its KV."""

    request: Request
    payload: KVPayload
    submitted: float


def _is_ready(dispatched) -> bool:
    return all(x.is_ready() for x in jax.tree.leaves(dispatched[1:]) if hasattr(x, "is_ready"))


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


@functools.lru_cache(maxsize=64)
def _packed_step_for(cfg: StepConfig):
    """The jitted step with `cfg` bound, shared by every Engine of that config: a
    static config argument would be hashed and compared on every call."""
    return jax.jit(functools.partial(packed_step, cfg=cfg),
                   static_argnames=("num_prefill", "table_width", "decode", "speculative",
                                    "greedy", "decode_steps"), donate_argnums=1)


@functools.lru_cache(maxsize=64)
def _import_step_for(cfg: StepConfig):
    return jax.jit(functools.partial(import_step, cfg=cfg),
                   static_argnames=("pool_ids", "mode", "table_width"), donate_argnums=1)


class Engine:
    """Speculative (DFlash) or plain generation over one unified cache.

    Args:
      params: {"target": ..., "draft": ... (speculative or drafter context)}.
      cfg: the static StepConfig.
      speculative: decode with the drafter; False runs plain decoding.
      mesh: this worker's devices (KV split over kv heads); None: the default device.
      max_num_batched_tokens: per-step token budget; default: every slot decoding
        plus two prefill chunks.
      kv_source: a generation engine's KV source (no local prefill).
      export: a context engine (prefilled requests leave through `take_exports`).
      mode: "shared" (draft KV travels with the target's) or "private".
      lookahead: dispatch the next step before reading the last one's outputs.
      eos_token_ids: ids that end a request (unless it sets ignore_eos).
      kv_timeout_s: a request waiting longer than this for its KV fails.
      decode_steps_per_call: decode steps one call runs back to back on the
        device while nothing waits to be admitted, prefilled or imported (one
        host round trip per call). Default: 4 on an accelerator, 1 on CPU
        (where compile time, not the host loop, is the cost).
    """

    def __init__(self, params, cfg: StepConfig, *, speculative: bool = True, mesh=None,
                 max_num_batched_tokens: int | None = None, kv_source: KVSource | None = None,
                 export: bool = False, mode: str = "shared", lookahead: bool = True,
                 eos_token_ids=(), kv_timeout_s: float = 60.0,
                 decode_steps_per_call: int | None = None):
        if speculative and cfg.draft is None:
            raise ValueError("speculative=True needs StepConfig.draft (a DFlash config)")
        if mode not in ("shared", "private"):
            raise ValueError(f"draft KV mode {mode!r} is unknown; use 'shared' or 'private'")
        self.cfg, self.spec, self.mesh = cfg, cfg.spec, mesh
        self.speculative = speculative and not export
        self.kv_source, self.export, self.mode = kv_source, export, mode
        self.lookahead, self.kv_timeout_s = lookahead, kv_timeout_s
        if decode_steps_per_call is None:
            decode_steps_per_call = 1 if jax.default_backend() == "cpu" else 4
        if decode_steps_per_call < 1:
            raise ValueError(f"decode_steps_per_call must be >= 1, got {decode_steps_per_call}")
        self.decode_steps = decode_steps_per_call
        budget = max_num_batched_tokens or (cfg.spec.num_slots * cfg.block_size
                                            + 2 * cfg.spec.max_step_tokens)
        self.scheduler = Scheduler(cfg.spec, cfg.block_size, max_num_batched_tokens=budget,
                                   kv_from_source=kv_source is not None, export=export,
                                   lookahead=int(lookahead), eos_token_ids=eos_token_ids,
                                   decode_steps=self.decode_steps)
        self.params = self._place(params)
        self.state = self._place_state(init_spec_state(cfg, init_state(cfg.spec, mesh=mesh)))
        on_mesh = functools.partial(_traced_on_mesh, mesh)
        self._step_fn, self._import = on_mesh(_packed_step_for(cfg)), on_mesh(_import_step_for(cfg))
        self._batch_sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0])
                                if mesh is None else jax.sharding.NamedSharding(
                                    mesh, jax.sharding.PartitionSpec()))
        self._sent = (None, None)  # (host, device) copy of the last packed batch
        self._export = on_mesh(export_payload)
        slots = cfg.spec.num_slots + 1
        self._temperatures = np.zeros(slots, np.float32)
        self._seeds = np.zeros(slots, np.uint32)
        self._len_bound = np.zeros(slots, np.int64)  # host upper bound of each slot's length
        self._inflight: deque = deque()  # dispatched steps not yet read, oldest first
        self._exports: list[Export] = []
        self._awaiting_since: dict[str, float] = {}
        # (dispatch, wait) seconds per step: the host's time to plan and dispatch
        # a step, then its wait for the previous step's outputs.
        self.step_times: deque[tuple[float, float]] = deque(maxlen=4096)
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

    # ------------------------------------------------------------ requests

    @property
    def admission(self):
        return self.scheduler.admission

    @property
    def reserved_ids(self) -> tuple[int, ...]:
        """Token ids no prompt may hold: the drafter's mask token."""
        return (self.cfg.draft.mask_token_id,) if self.cfg.draft is not None else ()

    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     **fields) -> Request:
        """A checked Request (RequestError names the problem); `fields` are
        SamplingParams fields when `params` is not given."""
        params = params or SamplingParams(**fields)
        return Request.make(request_id, prompt, params, vocab_size=self.cfg.target.vocab_size,
                            reserved_ids=self.reserved_ids)

    def submit(self, request: Request) -> None:
        """Queue a request. AdmissionError if it can never fit this cache or its
        id is in flight; nothing changes then."""
        self.scheduler.add(Sequence(request, time.perf_counter()))

    def add_request(self, request_id: str, prompt, max_new_tokens: int, **fields) -> None:
        """`submit(make_request(...))` with max_new_tokens."""
        self.submit(self.make_request(request_id, prompt, max_new_tokens=max_new_tokens,
                                      **fields))

    def cancel(self, request_id: str) -> Result | None:
        """End a request now (finish_reason "error", "cancelled"); its pages free next step."""
        seq = self.scheduler.active.get(request_id) or next(
            (s for s in self.scheduler.waiting if s.request_id == request_id), None)
        if seq is None:
            return None
        return self.scheduler.finish(seq, time.perf_counter(), "error", f"request "
                                     f"{request_id!r} was cancelled")

    @property
    def num_active(self) -> int:
        return len(self.scheduler.active)

    @property
    def has_work(self) -> bool:
        return (self.scheduler.num_unfinished > 0 or bool(self._inflight)
                or self.scheduler.has_pending_resets)

    def take_exports(self) -> list[Export]:
        """A context engine's requests prefilled since the last call."""
        out, self._exports = self._exports, []
        return out

    # -------------------------------------------------------------- stepping

    def step(self) -> list[Result]:
        """Plan and dispatch one step, then read the previous one; returns the
        requests that ended."""
        start = time.perf_counter()
        results = self._take_arrivals(0.0)
        plan = self.scheduler.schedule()
        for seq in plan.fetch:
            self._awaiting_since[seq.request_id] = start
            self.kv_source.fetch(seq.request)
        dispatched = self._dispatch(plan) if plan.runs_device_work else None
        issued = time.perf_counter()
        if dispatched is not None:
            self._inflight.append(dispatched)
        results += self._read_outputs(idle=dispatched is None)
        if dispatched is not None:
            self.step_times.append((issued - start, time.perf_counter() - issued))
        elif not self._inflight and self._awaiting_since:
            results += self._take_arrivals(0.02)  # nothing to run: wait a little for KV
        return results

    def _read_outputs(self, *, idle: bool) -> list[Result]:
        """Read dispatched steps, oldest first, keeping `lookahead` of them in
        flight (none when this step dispatched nothing: then every step is
        read). A context engine (export) reads only steps already done: its
        outputs are checks, and waiting on them would stall the host."""
        results = []
        keep = 0 if idle else 8 if self.export else int(self.lookahead)
        while self._inflight and (len(self._inflight) > keep or (
                self.export and _is_ready(self._inflight[0]))):
            results += self._collect(*self._inflight.popleft())
        return results

    def flush(self) -> list[Result]:
        """Read every step in flight, dispatching nothing new (the state is then
        current on the host's side: every dispatched step is booked)."""
        results = []
        while self._inflight:
            results += self._collect(*self._inflight.popleft())
        return results

    def run(self, max_steps: int | None = None) -> list[Result]:
        """Step until every submitted request has ended."""
        results, steps = [], 0
        while self.has_work and (max_steps is None or steps < max_steps):
            results += self.step()
            steps += 1
        return results

    def generate(self, prompts, max_new_tokens: int | None = None, *,
                 params: SamplingParams | None = None, arrival_steps=None,
                 **fields) -> list[Result]:
        """Serve every prompt with continuous batching; results in prompt order.

        Every prompt is checked before any is admitted (a bad one raises
        RequestError and nothing runs). `arrival_steps[i]` (optional) is the
        step at which prompt i is submitted. A request that fails raises
        RuntimeError naming it once all others have ended.
        """
        if params is None:
            params = SamplingParams(max_new_tokens=max_new_tokens or 64, **fields)
        base = f"gen{id(prompts):x}-{time.perf_counter_ns()}"
        requests = [self.make_request(f"{base}-{i}", p, params) for i, p in enumerate(prompts)]
        for r in requests:
            self.scheduler.check_fits(r)
        arrival = list(arrival_steps) if arrival_steps is not None else [0] * len(requests)
        order = deque(sorted(range(len(requests)), key=lambda i: arrival[i]))
        results: dict[str, Result] = {}
        step = 0
        while order or len(results) < len(requests):
            while order and arrival[order[0]] <= step:
                self.submit(requests[order.popleft()])
            for r in self.step():
                results[r.request_id] = r
            step += 1
        self.run()  # return the last pages before handing back
        failed = [r for r in results.values() if not r.ok]
        if failed:
            raise RuntimeError(failed[0].error)
        return [results[r.request_id] for r in requests]

    def warmup(self, max_len: int | None = None) -> int:
        """Compile the decode step for every table width that rows up to
        `max_len` tokens (default max_seq_len) use. Runs steps with no rows,
        which change nothing. Returns the number of widths."""
        max_len = self.spec.max_seq_len if max_len is None else max_len
        block = self.cfg.block_size
        widths = sorted({self._table_width(n + 2 * block) for n in
                         range(0, max_len + 1, self.spec.page_size)})
        for width in widths:
            for k in sorted({1, self.decode_steps}):
                self.state, _ = self._call(self._empty_batch(0), table_width=width,
                                           decode=True, greedy=True, decode_steps=k)
        jax.block_until_ready(self.state)
        return len(widths)

    # ------------------------------------------------------------ internals

    def _table_width(self, max_len: int) -> int:
        pages = -(-max_len // self.spec.page_size)
        return bucket_width(pages, self.spec.max_pages_per_seq, block_pages=16)

    def _take_arrivals(self, timeout: float) -> list[Result]:
        if self.kv_source is None:
            return []
        now = time.perf_counter()
        results = []
        for request_id, item in self.kv_source.poll(timeout):
            seq = self.scheduler.active.get(request_id)
            if seq is None or seq.phase is not Phase.AWAITING_KV:
                continue  # cancelled or failed meanwhile
            self._awaiting_since.pop(request_id, None)
            if isinstance(item, BaseException):
                results.append(self.scheduler.finish(seq, now, "error", f"request "
                               f"{request_id!r}: {type(item).__name__}: {item}"))
            else:
                self.scheduler.kv_arrived(seq, item)
        for request_id, since in list(self._awaiting_since.items()):
            seq = self.scheduler.active.get(request_id)
            if seq is None or seq.phase is not Phase.AWAITING_KV:
                self._awaiting_since.pop(request_id)
            elif seq.kv is None and now - since > self.kv_timeout_s:
                self._awaiting_since.pop(request_id)
                results.append(self.scheduler.finish(seq, now, "error", f"request "
                               f"{request_id!r}: its KV did not arrive within "
                               f"{self.kv_timeout_s:.1f}s"))
        return results

    def _empty_batch(self, num_prefill: int) -> StepBatch:
        spec, dummy = self.spec, self.spec.dummy_slot
        t = spec.max_step_tokens
        return StepBatch(
            reset_slots=np.full(spec.num_slots, dummy, np.int32),
            prefill_slots=np.full(num_prefill, dummy, np.int32),
            prefill_tokens=np.zeros((num_prefill, t), np.int32),
            prefill_lens=np.zeros(num_prefill, np.int32),
            prefill_last=np.zeros(num_prefill, bool),
            decode_slots=np.full(spec.num_slots, dummy, np.int32),
            temperatures=self._temperatures, seeds=self._seeds)

    def _prefill_rows(self, n: int) -> int:
        """Rows of a prefill call: 1, else the most a step can hold (two shapes
        to compile; a lone prompt pays no padding)."""
        if n <= 1:
            return n
        most = min(self.spec.num_slots, max(1, self.scheduler.budget // self.spec.max_step_tokens))
        return max(n, most)

    def _no_slots(self):
        return np.full(self.spec.num_slots, self.spec.dummy_slot, np.int32)

    def _no_prefill(self) -> dict:
        t = self.spec.max_step_tokens
        return dict(prefill_slots=np.zeros(0, np.int32), prefill_tokens=np.zeros((0, t), np.int32),
                    prefill_lens=np.zeros(0, np.int32), prefill_last=np.zeros(0, bool))

    def _dispatch(self, plan):
        block = self.cfg.block_size
        for slot in plan.reset_slots:
            self._len_bound[slot] = 0
        imported = [self._import_one(seq) for seq in plan.imports]
        batch = self._empty_batch(self._prefill_rows(len(plan.prefill)))
        batch.reset_slots[:len(plan.reset_slots)] = plan.reset_slots
        sampled = []
        for i, chunk in enumerate(plan.prefill):
            seq, slot = chunk.seq, chunk.seq.slot
            if chunk.start == 0:
                self._temperatures[slot] = seq.request.params.temperature
                self._seeds[slot] = seq.request.params.seed
            piece = seq.request.prompt[chunk.start:chunk.start + chunk.num_tokens]
            batch.prefill_slots[i] = slot
            batch.prefill_tokens[i, :len(piece)] = piece
            batch.prefill_lens[i] = len(piece)
            batch.prefill_last[i] = chunk.is_last
            self._len_bound[slot] = chunk.start + chunk.num_tokens
            sampled.append(slot)
        for seq in plan.decode:
            batch.decode_slots[seq.slot] = seq.slot
            sampled.append(seq.slot)
        steady = not (plan.prefill or plan.imports or plan.reset_slots or plan.fetch
                      or self.scheduler.waiting or len(plan.decode) < self.num_active)
        k = self.decode_steps if steady else 1
        max_len = max([c.start + c.num_tokens + block for c in plan.prefill]
                      + [int(self._len_bound[s.slot]) + (k + 1) * block for s in plan.decode],
                      default=block)
        for seq in plan.decode:
            self._len_bound[seq.slot] += k * block
        greedy = not np.any(self._temperatures[sampled]) if sampled else True
        batch = dataclasses.replace(batch, temperatures=self._temperatures,
                                    seeds=self._seeds)
        width = self._table_width(max_len)
        # Prefill chunks and decode rows of one plan go out as two calls: one
        # program holding both compiles ~2x longer per variant and multiplies
        # the variants (prefill row buckets x decode or not).
        outputs = []
        if plan.prefill or not plan.decode:
            self.state, out = self._call(batch, table_width=width, decode=False, greedy=greedy)
            outputs.append((out, 1))
            batch = dataclasses.replace(batch, reset_slots=self._no_slots())
        if plan.decode:
            self.state, out = self._call(dataclasses.replace(batch, **self._no_prefill()),
                                         table_width=width, decode=True, greedy=greedy,
                                         decode_steps=k)
            outputs.append((out, k))
        for i, chunk in enumerate(plan.prefill):
            if chunk.seq in plan.exports:
                self._export_one(chunk.seq, outputs[0][0], self._first_token_index(i))
        return plan, outputs, imported

    def _first_token_index(self, i: int) -> int:
        """Where prefill row i's first token sits in a packed output vector."""
        return self.spec.num_slots * (self.cfg.block_size + 2) + 2 * i

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
        return self._step_fn(self.params, self.state, device,
                             num_prefill=batch.prefill_slots.shape[0], table_width=table_width,
                             decode=decode, speculative=self.speculative, greedy=greedy,
                             decode_steps=decode_steps)

    def _merge_outputs(self, packed: list[tuple[np.ndarray, int]]):
        """One StepOutputs from the step's calls: prefill rows from the first,
        decode rows from the last."""
        unpack = functools.partial(unpack_outputs, num_slots=self.spec.num_slots,
                                   block_size=self.cfg.block_size)
        (p0, k0), (p1, k1) = packed[0], packed[-1]
        first, last = unpack(p0, decode_steps=k0), unpack(p1, decode_steps=k1)
        return dataclasses.replace(last, first_tokens=first.first_tokens,
                                   prefill_ok=first.prefill_ok)

    def _import_one(self, seq: Sequence):
        """Dispatch `import_step` for one arrived payload; (ok, first token) on the device."""
        payload, seq.kv = seq.kv, None
        request, slot = seq.request, seq.slot
        self._temperatures[slot] = request.params.temperature
        self._seeds[slot] = request.params.seed
        want = sent_pool_ids(self.spec, self.mode)
        problem = None
        if payload.mode != self.mode or tuple(payload.pool_ids) != want:
            problem = (f"the sender's draft KV mode {payload.mode!r} (pools "
                       f"{list(payload.pool_ids)}) differs from this worker's {self.mode!r} "
                       f"(pools {list(want)}); start both with the same mode")
        elif payload.target_len != len(request.prompt):
            problem = (f"the sender prefilled {payload.target_len} tokens, the prompt has "
                       f"{len(request.prompt)}")
        if problem is not None:
            self.scheduler.finish(seq, time.perf_counter(), "error",
                                  f"request {request.request_id!r}: KV import refused: {problem}")
            return None
        self._len_bound[slot] = payload.target_len
        self.state, ok = self._import(
            self.params, self.state, np.int32(slot), np.int32(payload.target_len),
            np.int32(payload.draft_ctx_len), payload.first_token, payload.logical_pages,
            payload.buffers, payload.checksums, pool_ids=tuple(payload.pool_ids),
            mode=self.mode, table_width=self._table_width(payload.target_len + self.cfg.block_size))
        self.bytes_imported += payload.nbytes
        return ok, payload.first_token

    def _export_one(self, seq: Sequence, tokens, token_index: int) -> None:
        n = len(seq.request.prompt)
        payload = self._export(self.spec, self.state, seq.slot, n,
                               n if self.cfg.draft is not None else 0, tokens, token_index,
                               mode=self.mode)
        self._exports.append(Export(seq.request, payload, seq.submitted))
        self.scheduler.release_exported(seq)

    def _collect(self, plan, outputs, imported) -> list[Result]:
        outputs, imported = jax.device_get((outputs, imported))
        outputs = self._merge_outputs(outputs)
        now = time.perf_counter()
        scheduler, results = self.scheduler, []

        def book(seq, tokens, decode_step):
            if (r := scheduler.emit(seq, tokens, now, decode_step=decode_step)) is not None:
                results.append(r)

        for seq, got in zip(plan.imports, imported):
            if got is None or seq.phase is Phase.DONE:
                continue
            ok, first = got
            if not ok:
                results.append(scheduler.finish(seq, now, "error", (
                    f"request {seq.request_id!r}: KV import failed: a buffer's checksum or "
                    f"its page ranges did not match (corrupted in transit, or the two caches "
                    f"disagree on windows or page size)")))
            else:
                book(seq, [int(first)], False)
        for i, chunk in enumerate(plan.prefill):
            seq = chunk.seq
            if seq.phase is Phase.DONE and seq not in plan.exports:
                continue
            if not outputs.prefill_ok[i]:
                results.append(scheduler.finish(seq, now, "error", (
                    f"request {seq.request_id!r}: prefill could not allocate pages although "
                    f"admission reserved them (a bug in page accounting)")))
            elif chunk.is_last and not self.export:
                book(seq, [int(outputs.first_tokens[i])], False)
        for j in range(outputs.num_out.shape[0]):  # the call's decode steps, in order
            for seq in plan.decode:
                if seq.phase is Phase.DONE:
                    continue
                if not outputs.decode_ok[j, seq.slot]:
                    results.append(scheduler.finish(seq, now, "error", (
                        f"request {seq.request_id!r}: a decode step could not allocate pages "
                        f"(a bug in admission accounting)")))
                    continue
                n = int(outputs.num_out[j, seq.slot])
                book(seq, outputs.out_tokens[j, seq.slot, :n], True)
        for seq in plan.decode:
            if seq.phase is not Phase.DONE:
                self._len_bound[seq.slot] = (len(seq.request.prompt) + len(seq.tokens) - 1
                                             + self.cfg.block_size * self.decode_steps
                                             * self.lookahead)
        return results


__all__ += ["RequestError", "AdmissionError"]
