"""config.json parsing: HF's defaults, transformers 4's and 5's keys, and every refusal
naming file, field and value."""

import json

import pytest
from safetensors.numpy import load_file, save_file

from drafter.checkpoint import dflash_config_from_hf, load_dflash, save_dflash
from models.checkpoint import load_qwen3, save_qwen3
from models.config import ConfigError, qwen3_config_from_hf
from models.rope import RopeScaling, rope_frequencies

BASE = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16}
DRAFT = {**BASE, "architectures": ["DFlashDraftModel"], "num_hidden_layers": 2,
         "num_target_layers": 4, "block_size": 4,
         "dflash_config": {"mask_token_id": 63, "target_layer_ids": [1, 2]}}


def test_absent_keys_mean_what_they_mean_to_hf():
    cfg = qwen3_config_from_hf(BASE)
    assert cfg.tie_word_embeddings is False
    assert cfg.rope_theta == 10_000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.layer_types == ("full_attention",) * 4 and cfg.sliding_window is None
    no_heads = {k: v for k, v in BASE.items() if k not in ("head_dim", "num_key_value_heads")}
    cfg = qwen3_config_from_hf({**no_heads, "num_attention_heads": 32, "hidden_size": 4096})
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 32          # HF's Qwen3Config defaults
    cfg = qwen3_config_from_hf({**BASE, "num_key_value_heads": None, "head_dim": None})
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 8              # null: derived, as HF


def test_windows_follow_use_sliding_window_and_max_window_layers():
    cfg = qwen3_config_from_hf({**BASE, "use_sliding_window": True, "sliding_window": 8,
                                "max_window_layers": 1})
    assert cfg.layer_types == ("full_attention",) + ("sliding_attention",) * 3
    assert cfg.sliding_window == 8
    # Qwen3 releases: use_sliding_window false -> every layer full, whatever the rest says
    cfg = qwen3_config_from_hf({**BASE, "use_sliding_window": False, "sliding_window": 8,
                                "max_window_layers": 1})
    assert cfg.layer_types == ("full_attention",) * 4 and cfg.sliding_window is None
    # explicit layer_types win over max_window_layers
    types = ["sliding_attention", "full_attention"] * 2
    cfg = qwen3_config_from_hf({**BASE, "use_sliding_window": True, "sliding_window": 8,
                                "max_window_layers": 0, "layer_types": types})
    assert cfg.layer_types == tuple(types)
    with pytest.raises(ConfigError, match=r"x\.json: layer_types has sliding_attention layers "
                                          r"but use_sliding_window=False"):
        qwen3_config_from_hf({**BASE, "layer_types": types, "sliding_window": 8}, "x.json")


