"""How a step's rows draw their tokens: greedy or sampled, and lossless acceptance of a
draft block (greedy: the longest prefix the target agrees with; sampled: rejection
sampling against the one-hot draft proposal).

A sampled row draws from its *truncated* distribution: softmax(logits / T) over the
tokens its top_k, top_p and min_p keep (`truncate`), renormalized. Rejection sampling
accepts and redraws against that same distribution, so speculation stays lossless
under truncation. Truncating is a static choice of the step (`Sampler.truncated`, a
program of its own): its sort over the vocabulary runs only in steps where some row
asks for it, and no step branches on the device.

Before temperature and truncation, greedy rows too, a row's logits are adjusted
(`adjust`): its logit bias is added (OpenAI's; each entry to the tokens at positions
below its own bound, which bans a min_tokens request's stop ids early), the tokens in
its prompt or generated so far are divided by its repetition penalty where positive
and multiplied where not (vLLM's, HF's), and the tokens it has generated lose
frequency x count + presence x (count > 0) (OpenAI's). In a verify block, position j
counts the drafts before it as generated, so a row that accepts them scores every
position as plain decoding would, and speculation stays lossless. Adjusting is a static
choice too (`Sampler.adjusted`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from drafter.request import MAX_LOGIT_BIAS, MAX_LOGPROBS


@flax.struct.dataclass
class Sampler:
    """How each row draws its tokens.

    Attributes:
      temperatures: f32[B], 0 = greedy (argmax).
      keys: key[B], one PRNG key per row.
      top_ks: i32[B], keep the k most likely tokens (0 = every token).
      top_ps: f32[B], keep the most likely tokens whose probabilities reach p
        (1 = every token).
      min_ps: f32[B], keep the tokens at least min_p x the most likely one's
        probability (0 = every token).
      greedy: static; every row is greedy (skips the softmax over the vocabulary).
      presence_penalties, frequency_penalties, repetition_penalties: f32[B]; bias_ids,
        bias_until: i32[B, MAX_LOGIT_BIAS], bias_values: f32[B, MAX_LOGIT_BIAS] (each
        row's logit-bias entries: entry e adds bias_values[e] to token bias_ids[e] at
        token positions below bias_until[e]; unused entries 0, 0.0, 0) (`adjust`).
      truncated: static; rows are truncated by their top_ks, top_ps and min_ps (without
        it the three are ignored).
      adjusted: static; rows' logits are adjusted by their penalties and logit bias
        (without it those are ignored).
    """

    temperatures: jax.Array
    keys: jax.Array
    top_ks: jax.Array
    top_ps: jax.Array
    min_ps: jax.Array
    presence_penalties: jax.Array
    frequency_penalties: jax.Array
    repetition_penalties: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    bias_until: jax.Array
    greedy: bool = flax.struct.field(pytree_node=False, default=True)
    truncated: bool = flax.struct.field(pytree_node=False, default=False)
    adjusted: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def uniform(cls, batch: int, temperature: float, key) -> "Sampler":
        """Every row at one temperature, keys split from one key, nothing truncated."""
        return cls(jnp.full((batch,), temperature, jnp.float32), jax.random.split(key, batch),
                   *_untruncated(batch), *_unadjusted(batch), greedy=temperature == 0.0)

    @classmethod
    def per_row(cls, temperatures, seeds, positions, *, greedy: bool, stream: int,
                truncation=None, adjustment=None) -> "Sampler":
        """Row keys folded from (seed, position, stream): a request draws the same
        numbers whatever else shares its batch. truncation: (top_ks, top_ps, min_ps)
        per row to truncate by, or None (the step does not truncate); adjustment:
        (presence, frequency, repetition, bias_ids, bias_values, bias_until) per row, or
        None (the step does not adjust)."""
        temperatures = temperatures.astype(jnp.float32)
        batch = seeds.shape[0]
        truncated = truncation is not None and not greedy
        top_ks, top_ps, min_ps = truncation if truncated else _untruncated(batch)
        truncation = (top_ks.astype(jnp.int32), top_ps.astype(jnp.float32),
                      min_ps.astype(jnp.float32))
        adjusted = adjustment is not None
        if adjusted:
            *penalties, bias_ids, bias_values, bias_until = adjustment
            adjustment = (*(x.astype(jnp.float32) for x in penalties),
                          bias_ids.astype(jnp.int32), bias_values.astype(jnp.float32),
                          bias_until.astype(jnp.int32))
        else:
            adjustment = _unadjusted(batch)
        if greedy:  # no draws: skip deriving keys
            return cls(temperatures, jax.random.split(jax.random.key(0), batch), *truncation,
                       *adjustment, adjusted=adjusted)

        def key(seed, position):
            k = jax.random.fold_in(jax.random.key(0), seed)
            return jax.random.fold_in(jax.random.fold_in(k, position), stream)
        return cls(temperatures, jax.vmap(key)(seeds, positions), *truncation, *adjustment,
                   greedy=False, truncated=truncated, adjusted=adjusted)


def _untruncated(batch: int):
    return (jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), jnp.float32),
            jnp.zeros((batch,), jnp.float32))


def _unadjusted(batch: int):
    return (jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.float32),
            jnp.ones((batch,), jnp.float32), jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.int32),
            jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.float32),
            jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.int32))


def penalty(counts, presence, frequency):
    """What a token's logit loses for `counts` occurrences among the generated tokens.
    One expression for every caller: a verify position and a plain step that see the
    same counts subtract bit-identical penalties."""
    return frequency * counts.astype(jnp.float32) + jnp.where(counts > 0, presence, 0.0)


def repeated(logits, seen, repetition):
    """Logits of `seen` tokens divided by the repetition penalty where positive and
    multiplied where not; one expression for every caller, as `penalty`."""
    return jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition),
                     logits)


def first_counts(counts, slot_ids, first, done):
    """Output counts (i32[slots, V]) with the rows of `slot_ids` that are `done` restarted
    at their first token."""
    fresh = jax.nn.one_hot(first, counts.shape[1], dtype=counts.dtype)
    return counts.at[slot_ids].set(jnp.where(done[:, None], fresh, counts[slot_ids]))


def adjust(logits, counts, prompt_seen, drafts, sampler: Sampler, positions):
    """Logits f32[B, b, V] with each row's logit bias added and its penalties applied,
    if the sampler adjusts.

    counts: i32[B, V], each token's occurrences among the row's generated tokens before
    position 0; prompt_seen: bool[B, V], the tokens its prompt holds; drafts: i32[B, b -
    1], the tokens at positions 1..b-1: position j counts drafts[:, :j] too (what it
    would have seen had they been generated); positions: i32[B], the token position
    that position 0's logits draw (position j draws positions + j).
    """
    if not sampler.adjusted:
        return logits
    rows, block, _ = logits.shape
    # Unused bias entries and entries past their bound add 0.0 (to token 0 for unused
    # ones): x + 0.0 is x, whatever else adds to it.
    drawn = positions[:, None, None] + jnp.arange(block)[None, :, None]
    logits = logits.at[jnp.arange(rows)[:, None, None], jnp.arange(block)[None, :, None],
                       sampler.bias_ids[:, None, :]].add(
        jnp.where(drawn < sampler.bias_until[:, None, :], sampler.bias_values[:, None, :],
                  0.0))
    before = (jnp.arange(block - 1)[None] < jnp.arange(block)[:, None]).astype(jnp.int32)
    position_counts = jnp.broadcast_to(counts[:, None], logits.shape).at[
        jnp.arange(rows)[:, None, None], jnp.arange(block)[None, :, None],
        drafts[:, None, :]].add(jnp.broadcast_to(before, (rows, *before.shape)))
    logits = repeated(logits, prompt_seen[:, None] | (position_counts > 0),
                      sampler.repetition_penalties[:, None, None])
    return logits - penalty(position_counts, sampler.presence_penalties[:, None, None],
                            sampler.frequency_penalties[:, None, None])


def adjusted_drafts(logits, counts, prompt_seen, sampler: Sampler, positions):
    """A draft block chosen as the adjusted target would choose it: draft i is the most
    likely token of draft position i's logits adjusted (`adjust`) with the drafts before
    it counted as generated. Drafts are proposals, so this changes acceptance, never
    output. logits f32[B, K, V]; counts i32[B, V] (the anchor counted); positions i32[B],
    draft 0's token position. -> i32[B, K]."""
    rows = jnp.arange(logits.shape[0])
    nothing = jnp.zeros((logits.shape[0], 0), jnp.int32)
    drafts = []
    for i in range(logits.shape[1]):   # K <= 15: each choice counts for the next
        scored = adjust(logits[:, i:i + 1], counts, prompt_seen, nothing, sampler,
                        positions + i)[:, 0]
        drafts.append(jnp.argmax(scored, axis=-1).astype(jnp.int32))
        counts = counts.at[rows, drafts[-1]].add(1)
    return jnp.stack(drafts, axis=1)


