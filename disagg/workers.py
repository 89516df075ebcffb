"""Context and generation workers on their own meshes, and the channel between them.

    ContextWorker (mesh A)             Channel              GenerationWorker (mesh B)
      prefill -> first token, drafts   --Handoff-->           layout gate, reserve slot,
      gather live pages per pool       (timeout on every      move + verify + scatter KV,
      hold pages until acked           wait)                  redraft, decode with DFlash
      <------------------------------------ ack / abort ------------------------------
      free pages

Both workers run the same jitted steps (`drafter.engine.Engine`); only the
generation worker decodes. `mode="shared"` sends the draft layers' pages with
the target's; `mode="private"` keeps them home, and the generation drafter
starts without the prompt context.
"""

from __future__ import annotations

import dataclasses
import queue
import time

import jax

from disagg.layout import Layout, check_layouts
from disagg.transfer import (Handoff, TransferError, assemble_heads, export_kv, import_kv,
                             move)
from drafter.engine import Engine, Result
from drafter.steps import StepConfig
from unified_kv import AdmissionError


class TransferTimeout(TransferError):
    """A peer did not answer in time; the request's pages were freed."""


class Channel:
    """A one-way in-process queue of handoffs whose every wait has a timeout."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()

    def send(self, item) -> None:
        self._queue.put(item)

    def recv(self, timeout: float):
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TransferTimeout(f"no message from the peer within {timeout:.1f}s") from None

    def try_recv(self):
        """The next message if one is waiting, else None (never blocks)."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None


class ContextWorker:
    """Prefills requests and hands their KV over; never decodes."""

    def __init__(self, params, cfg: StepConfig, *, mesh=None, mode: str = "shared"):
        self.engine = Engine(params, cfg, speculative=cfg.draft is not None, mesh=mesh)
        self.layout = Layout.of(cfg.spec, mode)
        self.mode = mode
        self._held: dict[str, int] = {}

    def prefill(self, request_id: str, prompt, max_new_tokens: int) -> Handoff:
        """Prefill, then gather the request's live pages (held until `complete`)."""
        submitted = time.perf_counter()
        slot = self.engine.add_request(request_id, prompt, max_new_tokens)
        kv = self.engine.state.kv
        prompt, first_token = self.engine.detach(slot)  # the context worker never decodes
        self._held[request_id] = slot
        return Handoff(request_id=request_id, prompt=prompt, max_new_tokens=max_new_tokens,
                       first_token=first_token, target_len=int(kv.target_lens[slot]),
                       draft_ctx_len=int(kv.draft_ctx_lens[slot]),
                       pools=export_kv(self.engine.spec, kv, slot, mode=self.mode),
                       layout=self.layout, submitted=submitted)

    def complete(self, request_id: str) -> None:
        """The receiver has the KV (or gave up): free the request's pages."""
        if self._held.pop(request_id, None) is not None:
            self.engine.release(request_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def held_requests(self) -> list[str]:
        """Requests whose pages wait for the receiver's answer."""
        return list(self._held)


class GenerationWorker:
    """Receives requests' KV and decodes them speculatively."""

    def __init__(self, params, cfg: StepConfig, *, mesh=None, mode: str = "shared",
                 move_path: str = "coalesced"):
        self.engine = Engine(params, cfg, speculative=cfg.draft is not None, mesh=mesh)
        self.layout = Layout.of(cfg.spec, mode)
        self.mode, self.mesh, self.move_path = mode, mesh, move_path
        self.bytes_received = 0
        self.transfer_seconds = 0.0

    @property
    def first_device(self):
        return self.mesh.devices.flat[0] if self.mesh is not None else jax.devices()[0]

    def assemble(self, slices: list[Handoff]) -> Handoff:
        """Move one request's kv-head slices (from a TP context mesh) here and join
        them; pass the result to `receive(..., moved=True)`."""
        start = time.perf_counter()
        handoff = assemble_heads(slices, self.first_device, path=self.move_path)
        # From the first device onto this worker's mesh: a local reshard.
        handoff = dataclasses.replace(handoff, pools=move(handoff.pools, self.mesh))
        self.transfer_seconds += time.perf_counter() - start
        return handoff

    def receive(self, handoff: Handoff, *, moved: bool = False) -> None:
        """Gate, reserve, move (unless `moved`: already here), verify, scatter,
        redraft; on any failure the request's pages here are freed and the
        error propagates."""
        check_layouts(handoff.layout, self.layout)
        engine = self.engine
        slot, prompt = engine.reserve(handoff.request_id, handoff.prompt,
                                      handoff.max_new_tokens)
        try:
            start = time.perf_counter()
            if not moved:
                handoff = dataclasses.replace(
                    handoff, pools=move(handoff.pools, self.mesh, path=self.move_path))
            kv = import_kv(engine.spec, engine.state.kv, slot, handoff, mode=self.mode)
            self.transfer_seconds += time.perf_counter() - start
            self.bytes_received += handoff.nbytes
            engine.state = engine.state.replace(
                kv=kv, anchors=engine.state.anchors.at[slot].set(handoff.first_token))
            engine.activate(slot, handoff.request_id, prompt, handoff.max_new_tokens,
                            handoff.first_token, handoff.submitted)
            engine.redraft(slot)
        except BaseException:
            engine.release(handoff.request_id)
            raise


def connect(context: ContextWorker, generation: GenerationWorker, *,
            timeout: float = 1.0) -> None:
    """Handshake: exchange layouts both ways; a mismatch fails within `timeout`."""
    to_gen, to_ctx = Channel(), Channel()
    to_gen.send(context.layout)
    to_ctx.send(generation.layout)
    check_layouts(to_gen.recv(timeout), generation.layout)
    check_layouts(context.layout, to_ctx.recv(timeout))


class DisaggregatedPair:
    """A context and a generation worker serving prompts with continuous batching."""

    def __init__(self, context: ContextWorker, generation: GenerationWorker, *,
                 timeout: float = 30.0):
        connect(context, generation)
        self.context, self.generation, self.timeout = context, generation, timeout
        self.channel = Channel()

    def transfer_one(self, request_id: str, prompt, max_new_tokens: int) -> None:
        handoff = self.context.prefill(request_id, prompt, max_new_tokens)
        try:
            self.channel.send(handoff)
            self.generation.receive(self.channel.recv(self.timeout))
        finally:
            self.context.complete(request_id)  # pages freed on success and failure

    def generate(self, prompts, max_new_tokens: int) -> list[Result]:
        gen = self.generation.engine
        waiting = list(range(len(prompts)))
        results: dict[str, Result] = {}
        while waiting or gen.num_active:
            while waiting:
                i = waiting[0]
                try:
                    self.transfer_one(f"req{i}", prompts[i], max_new_tokens)
                except AdmissionError:
                    if not gen.num_active:
                        raise
                    break
                waiting.pop(0)
            for r in gen.step():
                results[r.request_id] = r
        return [results[f"req{i}"] for i in range(len(prompts))]
