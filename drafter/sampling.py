"""How a step's rows draw their tokens: greedy or sampled, and lossless acceptance of a
draft block (greedy: the longest prefix the target agrees with; sampled: rejection
sampling against the one-hot draft proposal)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Sampler:
    """How each row draws its tokens.

    Attributes:
      temperatures: f32[B], 0 = greedy (argmax).
      keys: key[B], one PRNG key per row.
      greedy: static; every row is greedy (skips the softmax over the vocabulary).
    """

    temperatures: jax.Array
    keys: jax.Array
    greedy: bool = flax.struct.field(pytree_node=False, default=True)

    @classmethod
    def uniform(cls, batch: int, temperature: float, key) -> "Sampler":
        """Every row at one temperature, keys split from one key."""
        return cls(jnp.full((batch,), temperature, jnp.float32), jax.random.split(key, batch),
                   greedy=temperature == 0.0)

    @classmethod
    def per_row(cls, temperatures, seeds, positions, *, greedy: bool, stream: int) -> "Sampler":
        """Row keys folded from (seed, position, stream): a request draws the same
        numbers whatever else shares its batch."""
        temperatures = temperatures.astype(jnp.float32)
        if greedy:  # no draws: skip deriving keys
            return cls(temperatures, jax.random.split(jax.random.key(0), seeds.shape[0]))

        def key(seed, position):
            k = jax.random.fold_in(jax.random.key(0), seed)
            return jax.random.fold_in(jax.random.fold_in(k, position), stream)
        return cls(temperatures, jax.vmap(key)(seeds, positions), greedy=False)


def sample(logits, sampler: Sampler):
    """Greedy where the temperature is 0, else a draw from softmax(logits / T).
    logits f32[B, V] -> i32[B]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampler.greedy:
        return greedy
    t = sampler.temperatures
    drawn = jax.vmap(jax.random.categorical)(
        sampler.keys, logits / jnp.where(t > 0, t, 1.0)[:, None]).astype(jnp.int32)
    return jnp.where(t > 0, drawn, greedy)


def accept(logits, drafts, sampler: Sampler):
    """How many drafts each row accepts, and the token that follows them.

    Greedy: the longest prefix with d_i == argmax y_{i-1}; the bonus is
    y_a. Sampling (drafts are argmax, a one-hot proposal): accept d_i with
    probability P_{i-1}(d_i); at the first rejection draw from P with d_i
    removed; if all pass, draw the bonus from P_K. Both are lossless.
    Returns (accepted i32[B], bonus i32[B]).
    """
    y = jnp.argmax(logits, axis=-1).astype(jnp.int32)                     # [B, K+1]
    accepted = jnp.cumprod(drafts == y[:, :-1], axis=1).sum(axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(y, accepted[:, None], axis=1)[:, 0]
    if sampler.greedy:
        return accepted, bonus
    t = sampler.temperatures
    s_accepted, s_bonus = jax.vmap(_accept_sampled)(logits / jnp.where(t > 0, t, 1.0)[:, None, None],
                                                    drafts, sampler.keys)
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
