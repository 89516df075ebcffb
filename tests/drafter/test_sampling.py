"""Sampling: the truncation against a numpy reference, and lossless rejection sampling
under it (the tokens a row emits are distributed as its truncated target distribution);
logit bias and penalties against counting position by position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafter.request import MAX_LOGIT_BIAS
from drafter.slot_sampling import EVERY_POSITION
from drafter.sampling import (Sampler, accept, adjust, adjust_reference, adjusted_drafts,
                              sample, truncate, truncate_row)


def reference_kept(logits, top_k, top_p, min_p):
    """The kept set by its definition, token by token (float64)."""
    order = np.argsort(-logits, kind="stable")
    k = len(logits) if top_k <= 0 else min(top_k, len(logits))
    top = logits[order[:k]]
    probs = np.exp(top - top.max())
    probs /= probs.sum()
    kept_n = k
    if top_p < 1:
        ahead = np.cumsum(probs) - probs
        kept_n = int(np.sum(ahead < top_p))
    threshold = top[kept_n - 1]
    if min_p > 0:
        threshold = max(threshold, top[0] + np.log(min_p))
    return logits >= threshold


@pytest.mark.parametrize("seed", range(40))
def test_truncation_keeps_what_its_definition_keeps(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 40))
    # Coarse values make ties at the threshold; they are all kept.
    logits = np.round(rng.normal(size=vocab) * 2, 0 if seed % 3 == 0 else 3).astype(np.float32)
    top_k = int(rng.choice([0, -1, 1, 2, 5, vocab, vocab + 3]))
    top_p = float(rng.choice([1.0, 0.9, 0.5, 0.1, 1e-6]))
    min_p = float(rng.choice([0.0, 0.05, 0.3, 1.0]))
    got = np.isfinite(np.asarray(truncate_row(jnp.asarray(logits), top_k, top_p, min_p)))
    want = reference_kept(logits.astype(np.float64), top_k, top_p, min_p)
    assert got.tolist() == want.tolist(), (logits, top_k, top_p, min_p)
    assert got[np.argmax(logits)]     # the most likely token always stays


def sampler(batch, *, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, key=0):
    return Sampler(jnp.full((batch,), temperature, jnp.float32),
                   jax.random.split(jax.random.key(key), batch),
                   jnp.full((batch,), top_k, jnp.int32), jnp.full((batch,), top_p, jnp.float32),
                   jnp.full((batch,), min_p, jnp.float32), jnp.zeros((batch,), jnp.float32),
                   jnp.zeros((batch,), jnp.float32), jnp.ones((batch,), jnp.float32),
                   jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.int32),
                   jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.float32),
                   jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.int32), greedy=False, truncated=True)


def truncated_probs(logits, **kw):
    row = truncate_row(jnp.asarray(logits), kw.get("top_k", 0), kw.get("top_p", 1.0),
                       kw.get("min_p", 0.0))
    return np.asarray(jax.nn.softmax(row))


def assert_distributed_as(draws, probs, n):
    """Each token's count within 5 standard deviations of n x its probability; tokens of
    probability 0 never drawn."""
    counts = np.bincount(draws, minlength=len(probs))
    sd = np.sqrt(n * probs * (1 - probs)) + 1e-9
    assert np.all(counts[probs == 0] == 0), (counts, probs)
    assert np.all(np.abs(counts - n * probs) <= 5 * sd + 1), (counts, n * probs)


TRUNCATIONS = [dict(), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2),
               dict(top_k=4, top_p=0.8, min_p=0.05)]


@pytest.mark.parametrize("kw", TRUNCATIONS)
def test_sampled_tokens_follow_the_truncated_distribution(kw):
    n, vocab = 20000, 8
    logits = jax.random.normal(jax.random.key(1), (vocab,)) * 1.5
    draws = sample(jnp.broadcast_to(logits, (n, vocab)), sampler(n, **kw))
    assert_distributed_as(np.asarray(draws), truncated_probs(logits, **kw), n)


@pytest.mark.parametrize("kw", TRUNCATIONS)
@pytest.mark.parametrize("draft_rank", [0, 1, 5])
def test_speculative_sampling_is_lossless_under_truncation(kw, draft_rank):
    """Over many keys: the first emitted token is distributed as position 0's truncated
    distribution, and after an accepted first draft the second as position 1's, whether
    the drafts are likely, unlikely, or truncated away."""
    n, vocab, block = 20000, 8, 4
    logits = jax.random.normal(jax.random.key(2), (block, vocab)) * 1.5
    drafts = jnp.argsort(-logits[:-1], axis=-1)[:, draft_rank].astype(jnp.int32)
    accepted, bonus = accept(jnp.broadcast_to(logits, (n, block, vocab)),
                             jnp.broadcast_to(drafts, (n, block - 1)), sampler(n, **kw))
    accepted, bonus = np.asarray(accepted), np.asarray(bonus)
    first = np.where(accepted >= 1, int(drafts[0]), bonus)
    assert_distributed_as(first, truncated_probs(logits[0], **kw), n)
    took = accepted >= 1
    second = np.where(accepted[took] >= 2, int(drafts[1]), bonus[took])
    assert_distributed_as(second, truncated_probs(logits[1], **kw), int(took.sum()))


def test_rows_that_do_not_truncate_are_untouched_beside_one_that_does():
    logits = jax.random.normal(jax.random.key(3), (3, 5, 11))
    s = sampler(3).replace(top_ks=jnp.array([0, 2, -1], jnp.int32))
    out = np.asarray(truncate(logits, s))
    np.testing.assert_array_equal(out[[0, 2]], np.asarray(logits)[[0, 2]])
    assert (np.isfinite(out[1]).sum(axis=-1) == 2).all()
    untruncated = s.replace(truncated=False)   # a step that does not truncate ignores them
    np.testing.assert_array_equal(np.asarray(truncate(logits, untruncated)), logits)


@pytest.mark.parametrize("vocab", [64, 7])
def test_token_logprobs_equal_a_float64_log_softmax(vocab):
    """The token's log-probability, then the MAX_LOGPROBS most likely ids and theirs, most
    likely first (a vocabulary smaller than MAX_LOGPROBS pads with id -1 at -inf), then
    the token's rank."""
    from drafter.request import MAX_LOGPROBS, TokenLogprobs
    from drafter.sampling import LOGPROB_WIDTH, token_logprobs
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(3, 5, vocab)) * 4
    tokens = rng.integers(0, vocab, size=(3, 5))
    got = np.asarray(token_logprobs(jnp.asarray(logits, jnp.float32), jnp.asarray(tokens)))
    assert got.shape == (3, 5, LOGPROB_WIDTH)
    shifted = logits - logits.max(-1, keepdims=True)
    reference = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    top = min(vocab, MAX_LOGPROBS)
    for b, i in np.ndindex(3, 5):
        row, want = got[b, i], reference[b, i]
        order = np.argsort(-want, kind="stable")[:top]
        np.testing.assert_allclose(row[0], want[tokens[b, i]], atol=1e-5)
        assert row[1:1 + top].astype(int).tolist() == order.tolist()
        np.testing.assert_allclose(row[1 + MAX_LOGPROBS:1 + MAX_LOGPROBS + top], want[order],
                                   atol=1e-5)
        assert (row[1 + top:1 + MAX_LOGPROBS] == -1).all()
        kept = TokenLogprobs.of_row(row, 25)
        assert [t for t, _ in kept.top] == order.tolist()   # the padding is not returned
        assert kept.rank == 1 + int((want > want[tokens[b, i]]).sum())


