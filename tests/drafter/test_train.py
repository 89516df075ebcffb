"""Drafter training: the dense training forward matches paged inference; resuming works."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafter.dflash import draft_block
from drafter.steps import init_step_state
from drafter.uniform_steps import prefill_step
from drafter.train import (LABELS, block_logits, dflash_loss, draw_anchors, target_features,
                           train_drafter)
from models.qwen3 import dense_forward
from tests.drafter.tiny import tiny_pair
from unified_kv import admit_slots, init_state


def loss_on_random_windows(seed: int):
    """loss(**dflash_loss kwargs) -> float: the tiny pair's drafter loss on two random
    48-token windows, with one key for every call (so two calls differ only by kwargs)."""
    params, cfg, _ = tiny_pair(num_slots=2)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 63, (2, 48)), jnp.int32)
    key = jax.random.key(5)

    def loss(**kw):
        return float(jax.jit(dflash_loss(params["target"], cfg.target, cfg.draft, **kw))(
            params["draft"], tokens, key))
    return loss


def test_a_tail_anchors_every_block_in_the_windows_last_tokens():
    """draw_anchors keeps to first .. T - 2 and reaches both ends; with `tail` the loss
    draws its blocks there, one per `anchor_spacing` tokens of the tail (the same loss as
    that many anchors a window), not over the whole window; a tail must leave context."""
    anchors = np.asarray(draw_anchors(jax.random.key(0), 64, 48, 8, first=32))
    assert anchors.min() == 32 and anchors.max() == 46 and anchors.shape == (64, 8)
    loss = loss_on_random_windows(3)
    tail = loss(tail=16, anchor_spacing=8)
    assert tail == loss(tail=16, anchors_per_seq=2)
    assert tail != loss(anchors_per_seq=2)
    with pytest.raises(ValueError, match="tail 1: give at least 2 tokens"):
        loss(tail=1)
    with pytest.raises(ValueError, match="tail 48: the window .48 tokens. has no context"):
        loss(tail=48)


def test_greedy_tails_are_the_targets_own_continuations():
    """greedy_tail_batches keeps each window's head and ends it in the plain engine's
    greedy continuation: with f32 KV every tail token is the target's argmax after the
    tokens before it, and the same window gives the same tail again. (Over the served
    fp8 KV, this random tiny target's flat logits part from the exact ones.)"""
    from drafter.make_default import greedy_tail_batches

    params, cfg, _ = tiny_pair(num_slots=2)
    windows = np.random.default_rng(4).integers(0, 63, (3, 40)).astype(np.int32)
    batches = [jnp.asarray(windows[:2]), jnp.asarray(windows[1:])]
    out = list(greedy_tail_batches(iter(batches), params, cfg.target, 12, [(40, 2)],
                                   kv_dtype="f32"))
    assert [b.shape for b in out] == [(2, 40), (2, 40)]
    np.testing.assert_array_equal(np.asarray(out[0])[:, :28], windows[:2, :28])
    np.testing.assert_array_equal(np.asarray(out[0])[1], np.asarray(out[1])[0])
    assert not np.array_equal(np.asarray(out[0])[:, 28:], windows[:2, 28:])
    for row in np.concatenate([np.asarray(b) for b in out]):
        logits, _ = dense_forward(params["target"], cfg.target, jnp.asarray(row[None]))
        for p in range(28, 40):
            assert int(jnp.argmax(logits[0, p - 1])) == row[p]
    with pytest.raises(ValueError, match="3 windows of 40 tokens is not among the windows"):
        next(greedy_tail_batches(iter([jnp.asarray(windows)]), params, cfg.target, 12,
                                 [(40, 2)], kv_dtype="f32"))


def test_a_sampled_context_comes_before_the_greedy_tail():
    """With `sampled`, the tokens between the window's head and its greedy tail are the
    target's draws at temperature 1 (not the window's text), the tail is the greedy
    continuation of head and draws together, and the same windows draw the same again."""
    from drafter.make_default import greedy_tail_batches

    params, cfg, _ = tiny_pair(num_slots=2)
    windows = np.random.default_rng(5).integers(0, 63, (2, 40)).astype(np.int32)
    out, again = (np.asarray(next(greedy_tail_batches(iter([jnp.asarray(windows)]), params,
                                                      cfg.target, 8, [(40, 2)],
                                                      kv_dtype="f32",
                                                      sampled=10)))
                  for _ in range(2))
    np.testing.assert_array_equal(out, again)
    np.testing.assert_array_equal(out[:, :22], windows[:, :22])
    assert not np.array_equal(out[:, 22:32], windows[:, 22:32])
    for row in out:
        logits, _ = dense_forward(params["target"], cfg.target, jnp.asarray(row[None]))
        assert [int(t) for t in jnp.argmax(logits[0, 31:39], -1)] == row[32:].tolist()


def test_dense_training_block_matches_paged_draft_block():
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=96)
    # Jitted as serving and training run them: one compile each, not one per op.
    features = jax.jit(target_features, static_argnums=(1, 2))
    dense_block = jax.jit(block_logits, static_argnums=(1, 3))
    prefill = jax.jit(prefill_step, static_argnames=("cfg", "table_width"))
    paged_block = jax.jit(draft_block, static_argnums=(1, 3, 4), static_argnames=("impl",))
    tables_of = jax.jit(cfg.device_tables, static_argnums=2)
    tokens = np.random.default_rng(0).integers(0, 63, (1, 40)).astype(np.int32)
    feats = features(params["target"], cfg.target, cfg.draft, jnp.asarray(tokens))
    for anchor in (5, 17, 33):  # context shorter than, around and past the windows
        dense = dense_block(params["draft"], cfg.draft, params["target"], cfg.target,
                            jnp.asarray(tokens), feats, jnp.array([[anchor]]))
        state = init_step_state(cfg, init_state(cfg.spec))
        ids = jnp.array([0], jnp.int32)
        state = state.replace(kv=admit_slots(cfg.spec, state.kv, ids))
        chunk = cfg.spec.max_step_tokens
        for start in range(0, anchor, chunk):
            piece = np.zeros((1, chunk), np.int32)
            n = min(chunk, anchor - start)
            piece[0, :n] = tokens[0, start:start + n]
            state, _, ok = prefill(params, state, ids, jnp.asarray(piece), jnp.array([n]),
                                   jnp.array([False]), jax.random.key(0), cfg=cfg,
                                   table_width=16)
            assert bool(ok[0])
        tables = tables_of(state.kv, ids, 16)
        _, paged = paged_block(params["draft"], cfg.draft, params["target"], cfg.target,
                               cfg.spec, state.kv.pools, tables,
                               jnp.asarray(tokens[:, anchor]), jnp.array([anchor]),
                               jnp.array([True]), impl="reference")
        np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), rtol=2e-4, atol=2e-4)


