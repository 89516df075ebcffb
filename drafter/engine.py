"""The engine: one request lifecycle over the jitted steps, for every serving role.

    submit(request) ─> Scheduler.schedule() ─> StepPlan ─> dispatch: import_step per arrived
         ^                                                 KV and one redraft, mixed_step (reset,
         │                                                 prefill chunks, decode rows), export_step
         └─ Results <── update_from_output <── read step N's outputs (after N+1 is
                        (drafter/update.py)        dispatched: the host runs one step ahead)

Roles are configurations of this one loop:
  * aggregated: prompts prefill locally, in chunks batched with decode rows;
  * generation: admitted requests get their KV from a `KVSource` (another
    mesh, several context workers, another process), polled once each step is
    dispatched; what arrived is imported by the next step's import calls (and,
    in private mode, drafted for by one redraft call);
  * context (`export=True`): prompts prefill, then leave as `Export`s (KV
    gathered into buffers on the device) instead of decoding.

The device state is one pytree threaded through donated jitted calls; the
only host reads are each step's outputs (committed tokens, ok masks), one
`device_get` per step, and arrived first tokens (drafter/arrivals.py). Failure
is data (`ok` masks) in the steps and a Result with finish_reason "error" for
the one request it concerns.
"""

from __future__ import annotations

import time
from collections import deque

import jax

from drafter.arrivals import Arrivals
from drafter.executor import Executor
from drafter.kv_io import Export, KVSource, import_refusal
from drafter.request import Request, RequestError, Result, SamplingParams
from drafter.scheduler import Phase, Scheduler, Sequence
from drafter.steps import StepConfig
from drafter.update import update_from_output
from drafter.warmup import warm_engine
from unified_kv import AdmissionError

__all__ = ["Engine", "Export", "KVSource", "Result", "Request", "SamplingParams"]

# The default per-step budget holds this many prefill chunks beside every slot's decode
# row: prompts that arrive together prefill (and move, disaggregated) in few calls, as
# vLLM's and SGLang's budgets of thousands of tokens do; padding a call's rows to a power
# of two keeps the compiled shapes to log2(8) + 1.
DEFAULT_PREFILL_CHUNKS = 8


def _is_ready(dispatched) -> bool:
    return all(x.is_ready() for x in jax.tree.leaves(dispatched[1:]) if hasattr(x, "is_ready"))


