"""HF `config.json` -> Qwen3Config, with transformers' semantics, refusing what is not implemented.

Defaults are transformers' `Qwen3Config` defaults (the same in 4.5x and 5.x):
a key that is absent means what it means to HF, e.g. `tie_word_embeddings`
false, `rope_theta` 10000, `use_sliding_window` false, `head_dim` 128.

    RoPE      transformers 4: `rope_theta` + `rope_scaling` {rope_type | type, factor, ...}
              transformers 5: `rope_parameters` {rope_type, rope_theta, factor, ...}
              (a non-empty `rope_scaling` wins over `rope_parameters`, as in both)
              implemented: default, linear, yarn
    windows   `layer_types` when given; else layer i is sliding iff use_sliding_window
              and i >= max_window_layers; the window is `sliding_window` only when
              use_sliding_window is true (HF sets it to None otherwise)

Every field that changes the math is either read or refused: an error names
the file, the field, its value and what is supported (`ConfigError`). The
DFlash drafter's config (a Qwen3 config plus `dflash_config`) is parsed in
drafter/checkpoint.py with the helpers here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from models.qwen3 import Qwen3Config
from models.rope import ROPE_TYPES, RopeScaling

# transformers' Qwen3Config defaults (configuration_qwen3.py, 4.5x and 5.x)
QWEN3_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
    "max_window_layers": 28,
}
LAYER_TYPES = ("full_attention", "sliding_attention")
_YARN_KEYS = {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "truncate"}
_ROPE_KEYS = {"default": set(), "linear": {"factor"}, "yarn": _YARN_KEYS}


class CheckpointError(ValueError):
    """A checkpoint (config or weights) that cannot be served as it is; names the file."""


class ConfigError(CheckpointError):
    """A config field that is invalid or changes the math in a way not implemented."""


def read_config(path: str | Path) -> dict:
    """The JSON object in `path` (a config.json, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    try:
        hf = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    return hf


def refuse(source, field: str, value, supported: str):
    raise ConfigError(f"{source}: {field}={value!r} is not supported; supported: {supported}")


def get_int(hf: dict, key: str, source, default=None, *, minimum: int = 1) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if value is None:
            raise ConfigError(f"{source}: {key} is missing (an integer >= {minimum})")
        raise ConfigError(f"{source}: {key}={value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{source}: {key}={value} must be >= {minimum}")
    return value


def get_float(hf: dict, key: str, source, default=None) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{source}: {key}={value!r} must be a finite number")
    return float(value)


def get_bool(hf: dict, key: str, source, default: bool) -> bool:
    value = hf.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key}={value!r} must be true or false")
    return value


def parse_rope(hf: dict, source) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 4's or 5's RoPE keys."""
    scaling = hf.get("rope_scaling")
    params = hf.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}={value!r} must be an object or null")
    d = dict(scaling or params or {})
    if any(isinstance(v, dict) for v in d.values()):
        refuse(source, "rope_parameters", d, "one RoPE for every layer (not per layer type)")
    top_theta = hf.get("rope_theta", QWEN3_DEFAULTS["rope_theta"])
    theta = get_float({"rope_theta": d.pop("rope_theta", top_theta)}, "rope_theta", source)
    if not theta > 1:
        raise ConfigError(f"{source}: rope_theta={theta} must be > 1")
    partial = d.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        refuse(source, "partial_rotary_factor", partial, "1.0 (RoPE over the whole head)")
    if "type" in d and "rope_type" in d and d["type"] != d["rope_type"]:
        raise ConfigError(f"{source}: rope scaling has type={d['type']!r} and "
                          f"rope_type={d['rope_type']!r}; give one")
    rope_type = d.pop("rope_type", d.pop("type", "default"))
    d.pop("type", None)
    field = "rope_scaling" if scaling else "rope_parameters"
    if rope_type not in ROPE_TYPES:
        refuse(source, f"{field}.rope_type", rope_type, ", ".join(ROPE_TYPES))
    unknown = sorted(set(d) - _ROPE_KEYS[rope_type])
    if unknown:
        refuse(source, f"{field} keys", unknown,
               f"{sorted(_ROPE_KEYS[rope_type]) or 'none'} for rope_type {rope_type!r}")
    if rope_type == "default":
        return theta, None
    factor = d.get("factor")
    max_pos = get_int(hf, "max_position_embeddings", source,
                      QWEN3_DEFAULTS["max_position_embeddings"])
    if rope_type == "linear":
        factor = get_float(d, "factor", source)
        if not factor > 0:
            raise ConfigError(f"{source}: {field}.factor={factor} must be > 0")
        return theta, RopeScaling("linear", factor)
    # yarn, as transformers computes it: original falls back to max_position_embeddings,
    # factor (when null) to max_position_embeddings / original, betas 0 / null to 32 / 1
    original = d.get("original_max_position_embeddings") or max_pos
    original = get_int({"original_max_position_embeddings": original},
                       "original_max_position_embeddings", source)
    factor = max_pos / original if factor is None else get_float(d, "factor", source)
    if not factor > 0:
        raise ConfigError(f"{source}: {field}.factor={factor} must be > 0")
    optional = {k: (None if d.get(k) is None else get_float(d, k, source))
                for k in ("attention_factor", "mscale", "mscale_all_dim")}
    return theta, RopeScaling(
        "yarn", factor, original,
        beta_fast=get_float({"beta_fast": d.get("beta_fast") or 32}, "beta_fast", source),
        beta_slow=get_float({"beta_slow": d.get("beta_slow") or 1}, "beta_slow", source),
        truncate=get_bool(d, "truncate", source, True),
        **optional)


def parse_layer_types(hf: dict, num_layers: int, source) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window or None when no layer slides), as HF derives them."""
    use_sliding = get_bool(hf, "use_sliding_window", source, QWEN3_DEFAULTS["use_sliding_window"])
    window = hf.get("sliding_window", QWEN3_DEFAULTS["sliding_window"]) if use_sliding else None
    if window is not None:
        window = get_int({"sliding_window": window}, "sliding_window", source)
    types = hf.get("layer_types")
    if types is None:
        first = get_int(hf, "max_window_layers", source, QWEN3_DEFAULTS["max_window_layers"],
                        minimum=0)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"{source}: layer_types={types!r} must list one of {LAYER_TYPES} "
                          f"per layer ({num_layers})")
    bad = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if bad:
        refuse(source, "layer_types", bad, ", ".join(LAYER_TYPES))
    if "sliding_attention" not in types:
        return tuple(types), None
    if window is None:
        raise ConfigError(
            f"{source}: layer_types has sliding_attention layers but use_sliding_window="
            f"{hf.get('use_sliding_window', False)!r}, so HF gives them no window (and refuses "
            f"to run); set use_sliding_window: true and sliding_window")
    return tuple(types), window


