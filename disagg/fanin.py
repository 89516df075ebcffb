"""Fan-in: several context workers prefill at once into one generation worker.

    ContextWorker 0 (thread) --.
    ContextWorker 1 (thread) ---+--> Channel --> receiver loop (the caller's thread):
    ContextWorker 2 (thread) --'     (handoffs,   join head slices, receive into free
           ^                          failures)   room, decode with continuous batching
           '------------- one ack Channel per context worker <-------------'

Race-freedom: every engine is touched by exactly one thread. A context
thread alone prefills on its worker and frees a request's pages there when
the receiver's ack arrives; the receiver loop alone touches the generation
worker. Only immutable things cross threads, through queues: handoffs (their
buffers are gathered copies, not views of a cache) one way, acks the other.
Head slices of one request may interleave with other requests' messages in
any order; the receiver collects them per request and joins them once all
have arrived.

Every wait has a timeout, on the peer's progress: each side stamps the time
when it starts and ends a prefill, receive or step. The receiver, with
nothing to decode, fails when no context worker has stamped for `timeout`
seconds; a context worker waiting for acks fails when the receiver has not.
So `timeout` must exceed the longest single step, its compilation included.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time

from disagg.transfer import Handoff, split_heads
from disagg.workers import (Channel, ContextWorker, GenerationWorker, TransferTimeout,
                            connect)
from drafter.engine import Result
from unified_kv import AdmissionError

POLL_SECONDS = 0.02  # how often a waiting thread checks for stop and for a silent peer


@dataclasses.dataclass(frozen=True)
class _Sent:        # context -> receiver: a request's KV (or one head slice of it)
    sender: int
    handoff: Handoff


@dataclasses.dataclass(frozen=True)
class _Failed:      # context -> receiver: the context thread raised
    sender: int
    error: BaseException


@dataclasses.dataclass(frozen=True)
class _Ack:         # receiver -> context: the request's KV is in (or refused): free it
    request_id: str


class _Stopped(Exception):
    """The receiver told the context threads to stop."""


class FanIn:
    """Context workers (each on its own mesh, one thread each) feeding one
    generation worker through one channel.

    Args:
      contexts: the context workers; each prefills the next waiting prompt
        whenever it has room (work is pulled, not assigned).
      generation: the one generation worker; only the caller's thread uses it.
      timeout: seconds a peer may make no progress (see the module docstring).
      head_slices: send each context worker's buffers as one handoff per
        kv-head shard of its mesh (what separate TP ranks do); the
        receiver joins them along kv heads.
    """

    def __init__(self, contexts: list[ContextWorker], generation: GenerationWorker, *,
                 timeout: float = 60.0, head_slices: bool = False):
        if not contexts:
            raise ValueError("FanIn needs at least one context worker")
        for ctx in contexts:
            connect(ctx, generation)
        self.contexts, self.generation = list(contexts), generation
        self.timeout, self.head_slices = timeout, head_slices
        self.channel = Channel()
        self._acks = [Channel() for _ in self.contexts]
        self._stop = threading.Event()
        self._receiver_progress = time.monotonic()
        self._context_progress = [time.monotonic()] * len(self.contexts)
        self.prefills = [0] * len(self.contexts)  # requests each context worker prefilled

    # ------------------------------------------------------------ serving

    def generate(self, prompts, max_new_tokens: int) -> list[Result]:
        """Serve every prompt; results in prompt order, as `Engine.generate`."""
        engine = self.generation.engine
        prompts = [engine.validate_prompt(p, max_new_tokens) for p in prompts]
        work: queue.Queue = queue.Queue()
        for i, prompt in enumerate(prompts):
            work.put((f"req{i}", prompt))
        self._stop.clear()
        self._receiver_progress = time.monotonic()
        self._context_progress = [time.monotonic()] * len(self.contexts)
        threads = [threading.Thread(target=self._context_loop, args=(k, work, max_new_tokens),
                                    name=f"fanin-context-{k}", daemon=True)
                   for k in range(len(self.contexts))]
        for t in threads:
            t.start()
        live: set[str] = set()  # received here, not finished: freed if anything fails
        try:
            results = self._receive_loop(len(prompts), live)
        except BaseException:
            for request_id in live:
                engine.release(request_id)
            raise
        finally:
            self._stop.set()
            for t in threads:
                t.join(self.timeout)
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            raise TransferTimeout(f"context threads {stuck} did not stop within "
                                  f"{self.timeout:.1f}s of the end of serving")
        return [results[f"req{i}"] for i in range(len(prompts))]

    def _receive_loop(self, num_requests: int, live: set[str]) -> dict[str, Result]:
        gen, engine = self.generation, self.generation.engine
        results: dict[str, Result] = {}
        pending: collections.deque = collections.deque()  # (sender, handoff, moved)
        slices: dict[str, list[Handoff]] = {}
        while len(results) < num_requests:
            if not engine.num_active and not pending:  # nothing to do but wait
                msg = self._wait_for_contexts(num_requests - len(results))
            else:
                msg = self.channel.try_recv()
            while msg is not None:
                self._take(msg, pending, slices)
                msg = self.channel.try_recv()
            while pending:  # admit in arrival order while there is room
                sender, handoff, moved = pending[0]
                self._receiver_progress = time.monotonic()
                try:
                    gen.receive(handoff, moved=moved)
                except AdmissionError:
                    if not engine.num_active:
                        raise  # nothing will free room: this request can never run
                    break
                except BaseException:
                    self._acks[sender].send(_Ack(handoff.request_id))
                    raise
                pending.popleft()
                live.add(handoff.request_id)
                self._acks[sender].send(_Ack(handoff.request_id))
            self._receiver_progress = time.monotonic()
            for result in engine.step():
                results[result.request_id] = result
                live.discard(result.request_id)
            self._receiver_progress = time.monotonic()
        return results

    def _wait_for_contexts(self, outstanding: int):
        """The next message, waiting while some context worker makes progress."""
        while True:
            try:
                return self.channel.recv(POLL_SECONDS)
            except TransferTimeout:
                if time.monotonic() - max(self._context_progress) > self.timeout:
                    raise TransferTimeout(
                        f"no context worker of {len(self.contexts)} made progress or sent "
                        f"a handoff within {self.timeout:.1f}s while {outstanding} requests "
                        f"are outstanding and nothing is left to decode; check that the "
                        f"context workers are running") from None

    def _take(self, msg, pending, slices) -> None:
        if isinstance(msg, _Failed):
            raise msg.error
        handoff = msg.handoff
        if handoff.num_slices == 1:
            pending.append((msg.sender, handoff, False))
            return
        parts = slices.setdefault(handoff.request_id, [])
        parts.append(handoff)
        if len(parts) == handoff.num_slices:
            del slices[handoff.request_id]
            try:
                joined = self.generation.assemble(parts)
            except BaseException:
                self._acks[msg.sender].send(_Ack(handoff.request_id))
                raise
            pending.append((msg.sender, joined, True))

    # ------------------------------------------------------ context threads

    def _context_loop(self, k: int, work: queue.Queue, max_new_tokens: int) -> None:
        ctx = self.contexts[k]
        try:
            while not self._stop.is_set():
                self._take_acks(k, wait=False)
                try:
                    request_id, prompt = work.get_nowait()
                except queue.Empty:
                    if not ctx.num_held:
                        return  # no work left and every handoff acknowledged
                    self._take_acks(k, wait=True)
                    continue
                while True:
                    try:
                        self._context_progress[k] = time.monotonic()
                        handoff = ctx.prefill(request_id, prompt, max_new_tokens)
                        self._context_progress[k] = time.monotonic()
                        break
                    except AdmissionError:
                        if not ctx.num_held:
                            raise  # nothing will free room here
                        self._take_acks(k, wait=True)  # room comes back with acks
                self.prefills[k] += 1
                for part in (split_heads(handoff) if self.head_slices else [handoff]):
                    self.channel.send(_Sent(k, part))
        except _Stopped:
            pass
        except BaseException as e:  # the receiver re-raises it
            self.channel.send(_Failed(k, e))
        finally:
            for request_id in ctx.held_requests:
                ctx.complete(request_id)

    def _take_acks(self, k: int, *, wait: bool) -> None:
        """Free the pages of every acknowledged request; with `wait`, wait for
        at least one ack while the receiver is making progress."""
        ctx, acks = self.contexts[k], self._acks[k]
        if wait:
            while True:
                if self._stop.is_set():
                    raise _Stopped
                try:
                    ctx.complete(acks.recv(POLL_SECONDS).request_id)
                    break
                except TransferTimeout:
                    if time.monotonic() - self._receiver_progress > self.timeout:
                        raise TransferTimeout(
                            f"context worker {k}: the generation worker made no progress "
                            f"for {self.timeout:.1f}s while {ctx.num_held} handoffs waited "
                            f"for it; check that its receiver loop is running") from None
        while (ack := acks.try_recv()) is not None:
            ctx.complete(ack.request_id)
