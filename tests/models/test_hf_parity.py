"""Tiny random Qwen3 checkpoints against HF transformers on CPU: logits and greedy tokens.

Needs the `hf` extra (`pip install -e ".[hf]"`: transformers and torch); skipped
without it. Each variant's config.json is written as users have them
(transformers 4 `rope_scaling` / transformers 5 `rope_parameters`, windows from
`max_window_layers`, tied or not); transformers loads the same directory.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from drafter.checkpoint import dflash_config_from_hf  # noqa: E402
from drafter.dflash import context_kv, init_params as init_draft  # noqa: E402
from models.checkpoint import load_qwen3, qwen3_key_map, tensors_from_params  # noqa: E402
from models.config import qwen3_config_from_hf  # noqa: E402
from models.qwen3 import dense_forward, forward, init_params  # noqa: E402
from pallas_kernels.batch_tables import build_batch_tables_reference  # noqa: E402
from unified_kv import CacheSpec, grow, init_state, retire_window_pages  # noqa: E402

TF5 = int(transformers.__version__.split(".")[0]) >= 5

BASE = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 96,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {  # name: config keys over BASE (absent keys take HF's defaults)
    "defaults_untied": {},
    "tied": {"tie_word_embeddings": True, "rope_theta": 1e6},
    "linear": {"rope_theta": 1e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "yarn": {"rope_theta": 1e4, "rope_scaling": YARN},
    "yarn_legacy_type_key": {"rope_scaling": {"type": "yarn", "factor": 2.0,
                                              "original_max_position_embeddings": 32,
                                              "beta_fast": 16}},
    "sliding_from_max_window_layers": {"use_sliding_window": True, "sliding_window": 8,
                                       "max_window_layers": 1},
    "transformers5_yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e4,
                                               "factor": 4.0,
                                               "original_max_position_embeddings": 64}},
    "transformers5_linear_sliding": {"rope_parameters": {"rope_type": "linear",
                                                         "rope_theta": 2e4, "factor": 3.0},
                                     "use_sliding_window": True, "sliding_window": 8,
                                     "max_window_layers": 2, "tie_word_embeddings": True},
}
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 96, 40)]
NEW_TOKENS = 8


def write_checkpoint(path, hf_config: dict, seed=0):
    """config.json as given, and random weights under HF key names (no manifest, as HF's)."""
    cfg = qwen3_config_from_hf(hf_config)
    params = init_params(cfg, jax.random.key(seed))
    save_file(tensors_from_params(params, qwen3_key_map(cfg)), path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(hf_config))


def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def paged_greedy(params, cfg, prompt, num_new):
    """Prefill, then one token per call through the paged cache (the serving path)."""
    spec = CacheSpec(8, tuple(cfg.layer_specs("f32")), 2, 128, 1 << 24, len(prompt))
    state, slot = init_state(spec), jnp.array([0], jnp.int32)
    scales = tuple(p.page_index_scale for p in spec.pools)
    tokens, start, chunk = list(prompt), 0, list(prompt)
    for _ in range(num_new):
        state, ok = grow(spec, state, slot, jnp.array([start + len(chunk)]), jnp.array([0]))
        assert bool(ok[0])
        tables = build_batch_tables_reference(slot, state.page_tables, table_width=16,
                                              scales=scales)
        logits, pools, _ = forward(params, cfg, spec, state.pools, tables,
                                   jnp.asarray(chunk, jnp.int32)[None], jnp.array([start]),
                                   jnp.array([len(chunk)]), impl="reference")
        state = retire_window_pages(spec, state.replace(pools=pools), slot)
        start += len(chunk)
        chunk = [int(jnp.argmax(logits[0, -1]))]
        tokens += chunk
    return tokens[len(prompt):]


@pytest.mark.parametrize("name", VARIANTS)
def test_tiny_checkpoint_matches_transformers(tmp_path, name):
    if name.startswith("transformers5") and not TF5:
        pytest.skip("transformers < 5 does not read rope_parameters")
    hf_config = {**BASE, **VARIANTS[name]}
    write_checkpoint(tmp_path, hf_config)
    cfg, params = load_qwen3(tmp_path)
    model = hf_model(tmp_path)
    # what the loader understood, against HF's own reading of the file
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    assert cfg.layer_types == tuple(model.config.layer_types)
    rotary = model.model.rotary_emb
    assert cfg.rope_theta == pytest.approx(
        model.config.rope_parameters["rope_theta"] if TF5 else model.config.rope_theta)
    from models.rope import rope_frequencies
    inv_freq, attention_factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    assert attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)

    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0].numpy()
    got_dense = np.asarray(dense_forward(params, cfg, jnp.asarray([PROMPT]))[0][0])
    np.testing.assert_allclose(got_dense, want, rtol=2e-4, atol=2e-4)

    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
    want_tokens = out[0, len(PROMPT):].tolist()
    assert paged_greedy(params, cfg, PROMPT, NEW_TOKENS) == want_tokens


