"""The DFlash drafter: context KV from fused target features, and the draft block.

    target features  f_t = concat(out of target layers target_layer_ids)  [B, T, n*H]
    fused context    c_t = RMSNorm_hidden(fc(f_t))                        [B, T, H]
    context KV of draft layer l at position t (what lives in the draft pages):
        K = RoPE(k_norm(W_k c_t), t),  V = W_v c_t

    draft block at anchor position p (block size B):
        ids  = [x_p, MASK, ..., MASK]          positions p .. p+B-1
        x    = target.embed[ids]
        each draft layer: x += attn(norm(x)) over context (< p, windowed for
                          sliding layers) + the block itself (bidirectional, or
                          causal for sliding layers when so trained); x += mlp
        drafts = argmax(target.lm_head(norm(x)))[1 : B]

The drafter shares the target's embedding and lm_head; its own params are fc,
hidden_norm, the draft layers and the final norm.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.attention import write_layer_kv
from models.layers import layer_runs, scan_layers, unstack_layers
from models.qwen3 import (ParamInit, Qwen3Config, block_forward, lm_head_weight, qkv,
                          rms_norm)
from models.rope import RopeScaling
from unified_kv import CacheSpec, LayerSpec, layer_name


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """DFlash's default feature layers: spread over the target's depth."""
    if n == 1:
        return (num_target_layers // 2,)
    return tuple(round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    causal_in_sliding_block: bool = False  # how the sliding layers were trained
    rope_scaling: RopeScaling | None = None  # the drafter's own RoPE (z-lab: its config's)

    def __post_init__(self):
        ids = self.target_layer_ids or default_target_layer_ids(self.num_target_layers,
                                                                self.num_layers)
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in ids))
        types = self.layer_types or ("full_attention",) * self.num_layers
        object.__setattr__(self, "layer_types", tuple(types))
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"num_layers={self.num_layers}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention draft layers need sliding_window")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + drafts), got {self.block_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's "
                             f"{self.num_target_layers} layers")

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def causal(self, layer: int) -> bool:
        return self.causal_in_sliding_block and self.window(layer) is not None

    def to_hf(self) -> dict:
        return {"model_type": "qwen3", "architectures": ["DFlashDraftModel"],
                "num_hidden_layers": self.num_layers,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "block_size": self.block_size,
                "num_target_layers": self.num_target_layers,
                "layer_types": list(self.layer_types),
                "use_sliding_window": self.sliding_window is not None,
                "sliding_window": self.sliding_window, "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
                "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
                "attention_bias": False,
                # z-lab reads is_causal (absent: sliding layers causal in the block)
                **({} if self.causal_in_sliding_block else {"is_causal": False}),
                "dflash_config": {"target_layer_ids": list(self.target_layer_ids),
                                  "mask_token_id": self.mask_token_id,
                                  "causal_in_sliding_block": self.causal_in_sliding_block}}

    def layer_specs(self, kv_dtype: str = "bf16") -> list[LayerSpec]:
        """The draft layers for a CacheSpec (`unified_kv.layer_name("draft", i)`)."""
        return [LayerSpec(layer_name("draft", i), "draft", self.num_kv_heads, self.head_dim,
                          kv_dtype, self.window(i)) for i in range(self.num_layers)]


def init_params(cfg: DFlashConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    init = ParamInit(key, 3 + 11 * cfg.num_layers, dtype)
    h = cfg.hidden_size
    return {"fc": init.dense(len(cfg.target_layer_ids) * h, h),
            "hidden_norm": init.norm(h), "norm": init.norm(h),
            "layers": [init.layer(h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                  cfg.intermediate_size) for _ in range(cfg.num_layers)]}


def context_kv(params, cfg: DFlashConfig, features, positions):
    """Per draft layer, (K, V) [B, T, Hkv, D] of context positions from target features."""
    c = rms_norm(features @ params["fc"], params["hidden_norm"], cfg.rms_norm_eps)
    return [qkv(p, c, positions, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta,
                cfg.rms_norm_eps, cfg.rope_scaling)[1:] for p in unstack_layers(params["layers"])]


def write_context(params, cfg: DFlashConfig, spec: CacheSpec, pools, tables, features, starts,
                  num_tokens):
    """Store draft context KV for positions starts .. starts + num_tokens - 1
    (`context_kv`, one layer per scan iteration)."""
    positions = starts[:, None] + jnp.arange(features.shape[1], dtype=jnp.int32)[None]
    c = rms_norm(features @ params["fc"], params["hidden_norm"], cfg.rms_norm_eps)

    def layer_fn(p, c, pools, layer, pool_id, offset):
        _, k, v = qkv(p, c, positions, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.rope_theta, cfg.rms_norm_eps, cfg.rope_scaling)
        pools = list(pools)
        pools[pool_id] = write_layer_kv(pools[pool_id], tables[pool_id], starts, num_tokens,
                                        k, v, layer, offset)
        return c, tuple(pools)

    _, pools, _ = scan_layers(layer_fn, params["layers"],
                              layer_runs(spec, "draft", cfg.num_layers), c, tuple(pools))
    return pools


def draft_block(params, cfg: DFlashConfig, target_params, target_cfg: Qwen3Config,
                spec: CacheSpec, pools, tables, anchors, ctx_lens, active, *, impl: str):
    """Draft B-1 tokens after each row's anchor token.

    Args:
      anchors: i32[batch] token at position ctx_lens (committed, not yet in any cache).
      ctx_lens: i32[batch] draft context positions; active: bool[batch] (padding False).
    Returns:
      (drafts i32[batch, B-1], logits f32[batch, B-1, vocab]).
    """
    batch, block = anchors.shape[0], cfg.block_size
    ids = jnp.full((batch, block), cfg.mask_token_id, jnp.int32).at[:, 0].set(anchors)
    positions = ctx_lens[:, None] + jnp.arange(block, dtype=jnp.int32)[None]
    block_lens = jnp.where(active, block, 0).astype(jnp.int32)

    x = block_forward(params["layers"], cfg, spec, pools, tables, target_params["embed"][ids],
                      positions, ctx_lens, block_lens,
                      causal_in_sliding=cfg.causal_in_sliding_block, impl=impl)
    logits = block_logits_from_hidden(params, cfg, target_params, target_cfg, x)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits


def block_logits_from_hidden(params, cfg: DFlashConfig, target_params, target_cfg, x):
    """Slots 1..B-1 of the block through the drafter's norm and the target's
    (frozen) lm_head: f32[batch, B-1, vocab]."""
    w = jax.lax.stop_gradient(lm_head_weight(target_params, target_cfg))
    return (rms_norm(x[:, 1:], params["norm"], cfg.rms_norm_eps) @ w).astype(jnp.float32)
