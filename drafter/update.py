"""Booking a step's outputs into its requests: the lifecycle's update, after schedule and
execute.

    StepPlan + StepOutputs (host arrays) + per import (ok, first token, origin, ...)
        ──> Scheduler.emit (tokens kept, stop ids, max_new_tokens) / Scheduler.finish
        ──> the Results of requests that ended

A failure is its own request's: a failed import, a prefill or decode row that got no
pages ends that request with finish_reason "error" and a message naming it; every other
row of the step is booked as usual. Outputs of a request already done (a step dispatched
ahead ran past its end) are dropped.
"""

from __future__ import annotations

from drafter.kv_io import import_failure
from drafter.request import Result, logprob_rows, prompt_logprob_rows
from drafter.sampling import LOGPROB_WIDTH
from drafter.scheduler import Phase, Scheduler, StepPlan


def update_from_output(scheduler: Scheduler, plan: StepPlan, outputs, imported, now: float,
                       *, export: bool) -> list[Result]:
    """Book `plan`'s outputs (`StepOutputs` of host arrays; `imported`: per import of the
    plan, (ok, first token, origin, first token's log-probability bits or None, prompt
    log-probability parts), or None when the host refused it at dispatch). A context
    worker (`export`) books no first tokens: its requests leave instead."""
    results = []

    def book(seq, tokens, decode_step, logprobs=None):
        if (r := scheduler.emit(seq, tokens, now, decode_step=decode_step,
                                logprobs=logprobs)) is not None:
            results.append(r)

    for seq, got in zip(plan.imports, imported):
        if got is None:  # refused on the host: its request ended at dispatch
            results.append(seq.result)
            continue
        if seq.phase is Phase.DONE:
            continue
        ok, first, origin, first_logprobs, prompt_parts = got
        if not ok:
            results.append(scheduler.finish(seq, now, "error",
                                            import_failure(seq.request_id, origin),
                                            retryable=True))
        elif not seq.tokens:  # not booked on arrival
            scheduler.book_prompt_logprobs(seq, prompt_logprob_rows(prompt_parts,
                                                                    LOGPROB_WIDTH))
            book(seq, [int(first)], False, logprob_rows(first_logprobs))
    for i, chunk in enumerate(plan.prefill):
        seq = chunk.seq
        if seq.phase is Phase.DONE and seq not in plan.exports:
            continue
        if not outputs.prefill_ok[i]:
            results.append(scheduler.finish(seq, now, "error", (
                f"request {seq.request_id!r}: prefill could not allocate pages although "
                f"admission reserved them (a bug in page accounting)")))
        elif not export:
            # the chunk's positions predict its next tokens; a last chunk's last, the first
            # generated one
            scheduler.book_prompt_logprobs(
                seq, outputs.prompt_logprobs[i, :chunk.num_tokens - chunk.is_last])
            if chunk.is_last:
                book(seq, [int(outputs.first_tokens[i])], False,
                     outputs.first_logprobs[i:i + 1])
    num_out, decode_ok = outputs.num_out.tolist(), outputs.decode_ok.tolist()
    for j in range(len(num_out)):  # the call's decode steps, in order
        for row, seq in enumerate(plan.decode):   # the decode call's rows, in order
            if seq.phase is Phase.DONE:
                continue
            if not decode_ok[j][row]:
                results.append(scheduler.finish(seq, now, "error", (
                    f"request {seq.request_id!r}: a decode step could not allocate pages "
                    f"(a bug in admission accounting)")))
                continue
            n = num_out[j][row]
            book(seq, outputs.out_tokens[j, row, :n], True, outputs.out_logprobs[j, row, :n])
    return results
