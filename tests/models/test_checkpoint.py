"""Checkpoint round trips under the HF Qwen3 and DFlash key maps, and orbax."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from drafter.checkpoint import load_dflash, save_dflash
from drafter.engine import Engine
from models.checkpoint import CheckpointError, load_qwen3, save_qwen3
from models.orbax_params import restore_orbax, save_orbax
from tests.drafter.tiny import tiny_pair


def same_tree(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("num_shards", [1, 3])
def test_hf_and_dflash_round_trip_give_the_same_outputs(tmp_path, num_shards):
    params, speculative_cfg, _ = tiny_pair(num_slots=2)
    save_qwen3(tmp_path / "target", speculative_cfg.target, params["target"],
               num_shards=num_shards)
    save_dflash(tmp_path / "draft", speculative_cfg.draft, params["draft"])
    tcfg, target = load_qwen3(tmp_path / "target")
    dcfg, draft = load_dflash(tmp_path / "draft")
    assert tcfg == speculative_cfg.target and dcfg == speculative_cfg.draft
    same_tree(target, params["target"])
    same_tree(draft, params["draft"])
    # tests/drafter/test_engine.py's warmup test serves these prompts on this pair: the
    # steps come from the compilation cache.
    prompts = [[1, 2, 3, 4, 5], list(range(1, 30))]
    want = Engine(params, speculative_cfg).generate(prompts, 10)
    got = Engine({"target": target, "draft": draft}, speculative_cfg).generate(prompts, 10)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.acceptance for r in got] == [r.acceptance for r in want]


def test_dflash_config_and_tensor_keys_follow_z_labs_names(tmp_path):
    params, speculative_cfg, _ = tiny_pair(num_slots=2)
    save_dflash(tmp_path, speculative_cfg.draft, params["draft"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["block_size"] == 4 and config["num_target_layers"] == 4
    assert config["dflash_config"]["mask_token_id"] == 63
    assert (config["dflash_config"]["target_layer_ids"]
            == list(speculative_cfg.draft.target_layer_ids))
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"} <= keys


def test_missing_key_and_wrong_shape_name_the_key(tmp_path):
    params, speculative_cfg, _ = tiny_pair(num_slots=2)
    save_qwen3(tmp_path, speculative_cfg.target, params["target"])
    (tmp_path / "manifest.json").unlink()  # as HF checkpoints come: the key map alone checks
    tensors = load_file(tmp_path / "model.safetensors")
    bad = dict(tensors)
    del bad["model.layers.2.mlp.up_proj.weight"]
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 'model.layers.2.mlp.up_proj.weight'"):
        load_qwen3(tmp_path)
    bad = dict(tensors)
    bad["model.layers.1.self_attn.k_norm.weight"] = np.ones(7, np.float32)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.k_norm.weight' has "
                                              r"shape \(7,\), expected \(16,\)"):
        load_qwen3(tmp_path)


def test_orbax_round_trip(tmp_path):
    params, speculative_cfg, _ = tiny_pair(num_slots=2)
    save_orbax(tmp_path / "ckpt", params, {"target": speculative_cfg.target.to_hf(),
                                           "draft": speculative_cfg.draft.to_hf()})
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    config, restored = restore_orbax(tmp_path / "ckpt", template)
    assert config["draft"]["block_size"] == 4
    same_tree(restored, params)
