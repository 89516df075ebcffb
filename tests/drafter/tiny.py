"""Tiny target + drafter configurations shared by the drafter tests."""

import jax

from drafter.dflash import DFlashConfig, init_params as init_draft_params
from drafter.steps import StepConfig
from models.qwen3 import Qwen3Config, init_params as init_target_params
from unified_kv import CacheSpec


def tiny_pair(*, num_slots=4, max_seq_len=160, kv_dtype="f32", target_kv_dtype=None,
              draft_window=16, target_window=16, block_size=4, page_size=8, impl="reference",
              seed=0, num_kv_heads=2, head_dim=16):
    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                     num_heads=4, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     layer_types=("sliding_attention", "full_attention") * 2,
                     sliding_window=target_window, tie_word_embeddings=False)
    dc = DFlashConfig(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                      mask_token_id=63,
                      num_target_layers=4,
                      layer_types=("sliding_attention", "full_attention") if draft_window
                      else None, sliding_window=draft_window)
    layers = tc.layer_specs(target_kv_dtype or kv_dtype) + dc.layer_specs(kv_dtype)
    spec = CacheSpec(page_size, tuple(layers), num_slots, max_seq_len, 1 << 28,
                     max(block_size, 8))
    params = {"target": init_target_params(tc, jax.random.key(seed)),
              "draft": init_draft_params(dc, jax.random.key(seed + 1))}
    return params, StepConfig(tc, spec, dc, impl), StepConfig(tc, spec, None, impl)
