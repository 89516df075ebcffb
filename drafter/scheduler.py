"""The scheduler: which requests run, and what each step does for them.

Host-side and array-free. Each step it makes a `StepPlan`:

    waiting ──admit (slot + worst-case pages per pool)──> prefilling ──last chunk──> running
       │                                                                      ^
       └──admit, KV from a source──> awaiting KV ──arrived──> import ─────────┘
    running ──stop id / EOS / max_new_tokens / error──> done (slot reset next step)

Admission goes through `AdmissionController` (host ints only); the scheduler
never touches page tables or free lists. A request that does not fit waits
(first come, first served) until a finished one frees room; one that can
never fit is refused when submitted. Prefill chunks start at multiples of the
cache's `max_step_tokens`, so a prompt is cut the same way whatever shares
its steps; several prompts' chunks and every running row share a step under
`max_num_batched_tokens` (a decode row costs `block_size` tokens).

Steps run one ahead of the host (the engine dispatches plan N+1 before it
reads step N), so a request may decode one step past its end: admission
reserves `block_size` more tokens per step of lookahead, and outputs of a
request already done are dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from drafter.request import Request, Result, TokenLogprobs
from unified_kv import AdmissionController, AdmissionError, CacheSpec, check_fits


def padded_rows(n: int, most: int) -> int:
    """Rows a call of n items (prefill chunks, exports, imports) runs: the next power of
    two, at most `most` (0 for 0). A call's shape then follows its items within 2x, and a
    stream compiles log2(most) + 1 shapes (`row_shapes`), not one per count."""
    return 0 if n <= 0 else min(most, 1 << (n - 1).bit_length())


def row_shapes(most: int) -> list[int]:
    """Every row count `padded_rows` gives for 1..most items, ascending."""
    return sorted({padded_rows(n, most) for n in range(1, most + 1)})


class Phase(enum.Enum):
    WAITING = "waiting"
    AWAITING_KV = "awaiting_kv"
    PREFILLING = "prefilling"
    RUNNING = "running"
    EXPORTED = "exported"
    DONE = "done"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's progress (host state only)."""

    request: Request
    submitted: float
    slot: int | None = None
    phase: Phase = Phase.WAITING
    num_prefilled: int = 0          # prompt tokens already planned
    kv: object = None               # an arrived KV payload awaiting import
    tokens: list = dataclasses.field(default_factory=list)
    acceptance: list = dataclasses.field(default_factory=list)
    token_times: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)   # TokenLogprobs per token
    # TokenLogprobs per prompt token but the first
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    first_token_at: float | None = None
    result: Result | None = None
    stop_ids: frozenset = frozenset()   # ids that end it: its stop ids, and EOS unless ignored

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int
    num_tokens: int
    is_last: bool


@dataclasses.dataclass
class StepPlan:
    """What one step does. `fetch`: newly admitted requests whose KV a source
    must now produce; `exports`: requests whose prefill ends in this step and
    leave through an export (the context role)."""

    reset_slots: list[int] = dataclasses.field(default_factory=list)
    imports: list[Sequence] = dataclasses.field(default_factory=list)
    prefill: list[PrefillChunk] = dataclasses.field(default_factory=list)
    decode: list[Sequence] = dataclasses.field(default_factory=list)
    fetch: list[Sequence] = dataclasses.field(default_factory=list)
    exports: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def runs_step(self) -> bool:
        """Imports, prefill or decode: work beyond emptying slots."""
        return bool(self.imports or self.prefill or self.decode)

    @property
    def runs_device_work(self) -> bool:
        return bool(self.reset_slots) or self.runs_step