def refuse_unimplemented(hf: dict, source) -> None:
    """Fields that would change a Qwen3 layer's math in ways not implemented here."""
    act = hf.get("hidden_act", QWEN3_DEFAULTS["hidden_act"])
    if act != "silu":
        refuse(source, "hidden_act", act, "silu")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False) is not False:
            refuse(source, key, hf[key], "false (no bias tensors)")
    if hf.get("quantization_config"):
        refuse(source, "quantization_config", hf["quantization_config"],
               "unquantized weights (bf16 / f16 / f32)")


def qwen3_layer_fields(hf: dict, source) -> dict:
    """The decoder-layer fields the target and the DFlash drafter share (their Qwen3 part)."""
    refuse_unimplemented(hf, source)
    d = QWEN3_DEFAULTS
    num_layers = get_int(hf, "num_hidden_layers", source, d["num_hidden_layers"])
    hidden = get_int(hf, "hidden_size", source, d["hidden_size"])
    num_heads = get_int(hf, "num_attention_heads", source, d["num_attention_heads"])
    kv = hf.get("num_key_value_heads", d["num_key_value_heads"])
    num_kv_heads = get_int({"num_key_value_heads": num_heads if kv is None else kv},
                           "num_key_value_heads", source)
    if num_heads % num_kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={num_heads} must be a multiple of "
                          f"num_key_value_heads={num_kv_heads}")
    head_dim = hf.get("head_dim", d["head_dim"])
    head_dim = get_int({"head_dim": hidden // num_heads if head_dim is None else head_dim},
                       "head_dim", source)
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim={head_dim} must be even (RoPE pairs)")
    theta, scaling = parse_rope(hf, source)
    types, window = parse_layer_types(hf, num_layers, source)
    eps = get_float(hf, "rms_norm_eps", source, d["rms_norm_eps"])
    if not eps > 0:
        raise ConfigError(f"{source}: rms_norm_eps={eps} must be > 0")
    return dict(hidden_size=hidden, num_layers=num_layers, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim,
                intermediate_size=get_int(hf, "intermediate_size", source,
                                          d["intermediate_size"]),
                rope_theta=theta, rope_scaling=scaling, rms_norm_eps=eps,
                layer_types=types, sliding_window=window)


def qwen3_config_from_hf(hf: dict, source="config.json"):
    """Qwen3Config from an HF Qwen3 config dict; `source` (the file) is named in errors."""
    model_type = hf.get("model_type", "qwen3")
    if model_type != "qwen3":
        refuse(source, "model_type", model_type, "qwen3")
    if hf.get("is_causal", True) is not True:
        refuse(source, "is_causal", hf["is_causal"], "true (a causal decoder)")
    fields = qwen3_layer_fields(hf, source)
    tied = get_bool(hf, "tie_word_embeddings", source, QWEN3_DEFAULTS["tie_word_embeddings"])
    try:
        return Qwen3Config(vocab_size=get_int(hf, "vocab_size", source,
                                              QWEN3_DEFAULTS["vocab_size"]),
                           tie_word_embeddings=tied, **fields)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_qwen3_config(path):
    """Qwen3Config of a checkpoint directory (or a config.json path)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    return qwen3_config_from_hf(read_config(file), file)
