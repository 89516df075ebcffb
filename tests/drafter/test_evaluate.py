"""drafter.evaluate's prompt cut (same continuation points, less context) and device rate."""

import pytest

from drafter.engine import Engine
from drafter.evaluate import cut_to_context, device_rate
from tests.drafter.tiny import tiny_pair


def test_a_cut_prompt_keeps_its_first_token_its_tail_and_its_length_label():
    prompts = [{"length": 8, "tokens": [0, 1, 2, 3, 4, 5, 6, 7]},
               {"length": 3, "tokens": [0, 9, 8]}]
    cut = cut_to_context(prompts, 3)
    assert cut[0] == {"length": 8, "tokens": [0, 5, 6, 7]}
    assert cut[1] == prompts[1]   # no longer than BOS + 3: whole
    assert prompts[0]["tokens"] == [0, 1, 2, 3, 4, 5, 6, 7]   # the input is not changed


def test_a_cut_to_nothing_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        cut_to_context([{"length": 4, "tokens": [0, 1, 2, 3]}], 0)


def test_device_rate_steps_and_counts_only_the_slots_holding_requests():
    # One request in a 3-slot engine: a plain step commits one token for it. Counting
    # the free slots too would read 3 tokens a step (each stepped row grows).
    params, _, plain_cfg = tiny_pair(num_slots=3, max_seq_len=96)
    engine = Engine({"target": params["target"]}, plain_cfg, speculative=False)
    engine.add_request("only", list(range(1, 9)), 40)
    engine.prefill_submitted()
    rate = device_rate(engine, steps=2, repeats=1)
    assert rate["tokens_per_step"] == 1.0
    assert rate["device_tokens_per_s"] == pytest.approx(1e3 / rate["device_step_ms"])


def test_device_rate_refuses_an_engine_without_requests():
    params, _, plain_cfg = tiny_pair(num_slots=2)
    engine = Engine({"target": params["target"]}, plain_cfg, speculative=False)
    with pytest.raises(ValueError, match="holding requests"):
        device_rate(engine, steps=2, repeats=1)
