"""`python -m models.inspect` / `python -m drafter.inspect`: the config report."""

import json

import jax

from drafter import inspect as pair_inspect
from drafter.default import PAIR_DIR
from models import inspect as target_inspect
from models.checkpoint import save_qwen3
from models.config import qwen3_config_from_hf
from models.qwen3 import init_params

HF = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 16, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2,
      "max_position_embeddings": 4096,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}


def test_target_report(tmp_path, capsys):
    cfg = qwen3_config_from_hf(HF)
    save_qwen3(tmp_path, cfg, init_params(cfg, jax.random.key(0)))
    (tmp_path / "config.json").write_text(json.dumps(HF))
    assert target_inspect.main([str(tmp_path), "--kv-dtype", "fp8_e4m3", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "lm_head: its own" in out
    assert "layers: 0-1 full, 2-3 sliding 64" in out
    assert "yarn x4 from 1024 positions" in out and "attention factor 1.138629" in out
    assert "pool 0: fp8_e4m3, 2 kv heads x 16, full: 2 layers (target.0, target.1): 128 B/token" in out
    assert "pool 1: fp8_e4m3, 2 kv heads x 16, window 64: 2 layers" in out
    assert "manifest: 47 arrays (float32), fingerprint" in out and "verify: loaded" in out


def test_bad_config_is_one_line_naming_the_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**HF, "hidden_act": "gelu"}))
    assert target_inspect.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (f"error: {tmp_path}/config.json: hidden_act='gelu' is not supported; "
                           f"supported: silu")


def test_pair_report(capsys):
    assert pair_inspect.main([str(PAIR_DIR), "--target-kv-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "reads from the target: the residual stream after layers [1, 4] (of 6)" in out
    assert "mask token 258" in out and "lm_head: tied to the embedding" in out
    assert "pair: fits" in out
    assert "pool 2: bf16, 2 kv heads x 32, window 256: 2 layers (draft.0, draft.1)" in out