def test_checkpoint_saved_by_transformers_loads(tmp_path):
    """save_pretrained writes the installed version's own keys (rope_parameters in 5)."""
    config = transformers.Qwen3Config(**{k: v for k, v in BASE.items()
                                         if k not in ("model_type", "architectures")},
                                      rope_scaling=dict(YARN), use_sliding_window=True,
                                      sliding_window=8, max_window_layers=2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path)
    cfg, params = load_qwen3(tmp_path)
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.layer_types[2] == "sliding_attention"
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0].numpy()
    got = np.asarray(dense_forward(params, cfg, jnp.asarray([PROMPT]))[0][0])
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("rope", [{"rope_scaling": YARN},
                                  {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}])
def test_drafter_rope_scaling_matches_zlab(rope):
    """z-lab's DFlashDraftModel: Qwen3RotaryEmbedding(drafter config) rotates its context K."""
    from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3
    hf = {**{k: v for k, v in BASE.items() if k != "architectures"}, "num_hidden_layers": 2,
          "architectures": ["DFlashDraftModel"], "num_target_layers": 3, "block_size": 4,
          "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2]}, **rope}
    cfg = dflash_config_from_hf(hf)
    params = init_draft(cfg, jax.random.key(3))
    t = 50
    features = jax.random.normal(jax.random.key(4), (1, t, 2 * cfg.hidden_size))
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    got = context_kv(params, cfg, features, positions)

    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in hf.items()
                                         if k not in ("model_type", "architectures")})
    rotary = hf_qwen3.Qwen3RotaryEmbedding(hf_cfg)
    f = torch.tensor(np.asarray(features))
    p = jax.tree.map(lambda a: torch.tensor(np.asarray(a)), params)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    c = rms(f @ p["fc"], p["hidden_norm"])                             # z-lab: hidden_norm(fc(.))
    cos, sin = rotary(c, torch.arange(t)[None])
    for (k_got, v_got), lp in zip(got, p["layers"]):
        k = rms((c @ lp["k"]).view(1, t, -1, cfg.head_dim), lp["k_norm"]).transpose(1, 2)
        k = k * cos[:, None] + hf_qwen3.rotate_half(k) * sin[:, None]   # z-lab's k_embed
        np.testing.assert_allclose(np.asarray(k_got), k.transpose(1, 2).numpy(),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(v_got),
                                   (c @ lp["v"]).view(1, t, -1, cfg.head_dim).numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_drafter_block_with_yarn_matches_zlab_forward():
    """The whole draft block (dense, as trained) against z-lab's DFlashDraftModel forward,
    written here in torch from HF's Qwen3 modules, under YaRN: q and k rotated and scaled."""
    from drafter.train import block_logits
    from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3
    target_cfg = qwen3_config_from_hf(BASE)
    target = init_params(target_cfg, jax.random.key(5))
    hf = {**{k: v for k, v in BASE.items() if k != "architectures"}, "num_hidden_layers": 2,
          "architectures": ["DFlashDraftModel"], "num_target_layers": 3, "block_size": 4,
          "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2]},
          "rope_scaling": YARN}
    cfg = dflash_config_from_hf(hf)
    draft = init_draft(cfg, jax.random.key(6))
    t, anchor, block = 30, 21, cfg.block_size
    tokens = jnp.asarray([PROMPT[:t]], jnp.int32)
    features = jax.random.normal(jax.random.key(7), (1, t, 2 * cfg.hidden_size))
    got = block_logits(draft, cfg, target, target_cfg, tokens, features, jnp.array([[anchor]]))

    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in hf.items()
                                         if k not in ("model_type", "architectures")})
    p = jax.tree.map(lambda a: torch.tensor(np.asarray(a)), draft)
    embed = torch.tensor(np.asarray(target["embed"]))
    head = torch.tensor(np.asarray(target["lm_head"]))
    eps, hd = cfg.rms_norm_eps, cfg.head_dim

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    ids = torch.tensor([[PROMPT[anchor]] + [95] * (block - 1)])
    x = embed[ids]                                                     # noise_embedding
    c = rms(torch.tensor(np.asarray(features))[:, :anchor] @ p["fc"], p["hidden_norm"])
    cos, sin = hf_qwen3.Qwen3RotaryEmbedding(hf_cfg)(x, torch.arange(anchor + block)[None])
    cos, sin = cos[:, None], sin[:, None]
    for lp in p["layers"]:
        h = rms(x, lp["input_norm"])
        q = rms((h @ lp["q"]).view(1, block, -1, hd), lp["q_norm"]).transpose(1, 2)
        kv_in = torch.cat([c, h], dim=1)                               # context, then block
        k = rms((kv_in @ lp["k"]).view(1, anchor + block, -1, hd), lp["k_norm"]).transpose(1, 2)
        v = (kv_in @ lp["v"]).view(1, anchor + block, -1, hd).transpose(1, 2)
        q = q * cos[..., -block:, :] + hf_qwen3.rotate_half(q) * sin[..., -block:, :]
        k = k * cos + hf_qwen3.rotate_half(k) * sin
        group = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        w = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5, dim=-1)  # non-causal block
        x = x + (w @ v).transpose(1, 2).reshape(1, block, -1) @ lp["o"]
        h = rms(x, lp["post_norm"])
        x = x + (torch.nn.functional.silu(h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"]
    want = (rms(x, p["norm"]) @ head)[:, 1:]
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-4, atol=2e-4)