def with_bias(s, bias, bans=None):
    """Sampler `s` with per-row {token: bias} dicts, and per row (ids, bound) of tokens
    banned below a position, as its padded bias entries (drafter/slot_sampling.py's)."""
    ids = np.zeros((len(bias), MAX_LOGIT_BIAS), np.int32)
    values = np.zeros((len(bias), MAX_LOGIT_BIAS), np.float32)
    until = np.zeros((len(bias), MAX_LOGIT_BIAS), np.int32)
    for r, row in enumerate(bias):
        entries = [(t, v, EVERY_POSITION) for t, v in row.items()]
        if bans:
            entries += [(t, -np.inf, bans[r][1]) for t in bans[r][0]]
        if entries:
            n = len(entries)
            ids[r, :n], values[r, :n], until[r, :n] = zip(*entries)
    return s.replace(bias_ids=jnp.asarray(ids), bias_values=jnp.asarray(values),
                     bias_until=jnp.asarray(until))


@pytest.mark.parametrize("seed", range(6))
def test_adjusting_adds_the_bias_and_counts_the_drafts_before_each_position(seed):
    """Position j of a verify block gets the row's logit bias (token 0 included: unused
    entries also name it) and is penalized for the row's generated tokens and the drafts
    before j (repeated drafts count twice), its repetition penalty also for its prompt's
    tokens; rows differ, negative penalties and biases included; a step that does not
    adjust leaves the logits alone."""
    rng = np.random.default_rng(seed)
    rows, block, vocab = 3, 5, 9   # a small vocabulary: drafts repeat and hit counts
    logits = rng.normal(size=(rows, block, vocab)).astype(np.float32)
    counts = rng.integers(0, 3, size=(rows, vocab)) * (rng.random((rows, vocab)) < 0.4)
    drafts = rng.integers(0, vocab, size=(rows, block - 1))
    presence = np.array([0.0, 1.5, -0.7], np.float32)
    frequency = np.array([0.8, 0.0, -2.0], np.float32)
    repetition = np.array([1.3, 1.0, 0.8], np.float32)
    prompts = [rng.integers(0, vocab, 3).tolist() for _ in range(rows)]
    prompt_seen = np.zeros((rows, vocab), bool)
    for r, prompt in enumerate(prompts):
        prompt_seen[r, prompt] = True
    bias = [{}, {0: 3.5, 4: -100.0}, {int(rng.integers(vocab)): 0.25}]
    s = with_bias(sampler(rows), bias).replace(
        presence_penalties=jnp.asarray(presence), frequency_penalties=jnp.asarray(frequency),
        repetition_penalties=jnp.asarray(repetition), adjusted=True)
    got = np.asarray(adjust(jnp.asarray(logits), jnp.asarray(counts, jnp.int32),
                            jnp.asarray(prompt_seen), jnp.asarray(drafts, jnp.int32), s,
                            jnp.full((rows,), 7, jnp.int32)))
    want = adjust_reference(logits, counts, drafts, presence, frequency, bias, prompts,
                            repetition)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert not np.allclose(got[1:], logits[1:])   # the test's adjustments change logits
    np.testing.assert_array_equal(
        np.asarray(adjust(jnp.asarray(logits), jnp.asarray(counts, jnp.int32),
                          jnp.asarray(prompt_seen), jnp.asarray(drafts, jnp.int32),
                          s.replace(adjusted=False), jnp.zeros((rows,), jnp.int32))),
        logits)


