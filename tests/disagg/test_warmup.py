"""Engine.warmup on a disaggregated engine compiles its in-process context engines' steps
too, and refuses once a context holds requests."""

import pytest

from disagg.sources import disaggregated_engine
from tests.compile_log import compiled_in
from tests.drafter.tiny import tiny_pair


def test_a_warmed_up_disaggregated_engine_compiles_no_step(caplog):
    """A config of its own (max_seq_len 144), so that no other test compiled its steps."""
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=144)
    engine = disaggregated_engine(params, cfg)
    engine.warmup(60)
    prompts = [[(3 * i + j) % 60 + 1 for j in range(n)] for i, n in enumerate((5, 19, 33))]
    with compiled_in(caplog, "packed_step") as compiled:
        engine.generate(prompts[:1], 8)
        engine.generate(prompts[1:], 8)
    assert not compiled, compiled


def test_warming_a_context_that_holds_requests_is_refused():
    """A context worker that holds a request (handed to it as the generation engine's
    fetch does, without running a step: nothing compiles) refuses the warm-up."""
    params, cfg, _ = tiny_pair(num_slots=2)
    engine = disaggregated_engine(params, cfg)
    context, = engine.kv_source.contexts
    context.submit(engine.make_request("a", list(range(1, 30)), max_new_tokens=4))
    assert context.busy
    with pytest.raises(RuntimeError, match="before submitting"):
        engine.warmup(60)
