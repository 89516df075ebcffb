"""KV sources in one process: context workers on their own meshes feeding a generation engine.

    generation Engine ──fetch(request)──> InProcessSource ──> ContextWorker k (own mesh)
      (admitted: room reserved        │                         export Engine: chunked,
       before any prefill)            │                         batched prefill, export_step
                                      │                                │ Handoff
      import_step <──poll()── arrivals <── move to the generation mesh ┘ (device puts)

The generation engine admits a request (slot and worst-case pages reserved)
before it asks a source for the request's KV, so no prefill is ever spent on a
request that cannot be placed. Nothing here waits on the device: exports,
moves and imports are dispatched asynchronously; only the engines read their
own step outputs.

Cooperative (default): `poll` steps each context worker once, in the caller's
thread. Threaded (fan-in): each context worker runs in its own thread and
pulls work from one queue; every engine is touched by exactly one thread,
and only requests and handoffs (gathered copies, never views of a cache)
cross threads, through queues.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
import time

from disagg.handshake import Weights
from disagg.kv_format import KVFormat, check_kv_formats
from disagg.transfer import Handoff, TransferError, assemble_heads, move_payloads, split_heads
from drafter.engine import Engine
from drafter.kv_io import KVPayload
from drafter.request import Request
from drafter.steps import StepConfig


class ContextWorker:
    """Prefills requests on its own mesh and hands their KV over; never decodes."""

    def __init__(self, params, cfg: StepConfig, *, mesh=None, mode: str = "shared",
                 max_num_batched_tokens: int | None = None, batch_invariant: bool = False,
                 name: str = "a context worker", eos_token_ids=()):
        # The EOS ids a request's min_tokens bans from its first token, drawn here: the
        # generation side's ids.
        self.engine = Engine(params, cfg, mesh=mesh, export=True, mode=mode,
                             speculative=False, max_num_batched_tokens=max_num_batched_tokens,
                             batch_invariant=batch_invariant, eos_token_ids=eos_token_ids)
        self.kv_format = KVFormat.of(cfg.spec, mode)
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.mesh, self.mode, self.name = mesh, mode, name
        self.num_prefilled = 0

    @functools.cached_property
    def weights(self) -> Weights:
        """Fingerprints of the weights served (disagg.handshake.Weights), computed once."""
        return Weights.of(self.engine.params, self.engine.cfg)

    def submit(self, request: Request) -> None:
        self.engine.submit(request)

    @property
    def has_room(self) -> bool:
        """A slot is free beyond the requests already queued here."""
        e = self.engine
        return e.admission.num_free_slots > len(e.scheduler.waiting)

    @property
    def busy(self) -> bool:
        return self.engine.has_work

    @property
    def has_requests(self) -> bool:
        """Requests queued or prefilling here (not only finished steps or freed slots)."""
        return self.engine.scheduler.num_unfinished > 0

    def pump(self) -> tuple[list[Handoff], list]:
        """One engine step: (handoffs of requests whose prefill was dispatched,
        Results of requests that failed here)."""
        failed = self.engine.step()
        handoffs = [Handoff(e.request, dataclasses.replace(e.payload, origin=self.name),
                            self.kv_format, e.submitted) for e in self.engine.take_exports()]
        self.num_prefilled += len(handoffs)
        return handoffs, failed


class InProcessSource:
    """Context workers in this process as one generation engine's KV source.

    Args:
      contexts: context workers (each on its own mesh).
      mesh: the generation engine's mesh (None: the default device).
      kv_format: the generation worker's KV format; every context is checked against it.
      move_path: how buffers move (disagg.transfer.MOVE_PATHS).
      threaded: one thread per context worker (fan-in); else `poll` steps them.
      head_slices: send each buffer as one handoff per kv-head shard, joined here.
    """

    def __init__(self, contexts: list[ContextWorker], *, mesh=None, kv_format: KVFormat,
                 move_path: str = "coalesced", threaded: bool = False,
                 head_slices: bool = False):
        if not contexts:
            raise ValueError("a KV source needs at least one context worker")
        for ctx in contexts:
            check_kv_formats(ctx.kv_format, kv_format)
        self.contexts, self.mesh, self.move_path = list(contexts), mesh, move_path
        self.threaded, self.head_slices, self.mode = threaded, head_slices, kv_format.mode
        self.bytes_moved = 0
        self._arrivals: queue.Queue = queue.Queue()
        self._slices: dict[str, list[Handoff]] = collections.defaultdict(list)
        self._next = 0
        if threaded:
            self._work: queue.Queue = queue.Queue()
            self._stop = threading.Event()
            self._threads = [threading.Thread(target=self._context_loop, args=(ctx,),
                                              name=f"context-{k}", daemon=True)
                             for k, ctx in enumerate(self.contexts)]
            for t in self._threads:
                t.start()

    # ------------------------------------------------------------ KVSource

    def fetch(self, request: Request) -> None:
        if self.threaded:
            self._work.put(request)
            return
        # Least loaded first, round robin among equals.
        k = min(range(len(self.contexts)), key=lambda i: (
            len(self.contexts[i].engine.scheduler.waiting),
            (i - self._next) % len(self.contexts)))
        self._next = k + 1
        self.contexts[k].submit(request)

    def poll(self, timeout: float) -> list:
        """Arrivals, waiting up to `timeout` for the first. Cooperative workers
        are stepped meanwhile (at least once per call); a worker with no request left
        (only steps to read, slots to empty) only when the caller can wait, so that
        bookkeeping never delays the caller's next step."""
        deadline = time.monotonic() + timeout
        out: list = []
        while True:
            if not self.threaded:
                for ctx in self.contexts:
                    if ctx.has_requests or (ctx.busy and timeout > 0):
                        self._send(*ctx.pump())
                        self._progress(ctx)
            drained = []
            while True:
                try:
                    drained.append(self._arrivals.get_nowait())
                except queue.Empty:
                    break
            out.extend(self._arrived(drained))
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            if self.threaded or not any(ctx.busy for ctx in self.contexts):
                try:  # nothing to step here: wait for a thread's arrival
                    out.extend(self._arrived([self._arrivals.get(timeout=left)]))
                except queue.Empty:
                    return out

    def warmup(self, max_len: int | None = None, min_len: int = 0, *,
               sampled: bool = False, logprobs: bool = False,
               adjusted: bool = False) -> None:
        """`Engine.warmup` on every context worker's engine. Before any request: a
        threaded worker's thread touches its engine only once it has one."""
        if any(ctx.busy for ctx in self.contexts) or (self.threaded and not self._work.empty()):
            raise RuntimeError("warmup: context workers hold requests; warm up before "
                               "submitting any")
        for ctx in self.contexts:
            ctx.engine.warmup(max_len, min_len, sampled=sampled, logprobs=logprobs,
                              adjusted=adjusted)

    def close(self, timeout: float = 10.0) -> None:
        if self.threaded:
            self._stop.set()
            for t in self._threads:
                t.join(timeout)

    # ------------------------------------------------------------ internals

    def _send(self, handoffs: list[Handoff], failed) -> None:
        """Queue handoffs (split into head slices if asked) and failures."""
        for r in failed:
            self._arrivals.put((r.request_id, TransferError(f"context worker: {r.error}")))
        for h in handoffs:
            for part in (split_heads(h) if self.head_slices else [h]):
                self._arrivals.put(part)

    def _progress(self, ctx: ContextWorker) -> None:
        """The requests `ctx` holds are still being made (their KV timeout starts again):
        a step that ran, compiles included, is progress."""
        scheduler = ctx.engine.scheduler
        for rid in [*scheduler.active, *(s.request_id for s in scheduler.waiting)]:
            self._arrivals.put((rid, None))

    def _arrived(self, items: list) -> list:
        """Failures as they are; handoffs (head slices joined once all are in) moved to
        the generation mesh together."""
        out, whole = [], []
        for item in items:
            if isinstance(item, tuple):
                out.append(item)
                continue
            handoff = item
            if handoff.num_slices > 1:
                parts = self._slices[handoff.request_id]
                parts.append(handoff)
                if len(parts) < handoff.num_slices:
                    continue
                del self._slices[handoff.request_id]
                device = self.mesh.devices.flat[0] if self.mesh is not None else None
                try:
                    handoff = assemble_heads(parts, device or _default_device(),
                                             path=self.move_path)
                except TransferError as e:
                    out.append((handoff.request_id, e))
                    continue
            whole.append(handoff)
        moved = move_payloads([received(h.payload, self.mode) for h in whole], self.mesh,
                              path=self.move_path)
        for handoff, payload in zip(whole, moved):
            self.bytes_moved += payload.nbytes
            out.append((handoff.request_id, payload))
        return out

    def _submit(self, ctx: ContextWorker, request: Request) -> None:
        """Hand `request` to `ctx`; a refusal fails that request alone."""
        try:
            ctx.submit(request)
        except Exception as e:  # noqa: BLE001 - the refusal is this request's
            self._arrivals.put((request.request_id, TransferError(
                f"{ctx.name} refused it: {type(e).__name__}: {e}")))

    def _context_loop(self, ctx: ContextWorker) -> None:
        while not self._stop.is_set():
            while ctx.has_room:
                try:
                    self._submit(ctx, self._work.get_nowait())
                except queue.Empty:
                    break
            if not ctx.busy:
                try:
                    self._submit(ctx, self._work.get(timeout=0.02))
                except queue.Empty:
                    continue
            try:
                self._send(*ctx.pump())
                self._progress(ctx)
            except BaseException as e:  # this worker is lost: fail what it held
                held = list(ctx.engine.scheduler.active) + [
                    s.request_id for s in ctx.engine.scheduler.waiting]
                for rid in held:
                    self._arrivals.put((rid, TransferError(f"context worker failed: {e!r}")))
                return
            time.sleep(0)  # let the generation thread dispatch


