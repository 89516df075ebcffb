"""drafter.evaluate's prompt sets, AL interval, prompt cut (same continuation points, less
context) and device rate."""

import collections
import json
import types

import numpy as np
import pytest

from drafter.corpus import BOS
from drafter.default import decode_tokens, load_acceptance_prompts, load_prompts
from drafter.engine import Engine
from drafter.acceptance_intervals import compare, interval, paired_difference
from drafter.evaluate import cut_to_context, device_rate, divergences, first_divergence
from drafter.make_prompts import ACCEPTANCE_PER_LENGTH, SHIPPED, encode, prompt_sets
from models.qwen3 import dense_forward
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


def test_a_paired_difference_is_exact_and_tighter_than_the_two_intervals():
    """Prompts from easy (AL 7) to hard (AL 2), a candidate one token a step better on
    each but the first: the pooled difference exactly, an interval above zero though the
    two runs' own intervals overlap; the same run against itself: 0, 0 to 0."""
    rng = np.random.default_rng(3)
    base = [[int(a) * 20, 20] for a in rng.integers(2, 8, 16)]
    better = [[c + (20 if k else 0), s] for k, (c, s) in enumerate(base)]
    diff, low, high = paired_difference(base, better)
    pooled = lambda rows: sum(c for c, _ in rows) / sum(s for _, s in rows)
    assert diff == pytest.approx(pooled(better) - pooled(base))
    assert 0 < low <= diff <= high <= 1
    as_steps = lambda rows: [[c // s] * s for c, s in rows]
    (_, base_high), (better_low, _) = interval(as_steps(base)), interval(as_steps(better))
    assert better_low < base_high                      # apart, they would not tell
    assert paired_difference(base, base) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="16 against 15"):
        paired_difference(base, better[1:])


def test_compare_pairs_lengths_and_refuses_other_prompts_or_missing_steps():
    row = lambda length, steps: {"prompt_length": length, "per_prompt_steps": steps}
    head = {"prompts": "acceptance", "max_new": 64, "context": None, "block_size": 8}
    base = head | {"by_length": [row(128, [[30, 10], [20, 10]]), row(512, [[9, 3]])]}
    cand = head | {"by_length": [row(128, [[40, 10], [30, 10]]), row(8192, [[9, 3]])]}
    (only,) = compare(base, cand)                      # the length both hold
    assert only["prompt_length"] == 128 and only["difference"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_new 64 there, 32 here"):
        compare(base, cand | {"max_new": 32})
    old = head | {"by_length": [{"prompt_length": 128, "per_prompt_al": [3.0, 2.0]}]}
    with pytest.raises(ValueError, match="no per-prompt steps.*evaluate the baseline again"):
        compare(old, cand)
    with pytest.raises(ValueError, match="shares no prompt length"):
        compare(base, head | {"by_length": [row(2048, [[9, 3]])]})


def test_compare_to_keeps_the_paired_difference_and_refuses_other_prompts_first(
        tmp_path, monkeypatch, capsys):
    """`evaluate --compare-to JSON` writes and prints this run's AL minus the baseline's
    per length; a baseline of other prompts or no report at all is refused before any
    decoding."""
    from drafter import evaluate
    rows = [{"prompt_length": 128, "acceptance_length": 3.5,
             "per_prompt_steps": [[40, 10], [30, 10]]}]
    monkeypatch.setattr(evaluate, "acceptance_by_length", lambda *a, **k: rows)
    head = {"prompts": "acceptance", "max_new": 8, "context": 16, "block_size": 8}
    base = tmp_path / "base.json"
    base.write_text(json.dumps(head | {"draft": "shipped", "by_length": [
        {"prompt_length": 128, "per_prompt_steps": [[30, 10], [20, 10]]}]}))
    out = tmp_path / "cand.json"
    evaluate.main(["--compare-to", str(base), "--max-new", "8", "--context", "16",
                   "--lengths", "128", "--json", str(out)])
    (row,) = json.loads(out.read_text())["compared_to"]["by_length"]
    assert row["prompt_length"] == 128 and row["difference"] == pytest.approx(1.0)
    assert "AL +1.00 against" in capsys.readouterr().out
    monkeypatch.setattr(evaluate, "acceptance_by_length",
                        lambda *a, **k: pytest.fail("decoded before the check"))
    with pytest.raises(SystemExit, match="max_new 8 there, 64 here"):
        evaluate.main(["--compare-to", str(base), "--context", "16", "--json", str(out)])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match="not a readable report"):
        evaluate.main(["--compare-to", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit, match="give the candidate with --draft DIR"):
        evaluate.main(["--compare-to", "shipped"])


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


def test_first_divergence_finds_a_parting_or_an_early_end():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2   # one stopped, the other went on


def test_divergences_judge_a_parting_by_the_exact_logits_there():
    """Plain greedy output from the engine; a 'speculative' output that takes the worst
    token at position 2 is no near-tie, and one that ends early is reported as a stop."""
    params, cfg, plain_cfg = tiny_pair(num_slots=2)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    plain = Engine({"target": params["target"]}, plain_cfg, speculative=False).generate(
        prompts, 6)
    logits = np.asarray(dense_forward(params["target"], plain_cfg.target,
                                      np.asarray([prompts[0] + plain[0].tokens[:2]]))[0][0, -1])
    assert int(logits.argmax()) == plain[0].tokens[2]
    worst = int(logits.argmin())
    wrong = types.SimpleNamespace(tokens=plain[0].tokens[:2] + [worst] + plain[0].tokens[3:])
    short = types.SimpleNamespace(tokens=plain[1].tokens[:3])
    assert divergences(params, plain_cfg.target, prompts, plain, plain) == []
    parted = divergences(params, plain_cfg.target, prompts, [wrong, short], plain)
    assert parted[0]["prompt"] == 0 and parted[0]["at"] == 2
    assert parted[0]["tokens"] == [worst, plain[0].tokens[2]]
    assert parted[0]["gap_std"] > 1 and not parted[0]["near_tie"]
    assert parted[1] == {"prompt": 1, "at": 3, "tokens": None, "gap_std": None,
                         "near_tie": False}