def test_training_lowers_loss_and_resumes(tmp_path):
    params, cfg, _ = tiny_pair(num_slots=2)
    rng = np.random.default_rng(0)

    def batches():
        while True:
            yield jnp.asarray(np.resize(rng.integers(0, 63, (8, 5)), (8, 32)), jnp.int32)

    draft, losses = train_drafter(params["target"], cfg.target, cfg.draft, params["draft"],
                                  batches(), steps=6, lr=1e-2, ckpt_dir=tmp_path, save_every=3)
    assert len(losses) == 6
    again, losses = train_drafter(params["target"], cfg.target, cfg.draft, params["draft"],
                                  batches(), steps=10, lr=1e-2, ckpt_dir=tmp_path, save_every=5)
    assert len(losses) == 10  # resumed at step 6, not restarted
    assert np.mean(losses[-3:]) < losses[0]
    assert (tmp_path / "loss.json").exists()


def test_distillation_labels_are_the_targets_greedy_next_tokens():
    """On a sequence the target itself wrote greedily, the data's next tokens are the
    target's choices, so both label kinds give one loss; on random data they part.
    (A label taken one position off would break the equality.)"""
    params, cfg, _ = tiny_pair(num_slots=2)
    t = 24
    forward = jax.jit(lambda toks: dense_forward(params["target"], cfg.target, toks)[0])
    greedy = np.zeros((1, t), np.int32)
    greedy[0, 0] = 7
    for p in range(1, t):  # causal: the zeros after p do not change position p - 1
        greedy[0, p] = int(jnp.argmax(forward(jnp.asarray(greedy))[0, p - 1]))
    random = np.random.default_rng(1).integers(0, 63, (1, t)).astype(np.int32)
    key = jax.random.key(3)
    losses = {labels: jax.jit(dflash_loss(params["target"], cfg.target, cfg.draft,
                                          anchors_per_seq=6, labels=labels))
              for labels in LABELS}
    on_greedy = [float(losses[k](params["draft"], jnp.asarray(greedy), key)) for k in LABELS]
    on_random = [float(losses[k](params["draft"], jnp.asarray(random), key)) for k in LABELS]
    np.testing.assert_allclose(on_greedy[0], on_greedy[1], rtol=1e-6)
    assert abs(on_random[0] - on_random[1]) > 1e-3


def test_unknown_label_kind_is_refused():
    params, cfg, _ = tiny_pair(num_slots=2)
    with pytest.raises(ValueError, match="labels 'teacher' is unknown"):
        dflash_loss(params["target"], cfg.target, cfg.draft, labels="teacher")


def test_anchor_spacing_gives_a_window_one_block_per_that_many_tokens():
    """With the same key, spacing s over a T-token window draws the T // s anchors that
    anchors_per_seq=T // s draws: equal losses; a spacing past the window's length still
    trains one block, and another count gives another loss."""
    loss = loss_on_random_windows(2)
    spaced = loss(anchor_spacing=8)
    assert spaced == loss(anchors_per_seq=6)
    assert spaced != loss(anchors_per_seq=5)
    assert loss(anchor_spacing=100) == loss(anchors_per_seq=1)
    with pytest.raises(ValueError, match="anchor_spacing 0: give at least 1 token"):
        loss(anchor_spacing=0)