def adjust_reference(logits, counts, drafts, presence, frequency, bias=None, prompts=None,
                     repetition=None, bans=None, positions=None):
    """`adjust` one position at a time, counting in numpy (for tests). bias: per row a
    {token id: bias} dict, or None; prompts: per row its prompt's token ids, with
    `repetition` per row, or None; bans: per row (token ids, bound): those ids are
    -inf at token positions below the bound, position j drawing positions[row] + j."""
    logits, counts, drafts = (np.asarray(x) for x in (logits, counts, drafts))
    out = np.array(logits, np.float32)
    for r, row_bias in enumerate(bias or [{}] * logits.shape[0]):
        for token, value in row_bias.items():
            out[r, :, token] += np.float32(value)
    for r, (ids, bound) in enumerate(bans or []):
        for j in range(logits.shape[1]):
            if positions[r] + j < bound:
                out[r, j, list(ids)] = -np.inf
    for r in range(logits.shape[0]):
        seen = np.array(counts[r])
        for j in range(logits.shape[1]):
            if j:
                seen[drafts[r, j - 1]] += 1
            if prompts is not None:
                hit = seen > 0
                hit[list(prompts[r])] = True
                rep, row = np.float32(repetition[r]), out[r, j]
                out[r, j] = np.where(hit, np.where(row > 0, row / rep, row * rep), row)
            out[r, j] -= (np.float32(frequency[r]) * seen.astype(np.float32)
                          + np.where(seen > 0, np.float32(presence[r]), np.float32(0)))
    return out


