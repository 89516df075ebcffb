"""The scheduler's slot resets: each slot at most once a step, whatever ends meanwhile."""

import numpy as np

from drafter.request import Request, SamplingParams
from drafter.scheduler import Scheduler, Sequence
from tests.drafter.tiny import tiny_pair


def make(rid, n=6):
    return Sequence(Request.make(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=4),
                                 vocab_size=64), 0.0)


def test_a_request_ending_in_a_slot_whose_reset_was_deferred_lists_it_once():
    _, cfg, _ = tiny_pair(num_slots=2)
    sched = Scheduler(cfg.spec, cfg.block_size, max_num_batched_tokens=64,
                      kv_from_source=True)
    a = make("a")
    sched.add(a)
    plan = sched.schedule()
    assert plan.reset_slots == [a.slot] and plan.fetch == [a]
    sched.defer_resets(plan.reset_slots)          # nothing else ran: the import carries it
    sched.finish(a, 1.0, "error", "its KV source failed")  # before that import
    assert sched.schedule().reset_slots == [a.slot]


def test_resets_stay_unique_and_within_the_slots_under_random_churn():
    _, cfg, _ = tiny_pair(num_slots=3)
    sched = Scheduler(cfg.spec, cfg.block_size, max_num_batched_tokens=64,
                      kv_from_source=True)
    rng = np.random.default_rng(0)
    for i in range(300):
        if rng.random() < 0.6:
            sched.add(make(f"r{i}"))
        plan = sched.schedule()
        assert len(plan.reset_slots) == len(set(plan.reset_slots)) <= cfg.spec.num_slots
        if plan.reset_slots and rng.random() < 0.5:
            sched.defer_resets(plan.reset_slots)
        for seq in list(sched.active.values()):
            if rng.random() < 0.3:
                sched.finish(seq, float(i), "error", "churn")


def test_short_prompts_fill_at_most_the_budgets_whole_chunks_per_step():
    """Prefill rows are padded to full chunks: four short prompts under a two-chunk
    budget take two steps of two rows, not one of four (a row count never compiled)."""
    _, cfg, _ = tiny_pair(num_slots=4)
    chunk = cfg.spec.max_step_tokens
    sched = Scheduler(cfg.spec, cfg.block_size, max_num_batched_tokens=2 * chunk)
    assert sched.max_prefill_rows == 2
    for i in range(4):
        sched.add(make(f"r{i}", n=3))
    assert [len(sched.schedule().prefill) for _ in range(3)] == [2, 2, 0]
    lone = Scheduler(cfg.spec, cfg.block_size, max_num_batched_tokens=chunk // 2)
    assert lone.max_prefill_rows == 1   # below one chunk: still one row a step


def test_calls_run_their_rows_padded_to_a_power_of_two_or_every_row_when_invariant():
    """A call's rows follow its items within 2x (a power of two, up to the most it holds:
    the step's prefill rows, the slots); batch-invariant, always the most."""
    _, cfg, _ = tiny_pair(num_slots=6)
    chunk = cfg.spec.max_step_tokens
    padded = Scheduler(cfg.spec, cfg.block_size, max_num_batched_tokens=4 * chunk)
    fixed = Scheduler(cfg.spec, cfg.block_size, max_num_batched_tokens=4 * chunk,
                      batch_invariant=True)
    assert [padded.rows_for("decode", n) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert [padded.rows_for("prefill", n) for n in range(5)] == [0, 1, 2, 4, 4]
    assert [fixed.rows_for("decode", n) for n in range(1, 7)] == [6] * 6
    assert [fixed.rows_for("prefill", n) for n in range(5)] == [0, 4, 4, 4, 4]
