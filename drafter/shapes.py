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
from models.layers import fuse_projections
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


def random_step_params(tcfg: Qwen3Config, dcfg: DFlashConfig | None, scan: bool, *,
                       seed: int = 0, dtype=jnp.bfloat16) -> dict:
    """`step_params(random_params(...), scan)`, drawn in step form: each layer comes out of
    its program with its projections fused, and a scan's stacked leaves are allocated
    whole before any layer and written one layer a call in place (donated). The device
    never holds the checkpoint form beside the step form, so the weights sit in one
    piece and a cache allocated after them finds the rest of the memory unbroken."""
    kt, kd = jax.random.split(jax.random.key(seed))
    params = {"target": _layer_by_layer(init_target, tcfg, kt, dtype, step_form=True,
                                        scan=scan)}
    if dcfg is not None:
        params["draft"] = _layer_by_layer(init_draft, dcfg, kd, dtype, step_form=True,
                                          scan=scan)
    return params


def _layer_by_layer(init, cfg, key, dtype, *, step_form: bool = False,
                    scan: bool = False) -> dict:
    """`init(cfg, key, dtype)`'s tree, its layers drawn by one program called per layer
    (`step_form`: each layer fused, and stacked when `scan`, as `step_params` makes them)."""
    k_rest, k_layers = jax.random.split(key)
    # every layer's weights have one shape (windows change only which keys it reads)
    types = getattr(cfg, "layer_types", None)
    one = dataclasses.replace(cfg, num_layers=1, **({"layer_types": types[:1]} if types else {}))

    def draw(k):
        layer = init(one, k, dtype)["layers"][0]
        return fuse_projections(layer) if step_form else layer

    rest = jax.jit(lambda k: {name: x for name, x in init(one, k, dtype).items()
                              if name != "layers"})
    keys = jax.random.split(k_layers, cfg.num_layers)
    if not scan:
        one_layer = jax.jit(draw)
        return {**rest(k_rest), "layers": [one_layer(k) for k in keys]}
    shapes = jax.eval_shape(draw, keys[0])
    stacked = jax.jit(lambda: jax.tree.map(
        lambda s: jnp.zeros((cfg.num_layers, *s.shape), s.dtype), shapes))()
    put = jax.jit(lambda st, k, i: jax.tree.map(
        lambda whole, x: whole.at[i].set(x), st, draw(k)), donate_argnums=0)
    for i, k in enumerate(keys):
        stacked = put(stacked, k, i)
    return {**rest(k_rest), "layers": stacked}


def param_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
