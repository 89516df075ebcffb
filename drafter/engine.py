"""`Engine.generate`: continuous batching over the jitted steps.

The host loop owns requests and admission only; the device state (cache,
anchors, drafts) is one pytree threaded through donated jitted steps.

    loop:
      admit waiting requests while a slot and worst-case pages are free
        -> chunked prefill of each (chunks of max_step_tokens), first token
           and first draft block
      one decode step over every slot (fixed batch shape; free slots ride as
        the dummy padding slot)
      finished requests release their pages and slots
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from drafter.steps import (StepConfig, decode_step, init_spec_state, plain_decode_step,
                           prefill_step, redraft_step)
from pallas_kernels.batch_tables import bucket_width
from unified_kv import AdmissionController, AdmissionError, admit_slots, init_state, release_slots


@dataclasses.dataclass
class Result:
    """One finished request."""

    request_id: str
    prompt: list[int]
    tokens: list[int]                 # generated tokens (first token included)
    acceptance: list[int]             # tokens committed per decode step (AL = mean)
    time_to_first_token_s: float
    decode_time_s: float

    @property
    def acceptance_length(self) -> float:
        return float(np.mean(self.acceptance)) if self.acceptance else 0.0


@dataclasses.dataclass
class _Active:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    slot: int
    submitted: float
    tokens: list = dataclasses.field(default_factory=list)
    acceptance: list = dataclasses.field(default_factory=list)
    first_token_at: float = 0.0


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


def _keyed_step(params, state, *args, step, seed, counter, **static):
    """`step(params, state, *args, key, **static)` with its PRNG key folded from
    (seed, counter) inside the jit: splitting keys eagerly on the host cost an
    extra dispatch per step, a sizeable part of a small model's host loop.
    Module-level (steps and seeds are static arguments) so that every Engine
    shares the compiled steps."""
    key = jax.random.fold_in(jax.random.key(seed), counter)
    return step(params, state, *args, key, **static)


class Engine:
    """Speculative (DFlash) or plain greedy/sampled generation over one cache.

    Args:
      params: {"target": target params, "draft": drafter params (speculative only)}.
      cfg: the static StepConfig (target config, cache spec, drafter config or None).
      speculative: use the drafter; False runs the plain decode step.
    """

    def __init__(self, params, cfg: StepConfig, *, speculative: bool = True, seed: int = 0,
                 mesh=None):
        if speculative and cfg.draft is None:
            raise ValueError("speculative=True needs StepConfig.draft (a DFlash config)")
        self.params, self.cfg, self.speculative = params, cfg, speculative
        self.spec = cfg.spec
        self.admission = AdmissionController(cfg.spec)
        self.mesh = mesh
        if mesh is not None:  # params replicated on this worker's mesh, KV split by kv heads
            params = jax.device_put(params, jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec()))
            self.params = params
        state = init_spec_state(cfg, init_state(cfg.spec, mesh=mesh))
        # Commit the fresh state where the steps' outputs will live: jit keys its
        # cache on committed-ness, and an uncommitted first state would make
        # every step compile twice (seconds each on a GPU) on its first use.
        if mesh is None:
            self.state = jax.device_put(state, jax.devices()[0])
        else:  # the KV is already split by kv heads; the rest is replicated
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self.state = state.replace(anchors=jax.device_put(state.anchors, replicated),
                                       drafts=jax.device_put(state.drafts, replicated))
        self._counter = 0  # steps' PRNG keys are fold_in(key(seed), counter), in the jit
        self._active: dict[int, _Active] = {}
        self._lens = np.zeros(cfg.spec.num_slots, np.int64)  # host upper bound per slot
        # (dispatch, wait) seconds of recent decode steps: the jitted call's
        # return, then its outputs arriving on the host (profiling the host loop)
        self.step_times: deque[tuple[float, float]] = deque(maxlen=4096)
        statics = ("cfg", "table_width", "temperature")
        step = decode_step if speculative else plain_decode_step
        on_mesh = functools.partial(_traced_on_mesh, mesh)
        keyed = jax.jit(_keyed_step, static_argnames=statics + ("step", "seed"),
                        donate_argnums=1)
        self._prefill = on_mesh(functools.partial(keyed, step=prefill_step, seed=seed))
        self._decode = on_mesh(functools.partial(keyed, step=step, seed=seed))
        self._admit = on_mesh(jax.jit(admit_slots, static_argnums=0, donate_argnums=1))
        self._redraft = on_mesh(jax.jit(redraft_step, static_argnames=("cfg", "table_width"),
                                        donate_argnums=1))
        self._release = on_mesh(jax.jit(release_slots, static_argnums=0, donate_argnums=1))

    # ------------------------------------------------------------ requests

    def validate_prompt(self, prompt, max_new_tokens: int) -> list[int]:
        vocab = self.cfg.target.vocab_size
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = len(prompt) + max_new_tokens + self.cfg.block_size
        if need > self.spec.max_seq_len:
            raise AdmissionError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} + "
                f"{self.cfg.block_size} verify tokens = {need} exceeds max_seq_len="
                f"{self.spec.max_seq_len}; shorten the prompt or build a larger cache")
        return prompt

    def reserve(self, request_id: str, prompt, max_new_tokens: int) -> tuple[int, list[int]]:
        """Validate and admit a request, giving it a fresh slot (no KV yet).
        Returns (slot, prompt); AdmissionError/ValueError change nothing."""
        prompt = self.validate_prompt(prompt, max_new_tokens)
        max_len = len(prompt) + max_new_tokens + self.cfg.block_size
        slot = self.admission.admit(request_id, max_len).slot
        ids = jnp.array([slot], jnp.int32)
        self.state = self.state.replace(kv=self._admit(self.spec, self.state.kv, ids))
        return slot, prompt

    def activate(self, slot: int, request_id: str, prompt: list[int], max_new_tokens: int,
                 first_token: int, submitted: float) -> None:
        """Start decoding a reserved slot whose prompt KV, anchor and drafts are in place."""
        act = _Active(request_id, prompt, max_new_tokens, slot, submitted)
        act.tokens.append(int(first_token))
        act.first_token_at = time.perf_counter()
        self._active[slot] = act
        self._lens[slot] = len(prompt)

    def add_request(self, request_id: str, prompt, max_new_tokens: int, *,
                    temperature: float = 0.0) -> int:
        """Admit and prefill one request now; returns its slot. AdmissionError if
        it cannot fit (nothing else changes)."""
        submitted = time.perf_counter()
        slot, prompt = self.reserve(request_id, prompt, max_new_tokens)
        ids = jnp.array([slot], jnp.int32)
        # Chunked prefill: a chunk never exceeds the cache's max_step_tokens,
        # which is what admission reserved windowed-pool headroom for.
        chunk = self.spec.max_step_tokens
        for start in range(0, len(prompt), chunk):
            piece = prompt[start:start + chunk]
            tokens = np.zeros((1, chunk), np.int32)
            tokens[0, :len(piece)] = piece
            is_last = start + chunk >= len(prompt)
            self.state, first, ok = self._prefill(
                self.params, self.state, ids, tokens,
                np.array([len(piece)], np.int32), np.array([is_last]),
                counter=self._next_counter(), cfg=self.cfg,
                table_width=self._table_width(start + chunk + self.cfg.block_size),
                temperature=temperature)
            if not bool(ok[0]):
                self.release(request_id)
                raise RuntimeError(f"request {request_id!r}: prefill could not allocate pages "
                                   f"although admission reserved them (a bug in page "
                                   f"accounting)")
        self.activate(slot, request_id, prompt, max_new_tokens, int(first[0]), submitted)
        return slot

    def redraft(self, slot: int) -> None:
        """Recompute a slot's draft block from its cache (after KV arrived)."""
        if not self.speculative:
            return
        self.state = self._redraft(self.params, self.state, jnp.array([slot], jnp.int32),
                                   cfg=self.cfg,
                                   table_width=self._table_width(int(self._lens[slot])
                                                                 + self.cfg.block_size))

    @property
    def num_active(self) -> int:
        return len(self._active)

    def detach(self, slot: int) -> tuple[list[int], int]:
        """Stop decoding a prefilled slot (its KV stays until `release`);
        returns (prompt, first token). A context worker hands it off."""
        act = self._active.pop(slot)
        return act.prompt, act.tokens[0]

    def release(self, request_id: str) -> None:
        """Free a request's pages and slot (finished, failed or handed off)."""
        self._drop(self.admission.reservation(request_id).slot, request_id)

    def _drop(self, slot: int, request_id: str) -> None:
        self.state = self.state.replace(
            kv=self._release(self.spec, self.state.kv, jnp.array([slot], jnp.int32)))
        self.admission.release(request_id)
        self._active.pop(slot, None)
        self._lens[slot] = 0

    def _next_counter(self) -> np.uint32:
        self._counter += 1
        return np.uint32(self._counter)

    def warmup(self, max_len: int | None = None, temperature: float = 0.0) -> int:
        """Compile the decode step for every table width rows up to `max_len`
        tokens (default max_seq_len) will use, so no request pays a compile
        when it crosses a width bucket mid-run. Runs all-padding steps, which
        change nothing. Returns the number of widths."""
        max_len = self.spec.max_seq_len if max_len is None else max_len
        widths = sorted({self._table_width(n) for n in
                         range(self.spec.page_size, max_len + 2 * self.cfg.block_size + 1,
                               self.spec.page_size)})
        slots = np.full(self.spec.num_slots, self.spec.dummy_slot, np.int32)
        for width in widths:
            self.state, *_ = self._decode(self.params, self.state, slots,
                                          counter=self._next_counter(), cfg=self.cfg,
                                          table_width=width, temperature=temperature)
        jax.block_until_ready(self.state)
        return len(widths)

    def _table_width(self, max_len: int) -> int:
        pages = -(-max_len // self.spec.page_size)
        return bucket_width(pages, self.spec.max_pages_per_seq, block_pages=16)

    # -------------------------------------------------------------- stepping

    def step(self, temperature: float = 0.0) -> list[Result]:
        """One decode step over all active requests; returns those that finished."""
        if not self._active:
            return []
        slots = np.full(self.spec.num_slots, self.spec.dummy_slot, np.int32)
        for slot in self._active:
            slots[slot] = slot
        width = self._table_width(int(self._lens.max()) + 2 * self.cfg.block_size)
        # Host arrays go straight to the jitted call (one transfer, no eager op);
        # its outputs come back in one device_get.
        start = time.perf_counter()
        self.state, *outs = self._decode(self.params, self.state, slots,
                                         counter=self._next_counter(), cfg=self.cfg,
                                         table_width=width, temperature=temperature)
        dispatched = time.perf_counter()
        outs = jax.device_get(outs)
        self.step_times.append((dispatched - start, time.perf_counter() - dispatched))
        if self.speculative:
            out_tokens, num_out, ok = outs
        else:
            token, ok = outs
            out_tokens, num_out = token[:, None], np.where(ok, 1, 0)
        finished = []
        for slot, act in list(self._active.items()):
            if not ok[slot]:
                raise RuntimeError(f"request {act.request_id!r}: decode step could not "
                                   f"allocate pages (a bug in admission accounting)")
            n = int(num_out[slot])
            act.tokens.extend(int(t) for t in out_tokens[slot, :n])
            act.acceptance.append(n)
            self._lens[slot] += n
            if len(act.tokens) >= act.max_new_tokens:
                now = time.perf_counter()
                finished.append(Result(act.request_id, act.prompt,
                                       act.tokens[:act.max_new_tokens], act.acceptance,
                                       act.first_token_at - act.submitted,
                                       now - act.first_token_at))
                self._drop(slot, act.request_id)
        return finished

    def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0,
                 arrival_steps=None) -> list[Result]:
        """Generate for every prompt with continuous batching; results in prompt order.

        `arrival_steps[i]` (optional) is the decode step at which prompt i
        arrives, to exercise requests joining mid-run.
        """
        prompts = [self.validate_prompt(p, max_new_tokens) for p in prompts]
        arrival = list(arrival_steps) if arrival_steps is not None else [0] * len(prompts)
        waiting = deque(sorted(range(len(prompts)), key=lambda i: arrival[i]))
        results: dict[str, Result] = {}
        step = 0
        while waiting or self._active:
            while waiting and arrival[waiting[0]] <= step:
                i = waiting[0]
                try:
                    self.add_request(f"req{i}", prompts[i], max_new_tokens,
                                     temperature=temperature)
                except AdmissionError:
                    if not self._active:
                        raise  # nothing will free room: this request can never run
                    break      # full for now; retry after some request finishes
                waiting.popleft()
            for r in self.step(temperature):
                results[r.request_id] = r
            step += 1
        return [results[f"req{i}"] for i in range(len(prompts))]
