"""Checkpoints: HF Qwen3 and z-lab DFlash safetensors layouts, and orbax.

Both safetensors layouts are described by one key map each, a list of
(checkpoint key, path into our params, transposed?). Loading checks every
key and shape against the config and names the key on any mismatch; saving
walks the same map, so a save/load round trip is exact.

    HF Qwen3                                     ours
    model.embed_tokens.weight        [V, H]      embed
    model.layers.N.self_attn.q_proj.weight       layers[N].q   (transposed)
    model.layers.N.self_attn.q_norm.weight       layers[N].q_norm
    model.layers.N.mlp.gate_proj.weight          layers[N].gate (transposed)
    model.layers.N.input_layernorm.weight        layers[N].input_norm
    model.norm.weight, lm_head.weight            norm, lm_head (transposed)

    DFlash drafter: the same per-layer names without the `model.` prefix,
    plus fc.weight (transposed), hidden_norm.weight, norm.weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

_LAYER_KEYS = [  # (checkpoint suffix, our name, transposed)
    ("self_attn.q_proj.weight", "q", True), ("self_attn.k_proj.weight", "k", True),
    ("self_attn.v_proj.weight", "v", True), ("self_attn.o_proj.weight", "o", True),
    ("self_attn.q_norm.weight", "q_norm", False), ("self_attn.k_norm.weight", "k_norm", False),
    ("mlp.gate_proj.weight", "gate", True), ("mlp.up_proj.weight", "up", True),
    ("mlp.down_proj.weight", "down", True), ("input_layernorm.weight", "input_norm", False),
    ("post_attention_layernorm.weight", "post_norm", False),
]


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the key."""


def qwen3_key_map(cfg) -> list[tuple[str, tuple, bool]]:
    keys = [("model.embed_tokens.weight", ("embed",), False), ("model.norm.weight", ("norm",), False)]
    if not cfg.tie_word_embeddings:
        keys.append(("lm_head.weight", ("lm_head",), True))
    for i in range(cfg.num_layers):
        keys += [(f"model.layers.{i}.{k}", ("layers", i, name), t) for k, name, t in _LAYER_KEYS]
    return keys


def dflash_key_map(cfg) -> list[tuple[str, tuple, bool]]:
    keys = [("fc.weight", ("fc",), True), ("hidden_norm.weight", ("hidden_norm",), False),
            ("norm.weight", ("norm",), False)]
    for i in range(cfg.num_layers):
        keys += [(f"layers.{i}.{k}", ("layers", i, name), t) for k, name, t in _LAYER_KEYS]
    return keys


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory: one file, or shards with an index."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    tensors = {}
    for name in files:
        tensors.update(load_file(path / name))
    return tensors


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree, path, value):
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def params_from_tensors(tensors, key_map, template, dtype=jnp.float32):
    """Fill a params pytree shaped like `template` (from init_params/eval_shape)."""
    params = jax.tree.map(lambda _: None, template)
    for key, path, transposed in key_map:
        if key not in tensors:
            raise CheckpointError(f"checkpoint is missing {key!r} (needed for "
                                  f"{'.'.join(map(str, path))})")
        value = tensors[key].T if transposed else tensors[key]
        want = _get(template, path).shape
        if value.shape != want:
            raise CheckpointError(f"{key!r} has shape {tensors[key].shape}, expected "
                                  f"{want[::-1] if transposed else want} from the config")
        _set(params, path, jnp.asarray(value, dtype))
    return params


def tensors_from_params(params, key_map) -> dict[str, np.ndarray]:
    out = {}
    for key, path, transposed in key_map:
        value = np.asarray(_get(params, path))  # keeps bf16 (ml_dtypes) as bf16
        out[key] = np.ascontiguousarray(value.T if transposed else value)
    return out


def write_safetensors(path, tensors: dict[str, np.ndarray], config: dict, num_shards: int = 1):
    """Write config.json and one file, or `num_shards` shards plus the index."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    if num_shards == 1:
        save_file(tensors, path / "model.safetensors")
        return
    weight_map = {}
    for s in range(num_shards):
        shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::num_shards]}
        save_file(part, path / shard)
        weight_map.update({n: shard for n in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _load(path, config_cls, init_params, key_map, dtype):
    cfg = config_cls.from_hf(json.loads((Path(path) / "config.json").read_text()))
    template = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    return cfg, params_from_tensors(read_safetensors(path), key_map(cfg), template, dtype)


def load_qwen3(path, dtype=jnp.float32):
    """(Qwen3Config, params) from an HF Qwen3 checkpoint directory."""
    from models.qwen3 import Qwen3Config, init_params
    return _load(path, Qwen3Config, init_params, qwen3_key_map, dtype)


def load_dflash(path, dtype=jnp.float32):
    """(DFlashConfig, params) from a z-lab DFlash drafter checkpoint directory."""
    from drafter.dflash import DFlashConfig, init_params
    return _load(path, DFlashConfig, init_params, dflash_key_map, dtype)


def save_qwen3(path, cfg, params, num_shards: int = 1):
    write_safetensors(path, tensors_from_params(params, qwen3_key_map(cfg)), cfg.to_hf(),
                      num_shards)


def save_dflash(path, cfg, params, num_shards: int = 1):
    write_safetensors(path, tensors_from_params(params, dflash_key_map(cfg)), cfg.to_hf(),
                      num_shards)


def save_orbax(path, params, config: dict) -> None:
    """Params with orbax (a `params/` item) and the HF-style config beside them."""
    import orbax.checkpoint as ocp
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "params", params, force=True)


def restore_orbax(path, template) -> tuple[dict, dict]:
    """(config dict, params) saved by `save_orbax`; `template` gives the tree structure."""
    import orbax.checkpoint as ocp
    path = Path(path).absolute()
    config = json.loads((path / "config.json").read_text())
    # Restore onto this machine's default device: a checkpoint written on a CPU
    # host must load on a GPU one (orbax refuses a topology it cannot map).
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            template)
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(path / "params", template)
    return config, params