def received(payload: KVPayload, mode: str) -> KVPayload:
    """A payload as a generation worker in `mode` imports it.

    In private mode the drafter's context is the receiver's own: it starts as
    the prompt's length of zeros whatever the sender had, so a context worker
    without a drafter (draft context 0) and one with a drafter give the same
    generation state.
    """
    if mode == "private" and payload.draft_ctx_len != payload.target_len:
        return dataclasses.replace(payload, draft_ctx_len=payload.target_len)
    return payload


def _default_device():
    import jax
    return jax.devices()[0]


def disaggregated_engine(params, cfg: StepConfig, *, mode: str = "shared", context_meshes=(None,),
                         mesh=None, move_path: str = "coalesced", threaded: bool = False,
                         head_slices: bool = False, max_num_batched_tokens: int | None = None,
                         batch_invariant: bool = False, **engine_kwargs) -> Engine:
    """A generation Engine fed by context workers on `context_meshes` (one each);
    `max_num_batched_tokens` and `batch_invariant` apply to every engine (Engine's)."""
    contexts = [ContextWorker(params, cfg, mesh=m, mode=mode, name=f"context worker {k}",
                              max_num_batched_tokens=max_num_batched_tokens,
                              batch_invariant=batch_invariant,
                              eos_token_ids=engine_kwargs.get("eos_token_ids", ()))
                for k, m in enumerate(context_meshes)]
    source = InProcessSource(contexts, mesh=mesh, kv_format=KVFormat.of(cfg.spec, mode),
                             move_path=move_path, threaded=threaded, head_slices=head_slices)
    return Engine(params, cfg, mesh=mesh, kv_source=source, mode=mode,
                  speculative=cfg.draft is not None,
                  max_num_batched_tokens=max_num_batched_tokens,
                  batch_invariant=batch_invariant, **engine_kwargs)