def truncate_row(scaled, top_k, top_p, min_p):
    """One row's scaled logits f32[V] with the tokens its truncation drops at -inf.

    Kept: the top_k most likely tokens (0: all); of those, the most likely ones until
    their renormalized probabilities reach top_p (the one that crosses it included; 1:
    all); and of the tokens left, those with a probability of at least min_p x the most
    likely one's (0: all). The three become one logit threshold, and every token at or
    above it is kept: a tie at the threshold keeps all its tokens. The most likely
    token is always kept.
    """
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    in_k = jnp.arange(vocab) < k
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf))
    ahead = jnp.cumsum(probs) - probs          # mass of the more likely tokens
    # top_p = 1 keeps all k: a float cumsum may reach 1 before the vocabulary's end.
    kept = jnp.where(top_p < 1, jnp.sum(in_k & (ahead < top_p)), k)
    threshold = jnp.maximum(desc[jnp.maximum(kept, 1) - 1], desc[0] + jnp.log(min_p))
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def truncate(scaled, sampler: Sampler):
    """Scaled logits f32[B, ..., V] with each row's truncation applied (`truncate_row`;
    the row's parameters hold for every position of it), if the sampler truncates."""
    if not sampler.truncated:
        return scaled
    row = truncate_row
    for _ in range(scaled.ndim - 2):   # positions within a row share its parameters
        row = jax.vmap(row, in_axes=(0, None, None, None))
    return jax.vmap(row)(scaled, sampler.top_ks, sampler.top_ps, sampler.min_ps)