def test_both_transformers_rope_keys():
    v4 = qwen3_config_from_hf({**BASE, "rope_theta": 5e5, "max_position_embeddings": 4096,
                               "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 1024}})
    v5 = qwen3_config_from_hf({**BASE, "max_position_embeddings": 4096,
                               "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5,
                                                   "factor": 4.0,
                                                   "original_max_position_embeddings": 1024}})
    assert v4 == v5
    assert v4.rope_theta == 5e5
    assert v4.rope_scaling == RopeScaling("yarn", 4.0, 1024)
    plain = qwen3_config_from_hf({**BASE, "rope_parameters": {"rope_type": "default",
                                                              "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
    # yarn without original_max_position_embeddings: HF falls back to max_position_embeddings
    cfg = qwen3_config_from_hf({**BASE, "max_position_embeddings": 2048,
                                "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert cfg.rope_scaling.original_max_position_embeddings == 2048


def test_rope_tables():
    plain, one = rope_frequencies(16, 10_000.0, None)
    linear, _ = rope_frequencies(16, 10_000.0, RopeScaling("linear", 4.0))
    assert one == 1.0
    assert (linear * 4 == plain).all()
    yarn, factor = rope_frequencies(16, 10_000.0, RopeScaling("yarn", 4.0, 64))
    assert factor == pytest.approx(0.1 * __import__("math").log(4.0) + 1)
    assert yarn[0] == plain[0] and yarn[-1] == pytest.approx(plain[-1] / 4)  # fast dims kept


@pytest.mark.parametrize("edit,match", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_scaling\.rope_type='dynamic' is not supported; supported: default, linear, yarn"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
     r"rope_parameters\.rope_type='llama3' is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 8}},
     r"rope_scaling keys=\['beta_fast'\] is not supported; supported: \['factor'\]"),
    ({"rope_scaling": {"rope_type": "linear"}}, r"factor=None must be a finite number"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5 is not supported"),
    ({"attention_bias": True}, r"attention_bias=True is not supported; supported: false"),
    ({"hidden_act": "gelu_pytorch_tanh"},
     r"hidden_act='gelu_pytorch_tanh' is not supported; supported: silu"),
    ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config=.* not supported"),
    ({"model_type": "qwen2"}, r"model_type='qwen2' is not supported; supported: qwen3"),
    ({"is_causal": False}, r"is_causal=False is not supported"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention",
                      "full_attention"]},
     r"layer_types=\['chunked_attention'\] is not supported"),
    ({"num_hidden_layers": "4"}, r"num_hidden_layers='4' must be an integer"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings='yes' must be true or false"),
])
def test_target_refusals_name_file_field_and_value(edit, match):
    with pytest.raises(ConfigError, match=r"^ckpt/config\.json: .*" + match):
        qwen3_config_from_hf({**BASE, **edit}, "ckpt/config.json")


def test_refusals_come_from_the_loader_with_the_file(tmp_path):
    from models.qwen3 import init_params
    import jax
    cfg = qwen3_config_from_hf(BASE)
    save_qwen3(tmp_path, cfg, init_params(cfg, jax.random.key(0)))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}))
    with pytest.raises(ConfigError, match=rf"{tmp_path}/config\.json: rope_scaling\.rope_type="
                                          r"'longrope' is not supported"):
        load_qwen3(tmp_path)


def test_dflash_config_follows_zlab():
    cfg = dflash_config_from_hf(DRAFT)
    assert cfg.mask_token_id == 63 and cfg.block_size == 4 and cfg.target_layer_ids == (1, 2)
    assert cfg.rope_theta == 10_000.0
    # block_size and mask_token_id may sit at the top level or in dflash_config; 16 by default
    top = {**DRAFT, "mask_token_id": 7, "dflash_config": {"target_layer_ids": [0, 3]}}
    del top["block_size"]
    cfg = dflash_config_from_hf(top)
    assert cfg.mask_token_id == 7 and cfg.block_size == 16
    # is_causal absent: z-lab makes sliding draft layers causal in the block
    sliding = {**DRAFT, "use_sliding_window": True, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"]}
    assert dflash_config_from_hf(sliding).causal_in_sliding_block is True
    assert dflash_config_from_hf({**sliding, "is_causal": False}).causal_in_sliding_block is False
    yarn = dflash_config_from_hf({**DRAFT, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                            "original_max_position_embeddings": 64}})
    assert yarn.rope_scaling == RopeScaling("yarn", 2.0, 64)


@pytest.mark.parametrize("edit,match", [
    ({"dflash_config": None}, r"no dflash_config \(a z-lab DFlash drafter config carries"),
    ({"dflash_config": {"target_layer_ids": [1, 2]}}, r"no mask_token_id \(looked in "
                                                      r"dflash_config\.mask_token_id"),
    ({"architectures": ["DFlash2DraftModel"]}, r"architectures=\['DFlash2DraftModel'\] is not "
                                               r"supported"),
    ({"dflash_config": {"mask_token_id": 63, "output_multiplier": 0.2}},
     r"output_multiplier=0\.2 is not supported"),
    ({"dflash_config": {"mask_token_id": 63, "selector_top_k": 16}},
     r"selector_top_k=16 is not supported"),
    ({"dflash_config": {"mask_token_id": 63, "draft_temperature": 0.5}},
     r"dflash_config keys=\['draft_temperature'\] is not supported"),
    ({"num_target_layers": None}, r"num_target_layers is missing"),
    ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": [1, 9]}},
     r"target_layer_ids \[9\] outside the target's 4 layers"),
    ({"is_causal": True, "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention"]}, r"is_causal=True is not supported"),
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type='dynamic'"),
])
def test_dflash_refusals_name_file_field_and_value(edit, match):
    with pytest.raises(ConfigError, match=r"^draft/config\.json: .*" + match):
        dflash_config_from_hf({**DRAFT, **edit}, "draft/config.json")


def test_dflash_extra_tensor_is_refused_and_named(tmp_path):
    import jax
    from drafter.dflash import init_params
    cfg = dflash_config_from_hf(DRAFT)
    save_dflash(tmp_path, cfg, init_params(cfg, jax.random.key(0)))
    (tmp_path / "manifest.json").unlink()
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["embed_tokens.weight"] = tensors["norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(Exception, match=r"model\.safetensors: 1 tensors the model does not use: "
                                        r"\['embed_tokens\.weight'\]"):
        load_dflash(tmp_path)


def test_to_hf_round_trips():
    for hf in ({**BASE, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 128, "mscale": 0.7,
                                 "mscale_all_dim": 1.0}},
               {**BASE, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}):
        cfg = qwen3_config_from_hf(hf)
        assert qwen3_config_from_hf(cfg.to_hf()) == cfg
    draft = dflash_config_from_hf({**DRAFT, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert dflash_config_from_hf(draft.to_hf()) == draft
