"""Damaged checkpoints are refused, naming the file and the array; fingerprints identify weights."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from drafter.checkpoint import load_dflash, save_dflash
from models.checkpoint import CheckpointError, fingerprint, load_qwen3, read_manifest, save_qwen3
from models.orbax_params import restore_orbax, save_orbax
from models.qwen3 import Qwen3Config, init_params


def tiny_target(tied=False):
    return Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=8, rope_theta=10_000.0,
                       tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def target():
    cfg = tiny_target()
    return cfg, init_params(cfg, jax.random.key(0))


def template_of(params):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)


def flip_bytes(file: Path, count=64):
    data = bytearray(file.read_bytes())
    start = len(data) // 2
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def data_files(root: Path) -> list[Path]:
    """orbax's array data files (ocdbt `d/` folders); which holds which array varies by run."""
    files = [p for p in root.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no orbax data files under {root}"
    return files


# ---------------------------------------------------------------- safetensors

def test_safetensors_with_flipped_bytes_names_file_and_array(tmp_path, target):
    cfg, params = target
    save_qwen3(tmp_path, cfg, params)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    # flip bytes inside one tensor's data (the header stays valid)
    data = bytearray(file.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:header])
    begin, end = meta["model.layers.1.mlp.up_proj.weight"]["data_offsets"]
    for i in range(header + begin + 8, header + begin + 72):
        data[i] ^= 0x5A
    file.write_bytes(bytes(data))
    assert not np.array_equal(load_file(file)["model.layers.1.mlp.up_proj.weight"],
                              tensors["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: array "
                                              r"'model\.layers\.1\.mlp\.up_proj\.weight' does not "
                                              r"match its sha256"):
        load_qwen3(tmp_path)


def test_truncated_safetensors_names_the_file(tmp_path, target):
    cfg, params = target
    save_qwen3(tmp_path, cfg, params, num_shards=2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: cannot read "
                                              r"it as safetensors"):
        load_qwen3(tmp_path)


def test_safetensors_missing_array_is_named(tmp_path, target):
    cfg, params = target
    save_qwen3(tmp_path, cfg, params)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.0.self_attn.k_norm.weight"]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: 1 arrays listed in manifest\.json "
                                              r"are missing: \['model\.layers\.0\.self_attn"
                                              r"\.k_norm\.weight'\]"):
        load_qwen3(tmp_path)


def test_nan_weights_are_refused_without_a_manifest(tmp_path, target):
    cfg, params = target
    save_qwen3(tmp_path, cfg, params)
    (tmp_path / "manifest.json").unlink()          # an HF checkpoint has none
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].copy()
    tensors["model.norm.weight"][3] = np.inf
    tensors["model.norm.weight"][5] = np.nan
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: array 'model\.norm\.weight' "
                                              r"has 2 NaN / inf values"):
        load_qwen3(tmp_path)


def test_extra_tensors_are_refused_and_listed(tmp_path, target):
    cfg, params = target
    save_qwen3(tmp_path, cfg, params)
    (tmp_path / "manifest.json").unlink()
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(16, np.float32)
    tensors["model.layers.1.self_attn.q_proj.bias"] = np.zeros(16, np.float32)
    save_file(tensors, file)
    with pytest.raises(CheckpointError,
                       match=r"model\.safetensors: 2 tensors the model does not use: "
                             r"\['model\.layers\.0\.self_attn\.q_proj\.bias', "
                             r"'model\.layers\.1\.self_attn\.q_proj\.bias'\].*attention_bias"):
        load_qwen3(tmp_path)


def test_tied_checkpoint_may_carry_an_equal_head_only(tmp_path):
    cfg = tiny_target(tied=True)
    params = init_params(cfg, jax.random.key(1))
    save_qwen3(tmp_path, cfg, params)
    (tmp_path / "manifest.json").unlink()
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, file)
    loaded_cfg, _ = load_qwen3(tmp_path)                        # a redundant tied head is fine
    assert loaded_cfg.tie_word_embeddings
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, file)
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' differs from "
                                              r"'model\.embed_tokens\.weight' but "
                                              r"tie_word_embeddings is true"):
        load_qwen3(tmp_path)


def test_bad_config_json_names_the_file(tmp_path, target):
    cfg, params = target
    save_qwen3(tmp_path, cfg, params)
    (tmp_path / "config.json").write_text('{"vocab_size": 40,')
    with pytest.raises(CheckpointError, match=rf"{tmp_path}/config\.json: not valid JSON"):
        load_qwen3(tmp_path)