def sample(logits, sampler: Sampler):
    """Greedy where the temperature is 0, else a draw from softmax(logits / T), truncated.
    logits f32[B, V] -> i32[B]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampler.greedy:
        return greedy
    t = sampler.temperatures
    scaled = truncate(logits / jnp.where(t > 0, t, 1.0)[:, None], sampler)
    drawn = jax.vmap(jax.random.categorical)(sampler.keys, scaled).astype(jnp.int32)
    return jnp.where(t > 0, drawn, greedy)


def accept(logits, drafts, sampler: Sampler):
    """How many drafts each row accepts, and the token that follows them.

    Greedy: the longest prefix with d_i == argmax y_{i-1}; the bonus is
    y_a. Sampling (drafts are argmax, a one-hot proposal): accept d_i with
    probability P_{i-1}(d_i); at the first rejection draw from P with d_i
    removed; if all pass, draw the bonus from P_K. P is the row's truncated
    distribution (`truncate`). Both are lossless.
    Returns (accepted i32[B], bonus i32[B]).
    """
    y = jnp.argmax(logits, axis=-1).astype(jnp.int32)                     # [B, K+1]
    accepted = jnp.cumprod(drafts == y[:, :-1], axis=1).sum(axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(y, accepted[:, None], axis=1)[:, 0]
    if sampler.greedy:
        return accepted, bonus
    t = sampler.temperatures
    scaled = truncate(logits / jnp.where(t > 0, t, 1.0)[:, None, None], sampler)
    s_accepted, s_bonus = jax.vmap(_accept_sampled)(scaled, drafts, sampler.keys)
    return jnp.where(t > 0, s_accepted, accepted), jnp.where(t > 0, s_bonus, bonus)


def _accept_sampled(scaled_logits, drafts, key):
    """One row's lossless rejection sampling: scaled_logits f32[K+1, V], drafts i32[K]."""
    block = scaled_logits.shape[0]
    key_u, key_s = jax.random.split(key)
    probs = jax.nn.softmax(scaled_logits, axis=-1)                        # [K+1, V]
    p_draft = jnp.take_along_axis(probs[:-1], drafts[:, None], axis=-1)[:, 0]
    u = jax.random.uniform(key_u, p_draft.shape)
    accepted = jnp.cumprod(u < p_draft).sum().astype(jnp.int32)
    p_next = probs[accepted]                                              # [V]
    rejected = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)])[accepted]
    residual = jnp.where((accepted < block - 1) & (jnp.arange(probs.shape[-1]) == rejected),
                         0.0, p_next)
    return accepted, jax.random.categorical(key_s, jnp.log(residual)).astype(jnp.int32)


def emitted_tokens(tokens, accepted, bonus):
    """i32[B, K+1]: the accepted drafts tokens[:, 1:a+1], then the bonus, then 0s."""
    cols = jnp.arange(tokens.shape[1])[None]
    out = jnp.where(cols < accepted[:, None],
                    jnp.concatenate([tokens[:, 1:], bonus[:, None]], axis=1), 0)
    return jnp.where(cols == accepted[:, None], bonus[:, None], out)


# Log-probabilities a step returns with each token it emits, for requests that ask: the
# token's own and those of the MAX_LOGPROBS most likely tokens at its position, and its
# rank there, from the target's raw logits (before temperature and truncation, as vLLM
# reports them by default). One width for every request keeps it one static variant of
# the step.
LOGPROB_WIDTH = 2 + 2 * MAX_LOGPROBS


def token_logprobs(logits, tokens):
    """f32[..., LOGPROB_WIDTH] per position: log_softmax(logits)[token], then the
    MAX_LOGPROBS most likely token ids (as f32: exact below 2**24), then their
    log-probabilities, most likely first, then the token's rank (1 + the tokens more
    likely than it: vLLM's). logits [..., V]; tokens i32[...]."""
    if logits.shape[-1] >= 2 ** 24:
        raise ValueError(f"a vocabulary of {logits.shape[-1]} tokens has ids f32 cannot hold")
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[..., None].astype(jnp.int32), axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    pad = MAX_LOGPROBS - top_ids.shape[-1]   # a vocabulary smaller than MAX_LOGPROBS
    if pad:
        widths = [(0, 0)] * (top_ids.ndim - 1) + [(0, pad)]
        top_ids = jnp.pad(top_ids, widths, constant_values=-1)
        top_logprobs = jnp.pad(top_logprobs, widths, constant_values=-jnp.inf)
    rank = 1 + jnp.sum(logprobs > chosen, axis=-1, keepdims=True, dtype=jnp.int32)
    return jnp.concatenate([chosen, top_ids.astype(jnp.float32), top_logprobs,
                            rank.astype(jnp.float32)], axis=-1)
