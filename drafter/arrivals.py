"""A generation engine's side of its KV source: requests awaiting KV, and what arrives.

    admitted ──fetch──> KVSource ──poll──> payload: handed to the scheduler (imported
                                           next step); its first token booked at the
                                           first poll that finds it computed, at the
                                           latest just before its import's step is read
                                  failure / silence past the timeout: the request ends

The first token is the sender's (its prefill sampled it), so booking it needs
no import: time to first token does not wait for the move, the import or the
generation worker's step. Polls never wait on the device; `book_imported` waits only
for tokens the step being read depends on.
"""

from __future__ import annotations

import time

import jax

from drafter.kv_io import KVSource
from drafter.request import Result, logprob_rows, prompt_logprob_rows
from drafter.sampling import LOGPROB_WIDTH
from drafter.scheduler import Phase, Scheduler, Sequence


class Arrivals:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._since: dict[str, float] = {}          # awaiting KV: last progress time
        self._first: dict[str, tuple[Sequence, object]] = {}  # arrived, first token unbooked
        # Fetched, and the source has not answered (KV or failure) yet, even if the request
        # ended here meanwhile: the id stays in use at the source until it answers.
        self._at_source: set[str] = set()

    @property
    def awaiting(self) -> bool:
        return bool(self._since)

    def at_source(self, request_id: str) -> bool:
        """The source still works on a request of this id (no KV or failure came back)."""
        return request_id in self._at_source

    def fetch(self, source: KVSource, seq: Sequence, now: float) -> Result | None:
        """Ask `source` for the request's KV; a source that refuses it ends that request
        alone (its Result)."""
        try:
            source.fetch(seq.request)
        except Exception as e:  # noqa: BLE001 - the source's refusal is this request's
            return self.scheduler.finish(seq, now, "error", f"request {seq.request_id!r}: "
                                         f"its KV source refused it: {type(e).__name__}: {e}",
                                         retryable=passing(e))
        self._since[seq.request_id] = now
        self._at_source.add(seq.request_id)
        return None

    def take(self, source: KVSource, wait_s: float, timeout_s: float) -> list[Result]:
        """Poll `source` (waiting up to `wait_s` for a first arrival), end requests
        whose KV failed or showed no progress for `timeout_s`, book ready first tokens.
        Returns the requests that ended."""
        polled = source.poll(wait_s)
        # After the poll: it may wait, and an in-process source runs the sender's
        # steps inside it, so a time taken before would date arrivals too early.
        now = time.perf_counter()
        results = []
        for request_id, item in polled:
            if item is not None:   # the source's answer: done with this id
                self._at_source.discard(request_id)
            seq = self.scheduler.active.get(request_id)
            if seq is None or seq.phase is not Phase.AWAITING_KV:
                continue  # cancelled or failed meanwhile
            if item is None:  # progress: the wait starts again
                self._since[request_id] = now
                continue
            self._since.pop(request_id, None)
            if isinstance(item, BaseException):
                results.append(self.scheduler.finish(seq, now, "error", f"request "
                               f"{request_id!r}: {type(item).__name__}: {item}",
                               retryable=passing(item)))
            else:
                params = seq.request.params
                missing = ("the first token's" if params.logprobs is not None
                           and item.first_logprobs is None else "the prompt's"
                           if params.prompt_logprobs is not None
                           and sum(n for _, n in item.prompt_logprobs)
                           != len(seq.request.prompt) - 1 else None)
                if missing:
                    results.append(self.scheduler.finish(seq, now, "error", (
                        f"request {request_id!r}: its KV arrived without {missing} "
                        f"log-probabilities, which the request asked for (a sender that "
                        f"does not send them)")))
                    continue
                self.scheduler.kv_arrived(seq, item)
                self._first[request_id] = (seq, item.first_token, item.first_logprobs,
                                           item.prompt_logprobs)
                for x in (item.first_token, item.first_logprobs,
                          *(bits for bits, _ in item.prompt_logprobs)):
                    if hasattr(x, "copy_to_host_async"):
                        # start its read now, so booking it later reads a copy already made
                        x.copy_to_host_async()
        for request_id, since in list(self._since.items()):
            seq = self.scheduler.active.get(request_id)
            if seq is None or seq.phase is not Phase.AWAITING_KV:
                self._since.pop(request_id)
            elif seq.kv is None and now - since > timeout_s:
                self._since.pop(request_id)
                results.append(self.scheduler.finish(seq, now, "error", f"request "
                               f"{request_id!r}: its KV did not arrive within "
                               f"{timeout_s:.1f}s", retryable=True))
        return results + self._book_first_tokens(now)

    def _book_first_tokens(self, now: float) -> list[Result]:
        """Book arrived first tokens the device has computed; never waits for one.
        Ready tokens are read together (one host read, not one per request)."""
        ready = []
        for request_id, (seq, token, logprobs, prompt) in list(self._first.items()):
            if _settled(seq):
                del self._first[request_id]
            elif all(not hasattr(x, "is_ready") or x.is_ready()
                     for x in (token, logprobs, *(bits for bits, _ in prompt))):
                del self._first[request_id]
                ready.append((seq, token, logprobs, prompt))
        return self._book(ready, now)

    def book_imported(self, seqs) -> list[Result]:
        """Book the unbooked first tokens of `seqs`, whose import is in the step about to
        be read, waiting for them: an import takes its first token as an input, so the
        token is computed before the step's outputs are, and it is dated by its own read,
        not by the import's and its decode steps'."""
        entries = [self._first.pop(seq.request_id) for seq in seqs
                   if seq.request_id in self._first]
        ready = [entry for entry in entries if not _settled(entry[0])]
        return self._book(ready, None) if ready else []

    def _book(self, ready, now: float | None) -> list[Result]:
        """Book (seq, first token, its log-probabilities, prompt parts) entries, read
        together (one host read), at `now` (None: once read)."""
        results = []
        read = jax.device_get([(t, lp, p) for _, t, lp, p in ready])
        now = time.perf_counter() if now is None else now
        for (seq, *_), (token, logprobs, prompt) in zip(ready, read):
            self.scheduler.book_prompt_logprobs(seq, prompt_logprob_rows(prompt,
                                                                         LOGPROB_WIDTH))
            if (r := self.scheduler.emit(seq, [int(token)], now, decode_step=False,
                                         logprobs=logprob_rows(logprobs))):
                results.append(r)
        return results


def _settled(seq) -> bool:
    """No first token left to book: the request ended, or its import booked it."""
    return seq.phase is Phase.DONE or bool(seq.tokens)


def passing(error: BaseException) -> bool:
    """Whether a KV source's failure passes, so that the same request sent again may be
    served: the exception says so with a true `retryable` attribute
    (disagg.transfer.TransferError's: a peer gone, hung or slow); any other failure (a
    mismatched pair, a bug) does not."""
    return getattr(error, "retryable", False) is True