def test_dflash_checkpoint_is_checked_the_same_way(tmp_path):
    from tests.drafter.tiny import tiny_pair
    params, speculative_cfg, _ = tiny_pair(num_slots=2)
    save_dflash(tmp_path, speculative_cfg.draft, params["draft"])
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["fc.weight"] = tensors["fc.weight"] * 1.5
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: array 'fc\.weight' does not "
                                              r"match its sha256"):
        load_dflash(tmp_path)


# ---------------------------------------------------------------- orbax

def test_orbax_round_trip_checks_its_manifest(tmp_path, target):
    cfg, params = target
    save_orbax(tmp_path, params, cfg.to_hf())
    manifest = read_manifest(tmp_path)
    assert manifest["fingerprint"] == fingerprint(params)
    assert set(manifest["arrays"]) >= {"embed", "layers.0.q", "layers.1.down", "lm_head"}
    _, restored = restore_orbax(tmp_path, template_of(params))
    assert fingerprint(restored) == fingerprint(params)


def test_orbax_with_flipped_bytes_is_refused(tmp_path, target):
    cfg, params = target
    save_orbax(tmp_path, params, cfg.to_hf())
    for file in data_files(tmp_path / "params"):
        flip_bytes(file)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}(/params)?: .*damaged"):
        restore_orbax(tmp_path, template_of(params))


def test_truncated_orbax_is_refused_in_one_line(tmp_path, target):
    cfg, params = target
    save_orbax(tmp_path, params, cfg.to_hf())
    for data in data_files(tmp_path / "params"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    with pytest.raises(CheckpointError, match=rf"{tmp_path}(/params)?: .*") as err:
        restore_orbax(tmp_path, template_of(params))
    assert len(str(err.value)) < 600


def test_orbax_missing_array_is_refused(tmp_path, target):
    import orbax.checkpoint as ocp
    cfg, params = target
    save_orbax(tmp_path, params, cfg.to_hf())
    partial = {k: v for k, v in params.items() if k != "lm_head"}
    with ocp.StandardCheckpointer() as ckpt:           # rewrite the arrays without lm_head
        ckpt.save(tmp_path / "params", partial, force=True)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}/params: orbax cannot restore it"):
        restore_orbax(tmp_path, template_of(params))
    # and a template that disagrees with the manifest is named before orbax runs
    with pytest.raises(CheckpointError, match=r"arrays in manifest\.json and the model differ: "
                                              r"\['lm_head'\]"):
        restore_orbax(tmp_path, template_of(partial))


def test_orbax_nan_is_refused_naming_the_array(tmp_path, target):
    cfg, params = target
    bad = jax.tree.map(lambda a: a, params)
    bad["layers"][1]["k_norm"] = bad["layers"][1]["k_norm"].at[0].set(jnp.nan)
    save_orbax(tmp_path, bad, cfg.to_hf())
    with pytest.raises(CheckpointError, match=r"params: array 'layers\.1\.k_norm' has 1 NaN"):
        restore_orbax(tmp_path, template_of(params))


def test_orbax_without_manifest_is_refused(tmp_path, target):
    cfg, params = target
    save_orbax(tmp_path, params, cfg.to_hf())
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: no manifest\.json"):
        restore_orbax(tmp_path, template_of(params))


# ---------------------------------------------------------------- fingerprints

def test_fingerprint_follows_the_values_not_the_storage_dtype(target):
    _, params = target
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    as_f32 = jax.tree.map(lambda a: a.astype(jnp.float32), bf16)
    assert fingerprint(bf16) == fingerprint(as_f32)
    assert fingerprint(bf16) != fingerprint(params)            # bf16 rounding changed values
    changed = jax.tree.map(lambda a: a, params)
    changed["layers"][0]["q"] = changed["layers"][0]["q"].at[3, 2].add(1e-3)
    assert fingerprint(changed) != fingerprint(params)
    swapped = dict(params, layers=params["layers"][::-1])      # same arrays, other places
    assert fingerprint(swapped) != fingerprint(params)
    assert len(fingerprint(params)) == 32


def test_shipped_pair_has_manifests_and_fingerprints():
    from drafter.default import PAIR_DIR, load_default
    params, _, _ = load_default()
    for name in ("target", "draft"):
        assert read_manifest(PAIR_DIR / name)["fingerprint"] == fingerprint(params[name])