@pytest.mark.parametrize("seed", range(4))
def test_bans_hold_below_their_position_only(seed):
    """An entry bounded by a position (a min_tokens ban) makes its token -inf at the
    block positions that draw tokens below it and changes nothing at the others; rows
    at their own positions, one token both biased and banned, beside unbounded bias."""
    rng = np.random.default_rng(seed)
    rows, block, vocab = 3, 6, 11
    logits = rng.normal(size=(rows, block, vocab)).astype(np.float32)
    counts = np.zeros((rows, vocab), np.int64)
    drafts = rng.integers(0, vocab, size=(rows, block - 1))
    positions = rng.integers(0, 50, size=rows)
    bias = [{2: 5.0}, {}, {int(rng.integers(vocab)): -1.0}]
    bans = [((2, 7), positions[0] + int(rng.integers(0, block + 1))),
            ((0,), positions[1] + 1), ((1, 4, 9), positions[2])]   # row 2: over already
    s = with_bias(sampler(rows), bias, bans).replace(adjusted=True)
    zeros = np.zeros(rows, np.float32)
    got = np.asarray(adjust(jnp.asarray(logits), jnp.asarray(counts, jnp.int32),
                            jnp.zeros((rows, vocab), bool), jnp.asarray(drafts, jnp.int32), s,
                            jnp.asarray(positions, jnp.int32)))
    want = adjust_reference(logits, counts, drafts, zeros, zeros, bias, bans=bans,
                            positions=positions)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=1e-5)
    assert np.isinf(got[1, 0, 0]) and np.isfinite(got[1, 1:, 0]).all()
    assert np.isfinite(got[2]).all()


