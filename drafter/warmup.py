"""Which programs an engine's role runs, compiled before its first request.

A warm-up call's rows all pad (the dummy slot), so it changes nothing a request reads.
What a role compiles:
  * decode of 1 and `decode_steps` steps at every padded row count (not a context);
  * prefill of every padded row count (not a worker fed by a KV source, whose calls
    without decode rows only empty slots: 0 rows);
  * each at every table width of the lengths asked for; greedy, with `sampled` also
    sampling with and without truncation, with `logprobs` also returning
    log-probabilities, with `adjusted` also adjusting logits (and marking prompts);
  * a context's exports or a generation worker's imports (and private mode's redrafts),
    one per page bucket of those lengths;
  * the same, first, for an in-process KV source's context engines.
"""

from __future__ import annotations

import jax


def warm_engine(engine, max_len: int | None = None, min_len: int = 0, *,
                sampled: bool = False, logprobs: bool = False, adjusted: bool = False) -> int:
    """Compile every call `engine` (drafter.engine.Engine) makes for rows of `min_len` to
    `max_len` tokens (default 0 to max_seq_len). Returns the number of table widths."""
    spec, scheduler, executor = engine.spec, engine.scheduler, engine.executor
    max_len = spec.max_seq_len if max_len is None else max_len
    # An in-process source's senders first: one that holds requests refuses at once,
    # before anything here compiles.
    if (warm_source := getattr(engine.kv_source, "warmup", None)) is not None:
        warm_source(max_len, min_len, sampled=sampled, logprobs=logprobs, adjusted=adjusted)
    block = engine.cfg.block_size
    widths = sorted({executor.table_width(n + 2 * block)
                     for n in range(min_len, max_len + 1, spec.page_size)})

    def row_counts(kind, counts):
        return sorted({scheduler.rows_for(kind, n) for n in counts})

    fed = engine.kv_source is not None
    prefill_rows = [0] if fed else row_counts("prefill", range(scheduler.max_prefill_rows + 1))
    decode_steps = [] if engine.export else sorted({1, engine.decode_steps})
    executor.warm(widths, decode_steps=decode_steps,
                  decode_rows=row_counts("decode", range(1, spec.num_slots + 1)),
                  prefill_rows=prefill_rows, sampled=sampled, logprobs=logprobs,
                  adjusted=adjusted)
    if adjusted:   # repetition penalties mark prompts as requests take their slots
        executor.warm_marks(max_len)
    if engine.export or fed:
        executor.warm_transfers(range(max(min_len, 1), max_len + 1),
                                exports=engine.export, imports=fed)
    jax.block_until_ready(engine.state)
    return len(widths)
