"""Real model shapes, for step timing and numerics checks with random weights.

`qwen3_8b_pair()` is a Qwen3-8B target (36 layers, hidden 4096, 32 / 8 heads,
head_dim 128, vocab 151,936, untied embeddings) with a drafter shaped like
z-lab's Qwen3-8B-DFlash-b16 (5 layers, block 16, features from target layers
1, 9, 17, 25, 33). `num_target_layers` / `num_draft_layers` cut the depth
(the per-layer shapes stay), for mid-size checks that compile quickly;
`vocab_size` shrinks the vocabulary for smoke tests on a CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from drafter.dflash import DFlashConfig, init_params as init_draft
from models.qwen3 import Qwen3Config, init_params as init_target

QWEN3_VOCAB = 151_936
QWEN3_MASK_TOKEN = 151_669  # the DFlash checkpoints' mask token (an unused added token)


def qwen3_8b_pair(num_target_layers: int = 36, num_draft_layers: int = 5,
                  block_size: int = 16, vocab_size: int = QWEN3_VOCAB
                  ) -> tuple[Qwen3Config, DFlashConfig]:
    target = Qwen3Config(vocab_size=vocab_size, hidden_size=4096, intermediate_size=12288,
                         num_layers=num_target_layers, num_heads=32, num_kv_heads=8,
                         head_dim=128, tie_word_embeddings=False)
    ids = (1, 9, 17, 25, 33) if num_target_layers == 36 else tuple(
        sorted({min(i, num_target_layers - 1) for i in (0, num_target_layers // 2,
                                                        num_target_layers - 1)}))
    draft = DFlashConfig(num_layers=num_draft_layers, hidden_size=4096,
                         intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128,
                         block_size=block_size,
                         mask_token_id=min(QWEN3_MASK_TOKEN, vocab_size - 1),
                         num_target_layers=num_target_layers, target_layer_ids=ids)
    return target, draft


def random_params(tcfg: Qwen3Config, dcfg: DFlashConfig | None, *, seed: int = 0,
                  dtype=jnp.bfloat16) -> dict:
    """Random weights made on the default device (an 8B model never visits the host), one
    layer a call of one compiled program: a program drawing every layer at once spends
    minutes compiling its random number generators."""
    kt, kd = jax.random.split(jax.random.key(seed))
    params = {"target": _layer_by_layer(init_target, tcfg, kt, dtype)}
    if dcfg is not None:
        params["draft"] = _layer_by_layer(init_draft, dcfg, kd, dtype)
    return params


def _layer_by_layer(init, cfg, key, dtype) -> dict:
    """`init(cfg, key, dtype)`'s tree, its layers drawn by one program called per layer."""
    k_rest, k_layers = jax.random.split(key)
    # every layer's weights have one shape (windows change only which keys it reads)
    types = getattr(cfg, "layer_types", None)
    one = dataclasses.replace(cfg, num_layers=1, **({"layer_types": types[:1]} if types else {}))
    one_layer = jax.jit(lambda k: init(one, k, dtype)["layers"][0])
    rest = jax.jit(lambda k: {name: x for name, x in init(one, k, dtype).items()
                              if name != "layers"})
    return {**rest(k_rest),
            "layers": [one_layer(k) for k in jax.random.split(k_layers, cfg.num_layers)]}


def param_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
