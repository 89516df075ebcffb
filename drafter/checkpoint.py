"""The z-lab DFlash drafter checkpoint: config semantics and safetensors key map.

    layers.N.self_attn.q_proj.weight ...   layers[N].q ... (as a Qwen3 layer, no `model.`)
    fc.weight                  [H, n*H]    fc (transposed)
    hidden_norm.weight, norm.weight        hidden_norm, norm

The config is a Qwen3 config (models/config.py: HF defaults, RoPE scaling,
layer types, refusals) plus, as z-lab's `DFlashDraftModel` reads it, each of
these from `dflash_config` first and the top level second:

    mask_token_id      required
    block_size         16 when absent
    target_layer_ids   DFlash's spread over the target's depth when absent
    num_target_layers  top level, required

`is_causal` (top level, z-lab): absent -> sliding layers causal within the
block, full layers bidirectional; false -> all bidirectional; true -> all
causal (implemented only when every layer slides). This project's own
`dflash_config.causal_in_sliding_block`, when present, decides instead.
DFlash-2 features (convolutions, candidate selector, logit multiplier or
soft cap, embedding scale) are refused.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from drafter.dflash import DFlashConfig, init_params
from models.checkpoint import (LAYER_KEYS, fingerprint, load_safetensors_params,
                               tensors_from_params, write_safetensors)
from models.config import ConfigError, get_int, qwen3_layer_fields, read_config, refuse

DFLASH_KEYS = {"mask_token_id", "block_size", "target_layer_ids", "causal_in_sliding_block"}
# z-lab's DFlash-2 options: each changes the drafter's math; none is implemented here.
_DFLASH2 = {"output_multiplier": 1.0, "input_embedding_scale": 1.0,
            "final_logit_softcapping": None, "conv_kernel_size": None, "conv_group_size": None,
            "selector_rank": None, "selector_top_k": None}


def dflash_key_map(cfg) -> list[tuple[str, tuple, bool]]:
    keys = [("fc.weight", ("fc",), True), ("hidden_norm.weight", ("hidden_norm",), False),
            ("norm.weight", ("norm",), False)]
    for i in range(cfg.num_layers):
        keys += [(f"layers.{i}.{k}", ("layers", i, name), t) for k, name, t in LAYER_KEYS]
    return keys


def _causal_in_sliding_block(hf: dict, dflash: dict, types, source) -> bool:
    own = dflash.get("causal_in_sliding_block")
    if own is not None:
        if not isinstance(own, bool):
            raise ConfigError(f"{source}: dflash_config.causal_in_sliding_block={own!r} must be "
                              f"true or false")
        return own
    is_causal = hf.get("is_causal")
    if is_causal is None:
        return True  # z-lab: sliding layers causal, full layers bidirectional
    if is_causal is False:
        return False
    if is_causal is True and all(t == "sliding_attention" for t in types):
        return True
    refuse(source, "is_causal", is_causal,
           "absent, false, or true when every layer is sliding_attention (causal full "
           "draft layers are not implemented)")


def dflash_config_from_hf(hf: dict, source="config.json") -> DFlashConfig:
    """DFlashConfig from a z-lab DFlash drafter config dict; `source` is named in errors."""
    model_type = hf.get("model_type", "qwen3")
    if model_type not in ("qwen3", "dflash"):
        refuse(source, "model_type", model_type, "qwen3 (z-lab DFlash drafters), dflash")
    archs = hf.get("architectures") or ["DFlashDraftModel"]
    if archs != ["DFlashDraftModel"]:
        refuse(source, "architectures", archs, '["DFlashDraftModel"]')
    dflash = hf.get("dflash_config")
    if dflash is None and "mask_token_id" not in hf:
        raise ConfigError(f"{source}: no dflash_config (a z-lab DFlash drafter config carries "
                          f"dflash_config.mask_token_id and target_layer_ids); is this a "
                          f"drafter checkpoint?")
    dflash = {} if dflash is None else dflash
    if not isinstance(dflash, dict):
        raise ConfigError(f"{source}: dflash_config={dflash!r} must be an object")

    def value(name, default=None):  # z-lab's _draft_value: dflash_config, then top level
        return dflash.get(name, hf.get(name, default))

    for name, neutral in _DFLASH2.items():
        if value(name, neutral) != neutral:
            refuse(source, name, value(name), f"{neutral} (DFlash-2 features are not implemented)")
    unknown = sorted(set(dflash) - DFLASH_KEYS - set(_DFLASH2))
    if unknown:
        refuse(source, "dflash_config keys", unknown, sorted(DFLASH_KEYS))
    if value("mask_token_id") is None:
        raise ConfigError(f"{source}: no mask_token_id (looked in dflash_config.mask_token_id "
                          f"and at the top level); the drafter fills its block with it")
    mask = get_int({"mask_token_id": value("mask_token_id")}, "mask_token_id", source, minimum=0)
    block = get_int({"block_size": value("block_size", 16)}, "block_size", source, minimum=2)
    fields = qwen3_layer_fields(hf, source)
    num_target = get_int(hf, "num_target_layers", source)
    ids = value("target_layer_ids")
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(i, int) and not isinstance(i, bool)
                                       for i in ids)):
        raise ConfigError(f"{source}: target_layer_ids={ids!r} must be a non-empty list of ints")
    causal = _causal_in_sliding_block(hf, dflash, fields["layer_types"], source)
    try:
        return DFlashConfig(block_size=block, mask_token_id=mask, num_target_layers=num_target,
                            target_layer_ids=tuple(ids or ()), causal_in_sliding_block=causal,
                            **fields)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_dflash_config(path) -> DFlashConfig:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    return dflash_config_from_hf(read_config(file), file)


def load_dflash(path, dtype=jnp.float32, *, on_host: bool = False):
    """(DFlashConfig, params) from a z-lab DFlash drafter checkpoint directory
    (`models.checkpoint.params_from_tensors`' dtype and on_host)."""
    cfg = load_dflash_config(path)
    return cfg, load_safetensors_params(path, cfg, init_params, dflash_key_map, dtype,
                                        on_host=on_host)


def save_dflash(path, cfg, params, num_shards: int = 1):
    write_safetensors(path, tensors_from_params(params, dflash_key_map(cfg)), cfg.to_hf(),
                      num_shards, fingerprint(params))