def test_a_verify_position_scores_as_the_plain_step_after_its_drafts():
    """Bit for bit: position j of a block adjusted with its drafts equals a one-position
    block at its position whose counts already hold those drafts (what plain decoding
    computes), a ban ending mid-block included."""
    rng = np.random.default_rng(0)
    block, vocab, start = 6, 13, 40
    logits = rng.normal(size=(1, block, vocab)).astype(np.float32)
    counts = rng.integers(0, 2, size=(1, vocab))
    drafts = np.array([[3, 3, 7, 0, 3]])
    s = with_bias(sampler(1), [{3: 0.7, 0: -1.3}], bans=[((3, 9), start + 3)]).replace(
        presence_penalties=jnp.full((1,), 0.37, jnp.float32),
        frequency_penalties=jnp.full((1,), 1.13, jnp.float32),
        repetition_penalties=jnp.full((1,), 1.21, jnp.float32), adjusted=True)
    prompt_seen = jnp.zeros((1, vocab), bool).at[0, jnp.array([5, 7])].set(True)
    block_scores = np.asarray(adjust(jnp.asarray(logits), jnp.asarray(counts, jnp.int32),
                                     prompt_seen, jnp.asarray(drafts, jnp.int32), s,
                                     jnp.full((1,), start, jnp.int32)))
    for j in range(block):
        seen = counts + np.bincount(drafts[0, :j], minlength=vocab)[None]
        one = adjust(jnp.asarray(logits[:, j:j + 1]), jnp.asarray(seen, jnp.int32),
                     prompt_seen, jnp.zeros((1, 0), jnp.int32), s,
                     jnp.full((1,), start + j, jnp.int32))
        np.testing.assert_array_equal(np.asarray(one)[:, 0], block_scores[:, j])
    assert np.isinf(block_scores[0, :3, 9]).all() and np.isfinite(block_scores[0, 3:, 9]).all()


@pytest.mark.parametrize("seed", range(4))
def test_adjusted_drafts_are_the_adjusted_argmax_with_earlier_drafts_counted(seed):
    """Draft i is the most likely token of its position's adjusted logits, the drafts
    before it counted as generated (so a penalty can move draft i off draft i-1's token),
    and a row with nothing to adjust drafts its plain argmax."""
    rng = np.random.default_rng(seed)
    rows, k, vocab = 3, 4, 9
    logits = rng.normal(size=(rows, k, vocab)).astype(np.float32)
    logits[:, :, 2] += 3.0   # one token leads at every position: penalties move drafts off it
    counts = rng.integers(0, 2, size=(rows, vocab))
    prompts = [[1, 2], [5], [0, 3]]
    prompt_seen = np.zeros((rows, vocab), bool)
    for r, prompt in enumerate(prompts):
        prompt_seen[r, prompt] = True
    presence, frequency = np.array([0.0, 2.0, 1.0], np.float32), np.array([0.0, 1.5, 0.0],
                                                                          np.float32)
    repetition = np.array([1.0, 1.2, 2.0], np.float32)
    bias = [{}, {7: 0.5}, {4: -100.0}]
    bans = [((), 0), ((), 0), ((2,), 12)]   # row 2: its leading token banned at 10 and 11
    positions = np.array([5, 8, 10])
    s = with_bias(sampler(rows), bias, bans).replace(
        presence_penalties=jnp.asarray(presence), frequency_penalties=jnp.asarray(frequency),
        repetition_penalties=jnp.asarray(repetition), adjusted=True)
    got = np.asarray(adjusted_drafts(jnp.asarray(logits), jnp.asarray(counts, jnp.int32),
                                     jnp.asarray(prompt_seen), s, jnp.asarray(positions)))
    for r in range(rows):
        seen = counts[r].copy()
        for i in range(k):
            row = adjust_reference(logits[r:r + 1, i:i + 1], seen[None], np.zeros((1, 0), int),
                                   presence[r:r + 1], frequency[r:r + 1], bias[r:r + 1],
                                   prompts[r:r + 1], repetition[r:r + 1], bans[r:r + 1],
                                   positions[r:r + 1] + i)[0, 0]
            assert got[r, i] == int(np.argmax(row)), (r, i)
            seen[got[r, i]] += 1
    np.testing.assert_array_equal(got[0], logits[0].argmax(-1))   # nothing to adjust
    assert (got[1] != 2).any()   # the penalties moved a draft off the leading token
    assert (got[2, :2] != 2).all()   # banned at positions 10 and 11
