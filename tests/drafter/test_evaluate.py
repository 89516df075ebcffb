"""drafter.evaluate's prompt sets, AL interval, prompt cut (same continuation points, less
context) and device rate."""

import collections

import numpy as np
import pytest

from drafter.corpus import BOS
from drafter.default import decode_tokens, load_acceptance_prompts, load_prompts
from drafter.engine import Engine
from drafter.evaluate import cut_to_context, device_rate, interval
from drafter.make_prompts import ACCEPTANCE_PER_LENGTH, SHIPPED, encode, prompt_sets
from tests.drafter.tiny import tiny_pair


def test_the_acceptance_set_holds_16_prompts_a_length_with_the_shipped_ones_first():
    shipped, acceptance = load_prompts(), load_acceptance_prompts()
    assert collections.Counter(p["length"] for p in acceptance) == {
        n: ACCEPTANCE_PER_LENGTH for n in SHIPPED}
    for n, count in SHIPPED.items():
        ours = [p["tokens"] for p in acceptance if p["length"] == n]
        assert ours[:count] == [p["tokens"] for p in shipped if p["length"] == n]
        assert all(len(t) == n and t[0] == BOS for t in ours)
        assert len({tuple(t) for t in ours}) == ACCEPTANCE_PER_LENGTH   # no repeats


def test_prompt_sets_draw_line_starts_and_the_shipped_set_again():
    lines = [f"line {i} {'x' * (i % 37)}\n" for i in range(4000)]
    stream = np.frombuffer("".join(lines).encode(), np.uint8).astype(np.int64)
    shipped, acceptance = prompt_sets(stream)
    assert prompt_sets(stream) == (shipped, acceptance)   # seeded: the same files again
    text = "".join(lines)
    for p in acceptance:
        body = bytes(p["tokens"][1:]).decode()
        at = text.find(body)
        assert at == 0 or text[at - 1] == "\n"
    assert [p for p in acceptance if p in shipped] == sorted(shipped, key=lambda p: p["length"])
    assert decode_tokens(encode(acceptance[0])["tokens"]) == acceptance[0]["tokens"]


def test_the_al_interval_pools_steps_and_narrows_with_agreeing_prompts():
    alike = [[3, 3, 3]] * 6
    assert interval(alike) == (3.0, 3.0)
    mixed = [[1, 1, 1, 1], [8, 8], [2, 4], [5], [1, 2, 1]]
    low, high = interval(mixed)
    pooled = sum(map(sum, mixed)) / sum(map(len, mixed))
    assert low < pooled < high and 1 <= low and high <= 8
    # more prompts of the same kinds: a narrower interval
    low4, high4 = interval(mixed * 4)
    assert high4 - low4 < high - low


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
