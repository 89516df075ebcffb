"""A Qwen3-architecture decoder over the unified paged KV cache, in plain JAX.

Read top to bottom: config -> init -> norm/rope -> attention -> MLP -> layer ->
forward. Params are a plain pytree (dicts of arrays) so steps can be jitted
with params as an argument and the cache state donated.

    x = embed[tokens]
    for each layer:   x = x + attn(rmsnorm(x));  x = x + mlp(rmsnorm(x))
    logits = rmsnorm(x) @ lm_head        (lm_head = embed.T when tied)

Attention per layer: q/k/v projections, per-head RMSNorm on q and k, NeoX
RoPE and the new K/V stored into the layer's pool pages (one kernel:
`pallas_kernels.rope_store`), then paged attention over the row's pages
(`paged_attention`), windowed for "sliding_attention" layers. `forward` runs the layers as scans over runs of alike
layers (models/layers.py), so its compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.rope_store import split_projections, store_targets
from unified_kv import CacheSpec, LayerSpec, layer_name
from models.attention import attend, attend_draft_block, store_rotated_kv
from models.layers import layer_runs, scan_layers, unstack_layers
from models.rope import RopeScaling, rope_frequencies


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    layer_types: tuple[str, ...] | None = None  # "full_attention" | "sliding_attention"
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None  # None: plain RoPE at rope_theta

    def __post_init__(self):
        types = self.layer_types or ("full_attention",) * self.num_layers
        object.__setattr__(self, "layer_types", tuple(types))
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"num_layers={self.num_layers}")
        bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise ValueError(f"unknown layer_types {sorted(bad)}; use full_attention or "
                             f"sliding_attention")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window in the config")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def to_hf(self) -> dict:
        return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
                "rms_norm_eps": self.rms_norm_eps,
                "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
                "attention_bias": False, "layer_types": list(self.layer_types),
                "use_sliding_window": self.sliding_window is not None,
                "sliding_window": self.sliding_window}

    def layer_specs(self, kv_dtype: str = "bf16", k_scale: float = 1.0,
                    v_scale: float = 1.0) -> list[LayerSpec]:
        """The target's layers for a CacheSpec (`unified_kv.layer_name("target", i)`)."""
        return [LayerSpec(layer_name("target", i), "target", self.num_kv_heads, self.head_dim,
                          kv_dtype, self.window(i), k_scale, v_scale)
                for i in range(self.num_layers)]


class ParamInit:
    """Random init for the tests and for training from scratch: dense weights
    ~ N(0, 1/n_in), norms 1 + small noise (so they matter in tests)."""

    def __init__(self, key: jax.Array, num_keys: int, dtype=jnp.float32):
        self._keys = iter(jax.random.split(key, num_keys))
        self.dtype = dtype

    def dense(self, n_in: int, n_out: int):
        w = jax.random.normal(next(self._keys), (n_in, n_out), jnp.float32) / math.sqrt(n_in)
        return w.astype(self.dtype)

    def embedding(self, vocab: int, hidden: int):
        return (0.5 * jax.random.normal(next(self._keys), (vocab, hidden))).astype(self.dtype)

    def norm(self, n: int):
        return (1.0 + 0.1 * jax.random.normal(next(self._keys), (n,), jnp.float32)).astype(self.dtype)

    def layer(self, hidden, num_heads, num_kv_heads, head_dim, intermediate) -> dict:
        """One decoder layer (shared by the target and the DFlash drafter)."""
        return {"input_norm": self.norm(hidden),
                "q": self.dense(hidden, num_heads * head_dim),
                "k": self.dense(hidden, num_kv_heads * head_dim),
                "v": self.dense(hidden, num_kv_heads * head_dim),
                "o": self.dense(num_heads * head_dim, hidden),
                "q_norm": self.norm(head_dim), "k_norm": self.norm(head_dim),
                "post_norm": self.norm(hidden),
                "gate": self.dense(hidden, intermediate),
                "up": self.dense(hidden, intermediate),
                "down": self.dense(intermediate, hidden)}


def init_params(cfg: Qwen3Config, key: jax.Array, dtype=jnp.float32) -> dict:
    init = ParamInit(key, 4 + 11 * cfg.num_layers, dtype)
    h = cfg.hidden_size
    params = {"embed": init.embedding(cfg.vocab_size, h), "norm": init.norm(h),
              "layers": [init.layer(h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.intermediate_size) for _ in range(cfg.num_layers)]}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = init.dense(h, cfg.vocab_size)
    return params


# ---------------------------------------------------------------- blocks