class Engine:
    """Speculative (DFlash) or plain generation over one unified cache.

    Args:
      params: {"target": ..., "draft": ... (speculative or drafter context)}.
      cfg: the static StepConfig.
      speculative: decode with the drafter; False runs plain decoding.
      mesh: this worker's devices (KV split over kv heads); None: the default device.
      max_num_batched_tokens: per-step token budget; default: every slot decoding
        plus `DEFAULT_PREFILL_CHUNKS` prefill chunks.
      kv_source: a generation engine's KV source (no local prefill).
      export: a context engine (prefilled requests leave through `take_exports`).
      mode: "shared" (draft KV travels with the target's) or "private".
      lookahead: dispatch the next step before reading the last one's outputs.
      eos_token_ids: ids that end a request (unless it sets ignore_eos).
      kv_timeout_s: a request whose KV source shows no progress for this long fails.
      decode_steps_per_call: decode steps one call runs back to back on the device
        while nothing waits to be admitted or prefilled (one host round trip per call).
        Default: 8 on an accelerator, 1 on CPU (compile time, not the host, costs there).
      batch_invariant: every prefill call runs the step's full prefill rows (a lone
        prompt's padded) and every decode call a row per slot, so each kind of call has
        one shape and a request's tokens do not depend on what shares its steps: matmuls
        round by their shapes, and attention already computes a row alike in any batch
        (pallas_kernels/launch_plan). Otherwise a call's rows follow its requests
        (`Scheduler.rows_for`).
    """

    def __init__(self, params, cfg: StepConfig, *, speculative: bool = True, mesh=None,
                 max_num_batched_tokens: int | None = None, kv_source: KVSource | None = None,
                 export: bool = False, mode: str = "shared", lookahead: bool = True,
                 eos_token_ids=(), kv_timeout_s: float = 60.0,
                 decode_steps_per_call: int | None = None, batch_invariant: bool = False):
        if speculative and cfg.draft is None:
            raise ValueError("speculative=True needs StepConfig.draft (a DFlash config)")
        if mode not in ("shared", "private"):
            raise ValueError(f"draft KV mode {mode!r} is unknown; use 'shared' or 'private'")
        self.cfg, self.spec, self.mesh = cfg, cfg.spec, mesh
        self.speculative = speculative and not export
        self.kv_source, self.export, self.mode = kv_source, export, mode
        self.lookahead, self.kv_timeout_s = lookahead, kv_timeout_s
        if decode_steps_per_call is None:
            decode_steps_per_call = 1 if jax.default_backend() == "cpu" else 8
        if decode_steps_per_call < 1:
            raise ValueError(f"decode_steps_per_call must be >= 1, got {decode_steps_per_call}")
        self.decode_steps = decode_steps_per_call
        self.batch_invariant = batch_invariant
        chunk = cfg.spec.max_step_tokens
        if max_num_batched_tokens is not None and max_num_batched_tokens < chunk:
            raise ValueError(f"max_num_batched_tokens (serve --max-num-batched-tokens) "
                             f"{max_num_batched_tokens} is below one prefill chunk ({chunk} "
                             f"tokens): give at least {chunk}")
        budget = max_num_batched_tokens or (cfg.spec.num_slots * cfg.block_size
                                             + DEFAULT_PREFILL_CHUNKS * chunk)
        self.scheduler = Scheduler(cfg.spec, cfg.block_size, max_num_batched_tokens=budget,
                                   kv_from_source=kv_source is not None, export=export,
                                   lookahead=int(lookahead), eos_token_ids=eos_token_ids,
                                   decode_steps=self.decode_steps,
                                   batch_invariant=batch_invariant)
        # a step exports at most its prefill rows; imports are grouped as many
        self.executor = Executor(params, cfg, mesh=mesh, speculative=self.speculative,
                                 mode=mode, transfer_rows=self.scheduler.max_prefill_rows,
                                 eos_token_ids=eos_token_ids)
        self._inflight: deque = deque()  # dispatched steps not yet read, oldest first
        self._exports: list[Export] = []
        self.arrivals = Arrivals(self.scheduler)
        # (dispatch, wait) seconds per step: the host's time to plan and dispatch
        # a step, then its wait for the previous step's outputs.
        self.step_times: deque[tuple[float, float]] = deque(maxlen=4096)

    @property
    def state(self):
        """The device state (StepState), as the last dispatched call leaves it."""
        return self.executor.state

    @state.setter
    def state(self, value):
        self.executor.state = value

    @property
    def params(self):
        return self.executor.params

    @property
    def bytes_imported(self) -> int:
        return self.executor.bytes_imported

    @bytes_imported.setter
    def bytes_imported(self, value: int) -> None:
        self.executor.bytes_imported = value

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
        if self.arrivals.at_source(request.request_id):
            raise AdmissionError(f"request id {request.request_id!r} is still in flight at the "
                                 f"KV source (it ended here while its KV was being made); use "
                                 f"a new id, or this one once the source has answered")
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

    def kv_source_unavailable(self) -> str | None:
        """Why the KV source would fail a request sent now (a source with `unavailable`,
        kv_io.KVSource), or None."""
        check = getattr(self.kv_source, "unavailable", None)
        return check() if check is not None else None

    def take_exports(self) -> list[Export]:
        """A context engine's requests prefilled since the last call."""
        out, self._exports = self._exports, []
        return out

    # -------------------------------------------------------------- stepping

    def step(self) -> list[Result]:
        """Plan and dispatch one step, then read the previous one; returns the
        requests that ended."""
        start = time.perf_counter()
        results = []
        if self.export:  # a context reads finished steps first: its handoffs leave sooner
            results += self._read_outputs(idle=False)
        plan = self.scheduler.schedule()
        for seq in plan.fetch:
            if (refused := self.arrivals.fetch(self.kv_source, seq, start)) is not None:
                results.append(refused)
        if plan.reset_slots and not plan.runs_step and self.arrivals.awaiting:
            # Nothing but resets: the import of the awaited KV carries them (one call fewer
            # between a request's admission and its first generation step).
            self.scheduler.defer_resets(plan.reset_slots)
            plan.reset_slots = []
        dispatched = self._dispatch(plan) if plan.runs_device_work else None
        issued = time.perf_counter()
        if dispatched is not None:
            self._inflight.append(dispatched)
            # Each output's copy to the host starts as soon as its call ends on the
            # device, not when it is read: reading it then waits for no transfer.
            _, outputs, imported = dispatched
            for out in [out for out, _ in outputs] + [got[0] for got in imported if got]:
                out.copy_to_host_async()
        # The KV source is polled once this step is dispatched: an in-process source's
        # senders launch their prefills and exports while it runs on the device, instead
        # of while the device waits (docs/decisions.md, Serving), and what arrives is
        # imported by the next step.
        if self.kv_source is not None:
            results += self._take_arrivals(0.0)
        if not (self.export and dispatched is not None):
            results += self._read_outputs(idle=dispatched is None)
        if dispatched is not None:
            self.step_times.append((issued - start, time.perf_counter() - issued))
        elif not self._inflight and self.arrivals.awaiting:
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

    def prefill_submitted(self) -> list[Result]:
        """Step until every submitted request is prefilled (rows prefilled earlier
        decode meanwhile), then read every step in flight. For callers that
        work on the prefilled state (benchmarks, tests)."""
        results = []
        while self.scheduler.waiting or any(s.phase is Phase.PREFILLING
                                            for s in self.scheduler.active.values()):
            results += self.step()
        return results + self.flush()

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

    def warmup(self, max_len: int | None = None, min_len: int = 0, *,
               sampled: bool = False, logprobs: bool = False, adjusted: bool = False) -> int:
        """Compile every call this engine's role makes for rows of `min_len` to `max_len`
        tokens (default 0 to max_seq_len), changing nothing (drafter/warmup.py says which
        calls); returns the number of table widths."""
        return warm_engine(self, max_len, min_len, sampled=sampled, logprobs=logprobs,
                           adjusted=adjusted)

    # ------------------------------------------------------------ internals

    def _take_arrivals(self, wait_s: float) -> list[Result]:
        if self.kv_source is None:
            return []
        return self.arrivals.take(self.kv_source, wait_s, self.kv_timeout_s)

    def _dispatch(self, plan):
        imported = self._import_arrived(plan.imports, plan.reset_slots)
        if any(got is not None for got in imported):
            plan.reset_slots = []  # the first import call emptied them
        # Several decode steps a call once nothing but decoding is left to do. Imported
        # rows arrive with their first token and draft block, as a prefill's rows leave
        # their call, so they decode like any running row: no single step for them.
        steady = not (plan.prefill or plan.reset_slots or plan.fetch
                      or self.scheduler.waiting or len(plan.decode) < self.num_active)
        rows = self.scheduler.rows_for
        outputs = self.executor.run(plan, prefill_rows=rows("prefill", len(plan.prefill)),
                                    decode_rows=rows("decode", len(plan.decode)),
                                    decode_steps=self.decode_steps if steady else 1)
        if self.scheduler.export:
            self._exports += self.executor.export_prefilled(plan, outputs)
            for seq in plan.exports:
                self.scheduler.release_exported(seq)
        return plan, outputs, imported

    def _import_arrived(self, seqs, reset_slots) -> list:
        """Dispatch the imports of arrived payloads (the first call empties `reset_slots`
        before importing); per request (ok, first token, origin), ok and the token
        on the device, or None when its payload cannot be for this worker (the request
        fails)."""
        accepted, out = [], [None] * len(seqs)
        for k, seq in enumerate(seqs):
            payload, seq.kv = seq.kv, None
            request = seq.request
            problem = import_refusal(payload, self.spec, self.mode, len(request.prompt),
                                     self.state.drafts.shape[1])
            if problem is not None:
                self.scheduler.finish(seq, time.perf_counter(), "error", f"request "
                                      f"{request.request_id!r}: KV import refused: {problem}")
            else:
                accepted.append((k, seq, payload))
        done = self.executor.import_payloads([(seq.slot, payload, seq.request)
                                              for _, seq, payload in accepted], reset_slots)
        for (k, _, payload), ok in zip(accepted, done):
            out[k] = (ok, payload.first_token, payload.origin, payload.first_logprobs,
                      payload.prompt_logprobs)
        return out

    def _collect(self, plan, outputs, imported) -> list[Result]:
        results = self.arrivals.book_imported(plan.imports)   # before the step's outputs
        outputs, imported = jax.device_get((outputs, imported))
        results += update_from_output(self.scheduler, plan, self.executor.unpack(outputs),
                                     imported, time.perf_counter(), export=self.export)
        for seq in plan.decode:
            if seq.phase is not Phase.DONE:
                self.executor.len_bound[seq.slot] = (len(seq.request.prompt) + len(seq.tokens) - 1
                                             + self.cfg.block_size * self.decode_steps
                                             * self.lookahead)
        return results


__all__ += ["RequestError", "AdmissionError"]
