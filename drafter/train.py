"""Training a DFlash drafter for a target, by the DFlash recipe.

For each training sequence (target features computed by the frozen target):
  * sample random anchors a;
  * block input [x_a, MASK * (B-1)] at positions a .. a+B-1, embedded with the
    target's (frozen) embedding;
  * context visible strictly before the anchor (windowed for sliding layers),
    bidirectional inside the block (causal for sliding layers if so configured);
  * block slot k (1..B-1) predicts x_{a+k} through the target's frozen lm_head,
    cross-entropy weighted by exp(-(k-1) / gamma). The label is the data's token
    (`labels="data"`, the DFlash recipe) or the target's own greedy choice there,
    given the data before it (`labels="target"`: distillation, which trains what
    acceptance measures, agreement with the target, also where the target's
    choices part from the data, as far past its training length).

The dense block forward here mirrors `drafter.dflash.draft_block` over the
paged cache; a test checks the two agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from drafter.dflash import DFlashConfig, block_logits_from_hidden
from models.qwen3 import (Qwen3Config, dense_attention, dense_forward, decoder_layer, qkv,
                          rms_norm, rotated)
from models.training import train_loop


def block_logits(draft_params, cfg: DFlashConfig, target_params, target_cfg: Qwen3Config,
                 tokens, features, anchors):
    """Draft-block logits without a cache.

    Args:
      tokens: i32[N, T]; features: [N, T, n*H] target features; anchors: i32[N, A].
    Returns:
      f32[N * A, B - 1, vocab]: slot k predicts the token at anchor + k.
    """
    n, t = tokens.shape
    num_anchors, block = anchors.shape[1], cfg.block_size
    rows = jnp.repeat(jnp.arange(n), num_anchors)                     # block -> sequence
    anchor = anchors.reshape(-1)                                       # [R]
    r = anchor.shape[0]
    ids = jnp.full((r, block), cfg.mask_token_id, jnp.int32)
    ids = ids.at[:, 0].set(tokens[rows, anchor])
    positions = anchor[:, None] + jnp.arange(block)[None]              # [R, B]
    ctx_positions = jnp.broadcast_to(jnp.arange(t), (n, t))
    c = rms_norm(features @ draft_params["fc"], draft_params["hidden_norm"], cfg.rms_norm_eps)
    x = jax.lax.stop_gradient(target_params["embed"])[ids]
    q_pos = positions[:, :, None]
    j = jnp.arange(block)
    for i, p in enumerate(draft_params["layers"]):
        _, k_ctx, v_ctx = qkv(p, c, ctx_positions, cfg.num_heads, cfg.num_kv_heads,
                              cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps, cfg.rope_scaling)
        window = cfg.window(i)
        if window is None:  # the whole context
            k_pos = jnp.broadcast_to(jnp.arange(t)[None], (r, t))
            k_sel, v_sel = k_ctx[rows], v_ctx[rows]
        else:  # the window's keys alone: a sliding layer gives older ones no weight, so
            # a block's cost does not grow with the window's length
            k_pos = anchor[:, None] - window + jnp.arange(window)[None]  # [R, W]
            k_sel, v_sel = (a[rows[:, None], jnp.maximum(k_pos, 0)] for a in (k_ctx, v_ctx))
        ctx_ok = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] < anchor[:, None, None])
        blk_ok = jnp.ones((1, block, block), bool)                     # ^ strictly before a
        if cfg.causal(i):
            blk_ok &= j[None, None, :] <= j[None, :, None]
        if window is not None:
            ctx_ok &= k_pos[:, None, :] > q_pos - window
            blk_ok &= j[None, None, :] > j[None, :, None] - window
        allowed = jnp.concatenate([jnp.broadcast_to(ctx_ok, (r, block, k_pos.shape[1])),
                                   jnp.broadcast_to(blk_ok, (r, block, block))], axis=2)

        def dense_block(q, k_blk, v_blk):  # context before the anchor + the block itself
            keys = jnp.concatenate([k_sel, k_blk], axis=1)
            values = jnp.concatenate([v_sel, v_blk], axis=1)
            return dense_attention(q, keys, values, allowed)

        x = decoder_layer(p, x, cfg, rotated(dense_block, positions, cfg))
    return block_logits_from_hidden(draft_params, cfg, target_params, target_cfg, x)


def target_features(target_params, target_cfg, cfg: DFlashConfig, tokens, *,
                    with_choices: bool = False):
    """Frozen target features the drafter reads: [N, T, n*H]; with `with_choices`,
    also the target's greedy next token at every position, i32[N, T]."""
    logits, hidden = dense_forward(target_params, target_cfg, tokens)
    feats = jax.lax.stop_gradient(
        jnp.concatenate([hidden[i] for i in cfg.target_layer_ids], axis=-1))
    if with_choices:
        return feats, jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return feats