class Scheduler:
    """Args:
      spec: the cache; block_size: tokens a decode row verifies per step.
      max_num_batched_tokens: per-step token budget (decode rows + prefill chunks).
      kv_from_source: admitted requests get their KV from a source, not a local prefill.
      export: prefilled requests leave (a context worker) instead of decoding.
      lookahead: steps the engine dispatches before reading outputs.
      decode_steps: decode steps one call may run back to back.
      eos_token_ids: ids that end a request unless it sets ignore_eos.
      batch_invariant: every call of a kind runs its most rows (`rows_for`).
    """

    def __init__(self, spec: CacheSpec, block_size: int, *, max_num_batched_tokens: int,
                 kv_from_source: bool = False, export: bool = False, lookahead: int = 1,
                 eos_token_ids=(), decode_steps: int = 1, batch_invariant: bool = False):
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.spec, self.block_size = spec, block_size
        self.budget = max_num_batched_tokens
        self.kv_from_source, self.export = kv_from_source, export
        self.lookahead, self.eos_token_ids = lookahead, frozenset(eos_token_ids)
        self.decode_steps, self.batch_invariant = decode_steps, batch_invariant
        self.admission = AdmissionController(spec)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.active: dict[str, Sequence] = {}      # admitted, not done
        self._resets: list[int] = []

    @property
    def max_prefill_rows(self) -> int:
        """Prefill chunks one step holds at most: the budget in whole chunks (at least
        one, at most a slot each). Short chunks do not raise it: a step's prefill rows
        are padded to full chunks anyway, so the budget bounds its padded tokens (a
        call's rows are padded to a power of two up to this: `padded_rows`)."""
        return min(self.spec.num_slots, max(1, self.budget // self.spec.max_step_tokens))

    def rows_for(self, kind: str, n: int) -> int:
        """Rows a call of `kind` ("prefill": chunks, "decode": running requests) runs for
        n of them: `padded_rows` up to the most it holds (a step's prefill rows; the
        slots), so a lightly loaded step computes for its rows, not for every slot, and
        few shapes compile; batch-invariant, always the most (0 prefill chunks: a call
        that only empties slots)."""
        most = self.max_prefill_rows if kind == "prefill" else self.spec.num_slots
        return most if self.batch_invariant and n else padded_rows(n, most)

    # ----------------------------------------------------------- requests

    def reserved_len(self, request: Request) -> int:
        """Tokens a request may occupy: prompt, outputs, and a verify block for
        every step that may run past its end (the rest of its call's decode
        steps, then a whole call in flight ahead). The context role holds the
        prompt only."""
        if self.export:
            return len(request.prompt) + self.block_size
        return (len(request.prompt) + request.params.max_new_tokens
                + self.block_size * self.decode_steps * (1 + self.lookahead))

    def check_fits(self, request: Request) -> None:
        """AdmissionError if the request could not run even in an empty cache."""
        need = self.reserved_len(request)
        if need > self.spec.max_seq_len:
            raise AdmissionError(
                f"request {request.request_id!r}: prompt of {len(request.prompt)} tokens + "
                f"max_new_tokens={request.params.max_new_tokens} + verify and lookahead "
                f"blocks = {need} exceeds max_seq_len={self.spec.max_seq_len}; shorten the "
                f"prompt or max_new_tokens, or build a larger cache")
        check_fits(self.spec, request.request_id, need)  # every pool's pages

    def add(self, seq: Sequence) -> None:
        rid = seq.request_id
        if rid in self.active or any(s.request_id == rid for s in self.waiting):
            raise AdmissionError(f"request id {rid!r} is already in flight; ids must be unique")
        self.check_fits(seq.request)
        params = seq.request.params
        params.early_bans(rid, self.eos_token_ids)   # RequestError if they cannot fit
        seq.stop_ids = params.stop_ids(self.eos_token_ids)
        self.waiting.append(seq)

    def kv_arrived(self, seq: Sequence, payload) -> None:
        if seq.phase is Phase.AWAITING_KV:
            seq.kv = payload

    def _take_arrived(self, plan: StepPlan) -> None:
        """Requests whose KV has arrived join `plan`: imported, then decoded, in its step."""
        for seq in self.active.values():
            if seq.phase is Phase.AWAITING_KV and seq.kv is not None:
                seq.phase = Phase.RUNNING
                plan.imports.append(seq)
                plan.decode.append(seq)

    def defer_resets(self, slots: list[int]) -> None:
        """Slots a plan did not empty: the next step's first call empties them (before
        any import or prefill into them)."""
        for slot in slots:
            self._reset_next(slot)

    def _reset_next(self, slot: int) -> None:
        """Empty `slot` in the next step; a slot is listed once, however many requests
        left it meanwhile (one admitted into a slot whose reset was deferred can end
        before that step)."""
        if slot not in self._resets:
            self._resets.append(slot)

    @property
    def has_pending_resets(self) -> bool:
        return bool(self._resets)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.active)

    # ----------------------------------------------------------- planning

    def schedule(self) -> StepPlan:
        plan = StepPlan(reset_slots=self._resets)
        self._resets = []
        self._admit(plan)
        plan.decode = [s for s in self.active.values() if s.phase is Phase.RUNNING]
        self._take_arrived(plan)
        budget = self.budget - self.block_size * len(plan.decode)
        chunk = self.spec.max_step_tokens
        for seq in self.active.values():
            if seq.phase is not Phase.PREFILLING:
                continue
            if len(plan.prefill) == self.max_prefill_rows:
                break
            n = min(chunk, len(seq.request.prompt) - seq.num_prefilled)
            if n > budget and (plan.prefill or plan.decode):
                break
            is_last = seq.num_prefilled + n == len(seq.request.prompt)
            plan.prefill.append(PrefillChunk(seq, seq.num_prefilled, n, is_last))
            seq.num_prefilled += n
            budget -= n
            if is_last:
                seq.phase = Phase.EXPORTED if self.export else Phase.RUNNING
                if self.export:
                    plan.exports.append(seq)
        return plan

    def _admit(self, plan: StepPlan) -> None:
        while self.waiting:
            seq = self.waiting[0]
            try:
                res = self.admission.admit(seq.request_id, self.reserved_len(seq.request))
            except AdmissionError:
                return  # full for now: retry when a request finishes
            self.waiting.popleft()
            seq.slot = res.slot
            if res.slot not in plan.reset_slots:  # a slot is reset at most once per step
                plan.reset_slots.append(res.slot)  # fresh: no pages, not running
            self.active[seq.request_id] = seq
            if self.kv_from_source:
                seq.phase = Phase.AWAITING_KV
                plan.fetch.append(seq)
            else:
                seq.phase = Phase.PREFILLING

    # ------------------------------------------------------------ results

    def finish(self, seq: Sequence, now: float, reason: str, error: str | None = None, *,
               retryable: bool = False) -> Result:
        """End a request (any phase): its slot is reset by the next step. `retryable`:
        see `Result`."""
        if seq.phase is Phase.WAITING:
            self.waiting.remove(seq)
        elif seq.phase is not Phase.DONE:
            self.admission.release(seq.request_id)
            self.active.pop(seq.request_id)
            self._reset_next(seq.slot)
        seq.phase = Phase.DONE
        first = seq.first_token_at if seq.first_token_at is not None else now
        seq.result = Result(seq.request_id, list(seq.request.prompt), seq.tokens, seq.acceptance,
                            first - seq.submitted, now - first, reason, error,
                            [t - seq.submitted for t in seq.token_times],
                            seq.logprobs if seq.request.params.logprobs is not None else None,
                            [None, *seq.prompt_logprobs]
                            if seq.request.params.prompt_logprobs is not None else None,
                            retryable)
        return seq.result

    def book_prompt_logprobs(self, seq: Sequence, rows) -> None:
        """Book prompt log-probabilities (f32[n, LOGPROB_WIDTH] rows, the next n prompt
        tokens after those booked) if the request asked for them."""
        if (top := seq.request.params.prompt_logprobs) is not None:
            seq.prompt_logprobs.extend(TokenLogprobs.of_row(row, top) for row in rows)

    def emit(self, seq: Sequence, new_tokens, now: float, *, decode_step: bool,
             logprobs=None) -> Result | None:
        """Book tokens a step produced for `seq`; returns its Result if it ended.
        Tokens past max_new_tokens or a stop id are dropped and not counted.
        `logprobs`: f32[len(new_tokens), LOGPROB_WIDTH] (`sampling.token_logprobs`), read
        when the request asked for log-probabilities."""
        if seq.phase is Phase.DONE:
            return None  # a step dispatched ahead ran past the end
        params = seq.request.params
        tokens = new_tokens.tolist() if hasattr(new_tokens, "tolist") else list(new_tokens)
        room = params.max_new_tokens - len(seq.tokens)
        kept, reason = tokens[:room], ("length" if len(tokens) >= room else None)
        stops = seq.stop_ids
        if stops and not stops.isdisjoint(kept):
            end = next(i for i, t in enumerate(kept) if t in stops) + 1
            kept, reason = kept[:end], "stop"
        if seq.first_token_at is None and kept:
            seq.first_token_at = now
        seq.tokens.extend(kept)
        seq.token_times.extend([now] * len(kept))
        if (top := params.logprobs) is not None:
            seq.logprobs.extend(TokenLogprobs.of_row(row, top) for row in logprobs[:len(kept)])
        if decode_step:
            seq.acceptance.append(len(kept))
        return self.finish(seq, now, reason) if reason else None

    def release_exported(self, seq: Sequence) -> None:
        """A context worker's request has left: free its slot (reset next step)."""
        self.admission.release(seq.request_id)
        self.active.pop(seq.request_id)
        self._reset_next(seq.slot)
        seq.phase = Phase.DONE