def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions, head_dim: int, theta, scaling: RopeScaling | None = None):
    """(cos, sin) f32[..., head_dim / 2] of i32 `positions` (models/rope.py), YaRN's
    attention factor applied: a step computes them once for all its layers."""
    inv_freq, attention_factor = rope_frequencies(head_dim, float(theta), scaling)
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:  # YaRN: HF scales cos and sin
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def rope(x, positions, theta, scaling: RopeScaling | None = None):
    """NeoX-style rotary embedding (models/rope.py: linear / YaRN scaling).

    x: [B, T, heads, D]; positions: i32[B, T] absolute positions.
    """
    cos, sin = rope_tables(positions, x.shape[-1], theta, scaling)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def mlp(p, x):
    """SwiGLU over separate gate / up weights, or the step form's fused "gate_up"."""
    if "gate_up" in p:
        gate, up = jnp.split(x @ p["gate_up"], 2, axis=-1)
    else:
        gate, up = x @ p["gate"], x @ p["up"]
    return (jax.nn.silu(gate) * up) @ p["down"]


def projections(p, x):
    """x [B, T, H] -> the q, k, v projections [B*T, heads * D] before norm and RoPE: the
    step form's one fused matrix ([B*T, (Hq + 2 Hkv) * D], models/layers.py
    `fuse_projections`), else a (q, k, v) tuple."""
    x = x.reshape(-1, x.shape[-1])
    if "qkv" in p:
        return x @ p["qkv"]
    return x @ p["q"], x @ p["k"], x @ p["v"]


def qkv(p, x, positions, num_heads, num_kv_heads, head_dim, theta, eps,
        scaling: RopeScaling | None = None):
    """Projections, per-head q/k RMSNorm, RoPE. x: [B, T, H] -> q [B,T,Hq,D], k, v [B,T,Hkv,D]."""
    b, t, _ = x.shape
    q, k, v = (y.reshape(b, t, -1, head_dim) for y in split_projections(
        projections(p, x), num_heads, num_kv_heads, head_dim))
    q = rope(rms_norm(q, p["q_norm"], eps), positions, theta, scaling)
    k = rope(rms_norm(k, p["k_norm"], eps), positions, theta, scaling)
    return q, k, v


def rotated(attention, positions, cfg):
    """A `decoder_layer` attention from `attention(q [B,T,Hq,D], k, v [B,T,Hkv,D])` that
    takes q, k, v normed and rotated (`qkv`): the dense and draft-block paths."""
    return lambda p, h: attention(*qkv(p, h, positions, cfg.num_heads, cfg.num_kv_heads,
                                       cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps,
                                       cfg.rope_scaling))