LABELS = ("data", "target")


def draw_anchors(key, n: int, t: int, count: int, first: int = 0):
    """i32[n, count]: block anchors drawn uniformly from positions first .. t - 2 of
    each T-token window, so every block has at least one label inside its window."""
    return jax.random.randint(key, (n, count), first, t - 1)


def dflash_loss(target_params, target_cfg: Qwen3Config, cfg: DFlashConfig, *,
                anchors_per_seq: int = 8, anchor_spacing: int | None = None,
                gamma: float = 4.0, labels: str = "data", tail: int | None = None):
    """loss(draft_params, tokens i32[N, T], key) by the DFlash recipe; `labels`:
    "data" (the next tokens) or "target" (the target's greedy next tokens).

    Each window gets `anchors_per_seq` blocks, or with `anchor_spacing` one block per
    that many tokens (T // anchor_spacing, at least 1), so a long window trains as many
    blocks per token as a short one: the target's features over the window are computed
    once for all of them. With `tail`, blocks are anchored in the window's last `tail`
    tokens alone (one per `anchor_spacing` of them): where a window ends in the
    target's own continuation of the rest, the drafter trains on what serving asks of
    it, blocks anchored at generated tokens."""
    if labels not in LABELS:
        raise ValueError(f"labels {labels!r} is unknown; use one of {LABELS}")
    if anchor_spacing is not None and anchor_spacing < 1:
        raise ValueError(f"anchor_spacing {anchor_spacing}: give at least 1 token")
    if tail is not None and tail < 2:
        raise ValueError(f"tail {tail}: give at least 2 tokens (an anchor and a label)")
    weights = jnp.exp(-jnp.arange(cfg.block_size - 1) / gamma)          # slot k=1.. -> k-1

    def loss(draft_params, tokens, key):
        n, t = tokens.shape
        if tail is not None and tail >= t:
            raise ValueError(f"tail {tail}: the window ({t} tokens) has no context before it")
        first = 0 if tail is None else t - tail                         # the earliest anchor
        num_anchors = (max(1, (t - first) // anchor_spacing) if anchor_spacing
                       else anchors_per_seq)
        if labels == "target":
            feats, choices = target_features(target_params, target_cfg, cfg, tokens,
                                             with_choices=True)
        else:
            feats = target_features(target_params, target_cfg, cfg, tokens)
        anchors = draw_anchors(key, n, t, num_anchors, first)
        logits = block_logits(draft_params, cfg, target_params, target_cfg, tokens, feats,
                              anchors)
        rows = jnp.repeat(jnp.arange(n), num_anchors)
        label_pos = anchors.reshape(-1)[:, None] + jnp.arange(1, cfg.block_size)[None]
        valid = label_pos < t
        if labels == "target":  # the target's choice for position p is made at p - 1
            wanted = choices[rows[:, None], jnp.minimum(label_pos, t - 1) - 1]
        else:
            wanted = tokens[rows[:, None], jnp.minimum(label_pos, t - 1)]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, wanted)
        w = weights[None] * valid
        return (ce * w).sum() / w.sum()
    return loss


def train_drafter(target_params, target_cfg: Qwen3Config, cfg: DFlashConfig, draft_params,
                  batches, *, steps: int, lr: float = 3e-3, anchors_per_seq: int = 8,
                  anchor_spacing: int | None = None, gamma: float = 4.0,
                  labels: str = "data", tail: int | None = None, **kw):
    """Train `draft_params` for the frozen target; see `train_loop` for
    checkpointing (orbax), resuming and the saved loss curve."""
    loss = dflash_loss(target_params, target_cfg, cfg, anchors_per_seq=anchors_per_seq,
                       anchor_spacing=anchor_spacing, gamma=gamma, labels=labels, tail=tail)
    return train_loop(loss, draft_params, batches, steps=steps, lr=lr, desc="drafter", **kw)
