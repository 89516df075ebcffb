"""Engine.warmup on a disaggregated engine compiles its in-process context engines' steps
too, and refuses once a context holds requests."""

import logging

import jax
import pytest

from disagg.sources import disaggregated_engine
from tests.drafter.tiny import tiny_pair


def test_a_warmed_up_disaggregated_engine_compiles_no_step(caplog):
    """A config of its own (max_seq_len 144), so that no other test compiled its steps."""
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=144)
    engine = disaggregated_engine(params, cfg)
    engine.warmup(60)
    prompts = [[(3 * i + j) % 60 + 1 for j in range(n)] for i, n in enumerate((5, 19, 33))]
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            engine.generate(prompts[:1], 8)
            engine.generate(prompts[1:], 8)
    finally:
        jax.config.update("jax_log_compiles", False)
    compiled = [r.getMessage() for r in caplog.records
                if "Finished XLA compilation" in r.getMessage()
                and "packed_step" in r.getMessage()]
    assert not compiled, compiled


def test_warming_a_context_that_holds_requests_is_refused():
    params, cfg, _ = tiny_pair(num_slots=2)
    engine = disaggregated_engine(params, cfg)
    engine.add_request("a", list(range(1, 30)), 4)
    while not any(ctx.busy for ctx in engine.kv_source.contexts):
        engine.step()
    with pytest.raises(RuntimeError, match="before submitting"):
        engine.warmup(60)
    engine.run()