def lm_head_weight(params, cfg: Qwen3Config):
    """[H, vocab]: the tied embedding or the separate head (the drafter uses it too)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def lm_head(params, cfg, x):
    return (rms_norm(x, params["norm"], cfg.rms_norm_eps) @ lm_head_weight(params, cfg)
            ).astype(jnp.float32)


def decoder_layer(p, x, cfg, attention):
    """x += attn(norm(x)); x += mlp(norm(x)).

    `attention(p, h [B,T,H]) -> [B,T,Hq,D]` is the one part the paged, dense and
    draft-block paths do differently (`rotated` builds the last two). `cfg` is a
    Qwen3Config or a DFlashConfig (same head and norm fields).
    """
    h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
    x = x + attention(p, h).reshape(x.shape[0], x.shape[1], -1) @ p["o"]
    return x + mlp(p, rms_norm(x, p["post_norm"], cfg.rms_norm_eps))


def forward(params, cfg: Qwen3Config, spec: CacheSpec, pools, tables, tokens, starts,
            num_tokens, *, feature_layers: tuple[int, ...] = (), impl: str = "auto",
            scan_unroll: int = 1):
    """`run_layers`, then the head at every position: (logits f32[B, T, vocab], pools,
    features)."""
    x, pools, feats = run_layers(params, cfg, spec, pools, tables, tokens, starts, num_tokens,
                                 feature_layers=feature_layers, impl=impl,
                                 scan_unroll=scan_unroll)
    return lm_head(params, cfg, x), pools, feats


def at_index(x, index):
    """x[b, index[b]] of x [B, T, ...], keeping the axis: [B, 1, ...]."""
    return jnp.take_along_axis(x, index.reshape(-1, *[1] * (x.ndim - 1)), axis=1)


def run_layers(params, cfg: Qwen3Config, spec: CacheSpec, pools, tables, tokens, starts,
               num_tokens, *, feature_layers: tuple[int, ...] = (), impl: str = "auto",
               scan_unroll: int = 1):
    """Run `tokens` through the target's layers, storing their K/V into the cache.

    Stacked params["layers"] run as scans over runs of alike layers, a list of
    per-layer dicts unrolled (models/layers.py). What every layer shares (RoPE's
    tables, each token's store page and slot, the rows' key counts) is computed once,
    outside the layers.

    Args:
      pools: KVState.pools; tables: per pool, batch tables i32[B, W] (page * 2L).
      tokens: i32[B, T]; starts: i32[B] position of tokens[:, 0] (= cached
        length before this call); num_tokens: i32[B] valid tokens (0: padding).
    Returns:
      (x [B, T, H] the residual stream after the last layer, pools,
      features [B, T, len(feature_layers) * H]: the residual stream after each
      requested layer).
    """
    b, t = tokens.shape
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    cos, sin = (a.reshape(b * t, -1) for a in rope_tables(positions, cfg.head_dim,
                                                          cfg.rope_theta, cfg.rope_scaling))
    targets = [store_targets(table, starts, num_tokens, pool.shape[4], t)
               for pool, table in zip(pools, tables)]
    kv_lens = starts + num_tokens

    def layer_fn(p, x, pools, layer, pool_id, offset):
        pools = list(pools)

        def paged(p, h):  # store the new K/V, then attend over the row's pages
            q, pools[pool_id] = store_rotated_kv(
                projections(p, h),
                p["q_norm"], p["k_norm"], cos, sin, pools[pool_id], targets[pool_id], layer,
                offset, num_q_heads=cfg.num_heads, eps=cfg.rms_norm_eps, impl=impl)
            return attend(q.reshape(b, t, cfg.num_heads, cfg.head_dim), pools[pool_id],
                          tables[pool_id], kv_lens, num_tokens, layer, offset, impl=impl)

        return decoder_layer(p, x, cfg, paged), tuple(pools)

    x, pools, features = scan_layers(
        layer_fn, params["layers"], layer_runs(spec, "target", cfg.num_layers),
        params["embed"][tokens], tuple(pools), taps=tuple(feature_layers), unroll=scan_unroll,
        unsliced=("q_norm", "k_norm"))
    return x, pools, jnp.concatenate(features, axis=-1) if feature_layers else None


def block_forward(layers, cfg, spec: CacheSpec, pools, tables, x, positions, ctx_lens,
                  block_lens, *, causal_in_sliding: bool, impl: str = "auto"):
    """A block of queries through the cache's "draft" layers (DFlash's draft block).

    Each layer attends over its row's context pages (read, never written) plus the
    block's own K/V: bidirectional within the block, or causal on sliding layers when
    `causal_in_sliding`. x: [B, block, H] embedded block; positions i32[B, block];
    ctx_lens i32[B] context tokens per row; block_lens i32[B] (0: a padding row).
    Returns x after the last layer.
    """
    def layer_fn(p, x, _, layer, pool_id, offset):
        def paged_block(q, k, v):
            causal = causal_in_sliding and layer.sliding_window is not None
            return attend_draft_block(q, pools[pool_id], tables[pool_id], ctx_lens, block_lens,
                                      k, v, layer, offset, causal_in_block=causal, impl=impl)

        return decoder_layer(p, x, cfg, rotated(paged_block, positions, cfg)), ()

    x, _, _ = scan_layers(layer_fn, layers, layer_runs(spec, "draft", cfg.num_layers), x, ())
    return x


def dense_attention(q, k, v, allowed):
    """Masked softmax attention without a cache. q [N,T,Hq,D]; k, v [N,S,Hkv,D];
    allowed bool[N or 1, T, S]."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("nthd,nshd->nhts", q.astype(jnp.float32), k.astype(jnp.float32))
    logits = jnp.where(allowed[:, None], logits / math.sqrt(q.shape[-1]), -1e30)
    return jnp.einsum("nhts,nshd->nthd", jax.nn.softmax(logits, axis=-1),
                      v.astype(jnp.float32)).astype(q.dtype)


def causal_mask(t: int, window: int | None):
    pos = jnp.arange(t)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    return allowed[None]


def dense_forward(params, cfg: Qwen3Config, tokens):
    """Whole sequences without a cache (training and feature extraction).

    tokens: i32[N, T]. Returns (logits f32[N, T, vocab], hidden: list of the
    residual stream after each layer, [N, T, H] each).
    """
    n, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    x = params["embed"][tokens]
    hidden = []
    for i, p in enumerate(unstack_layers(params["layers"])):
        mask = causal_mask(t, cfg.window(i))
        x = decoder_layer(p, x, cfg, rotated(lambda q, k, v: dense_attention(q, k, v, mask),
                                             positions, cfg))
        hidden.append(x)
    return lm_head(params, cfg, x), hidden
