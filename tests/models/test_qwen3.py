"""The paged Qwen3 forward against an independent dense, non-paged jnp model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.qwen3 import Qwen3Config, forward, init_params
from pallas_kernels.batch_tables import build_batch_tables_reference
from unified_kv import CacheSpec, grow, init_state, retire_window_pages


def dense_reference(params, cfg, tokens):
    """Written independently of models/qwen3.py: full-sequence causal attention."""
    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

    def rotate(x, pos):  # complex-number RoPE over (first half, second half) pairs
        d = x.shape[-1] // 2
        freqs = pos[:, None] * cfg.rope_theta ** (-np.arange(d) * 2.0 / (2 * d))
        z = (x[..., :d] + 1j * x[..., d:]) * np.exp(1j * freqs)[:, None, :]
        return np.concatenate([z.real, z.imag], -1)

    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    x = p["embed"][np.asarray(tokens)]
    group = cfg.num_heads // cfg.num_kv_heads
    for i, lp in enumerate(p["layers"]):
        h = norm(x, lp["input_norm"])
        q = norm((h @ lp["q"]).reshape(t, cfg.num_heads, cfg.head_dim), lp["q_norm"])
        k = norm((h @ lp["k"]).reshape(t, cfg.num_kv_heads, cfg.head_dim), lp["k_norm"])
        v = (h @ lp["v"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = rotate(q, pos), rotate(k, pos)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(cfg.head_dim)
        allowed = np.tril(np.ones((t, t), bool))
        if cfg.window(i):
            allowed &= (np.arange(t)[None, :] > np.arange(t)[:, None] - cfg.window(i))
        scores = np.where(allowed[None], scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", w, v).reshape(t, -1) @ lp["o"]
        h = norm(x, lp["post_norm"])
        gate = h @ lp["gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ lp["up"])) @ lp["down"]
    head = p["embed"].T if cfg.tie_word_embeddings else p["lm_head"]
    return norm(x, p["norm"]) @ head


def tiny_target(tied=True):
    return Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                       layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                       sliding_window=8, tie_word_embeddings=tied)


def paged_logits(params, cfg, tokens, chunks, kv_dtype, impl):
    """Run the sequence through the paged cache in the given chunk sizes."""
    spec = CacheSpec(8, tuple(cfg.layer_specs(kv_dtype)), 2, 64, 1 << 22, max(chunks))
    state = init_state(spec)
    slot = jnp.array([0], jnp.int32)
    scales = tuple(p.page_index_scale for p in spec.pools)
    out, start = [], 0
    for n in chunks:
        state, ok = grow(spec, state, slot, jnp.array([start + n]), jnp.array([0]))
        assert bool(ok[0])
        tables = build_batch_tables_reference(slot, state.page_tables, table_width=16,
                                              scales=scales)
        chunk = jnp.asarray(tokens[start:start + n], jnp.int32)[None]
        logits, pools, _ = forward(params, cfg, spec, state.pools, tables, chunk,
                                   jnp.array([start]), jnp.array([n]), impl=impl)
        state = retire_window_pages(spec, state.replace(pools=pools), slot)
        out.append(np.asarray(logits[0]))
        start += n
    return np.concatenate(out)


@pytest.mark.parametrize("kv_dtype,tol,tied", [("f32", 1e-4, True), ("f32", 1e-4, False),
                                               ("bf16", 3e-2, True)])
def test_paged_forward_matches_dense_reference(kv_dtype, tol, tied):
    cfg = tiny_target(tied)
    params = init_params(cfg, jax.random.key(3))
    tokens = np.random.default_rng(0).integers(0, 48, 29)
    ref = dense_reference(params, cfg, tokens)
    # A 13-token prefill chunk, a 7-token chunk, then single-token decode steps:
    # crosses pages (8) and the window (8), with retirement in between.
    got = paged_logits(params, cfg, tokens, [13, 7] + [1] * 9, kv_dtype, "reference")
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < tol, f"max rel error {err}"


def test_paged_forward_with_pallas_kernels_in_interpret_mode():
    cfg = tiny_target()
    params = init_params(cfg, jax.random.key(4))
    tokens = np.random.default_rng(1).integers(0, 48, 12)
    ref = dense_reference(params, cfg, tokens)
    got = paged_logits(params, cfg, tokens, [9, 1, 1, 1], "f32", "interpret")
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-3


def test_config_validation():
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        Qwen3Config(48, 32, 48, 3, 4, 2, 16, layer_types=("full_attention",) * 2)
    with pytest.raises(ValueError, match="need sliding_window"):
        Qwen3Config(48, 32, 48, 1, 4, 2, 16, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Qwen3Config(48, 32, 48, 1, 3, 2, 16)
