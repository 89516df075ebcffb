"""The embedded default pair: a byte-level Qwen3 code model and its DFlash drafter.

Trained on a GPU by `python -m drafter.make_default` (see README, "The
embedded default") and shipped as orbax checkpoints in drafter/default_pair/.
`load_default()` is what the demo, the evaluation and the notebooks use.
"""

from __future__ import annotations

import base64
import json
import shutil
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from drafter.checkpoint import load_dflash, load_dflash_config
from drafter.dflash import DFlashConfig, init_params as init_draft
from drafter.steps import StepConfig
from models.checkpoint import load_qwen3
from models.orbax_params import restore_orbax, save_orbax
from models.config import load_qwen3_config
from models.qwen3 import Qwen3Config, init_params as init_target
from unified_kv import CacheSpec

PAIR_DIR = Path(__file__).parent / "default_pair"
PROMPTS_FILE = Path(__file__).parent / "data" / "eval_prompts.json"
ACCEPTANCE_PROMPTS_FILE = Path(__file__).parent / "data" / "acceptance_prompts.json"


def import_pair(target_dir, draft_dir, out_dir=PAIR_DIR) -> None:
    """Turn make_default's safetensors checkpoints into the shipped orbax ones (bf16)."""
    tcfg, target = load_qwen3(target_dir, jnp.bfloat16)
    save_orbax(Path(out_dir) / "target", target, tcfg.to_hf())
    import_draft(draft_dir, out_dir)


def import_draft(draft_dir, out_dir=PAIR_DIR) -> None:
    """Replace the shipped drafter (e.g. by one `make_default --from-default` trained on)."""
    dcfg, draft = load_dflash(draft_dir, jnp.bfloat16)
    target = Path(out_dir) / "draft"
    if target.exists():
        shutil.rmtree(target)
    save_orbax(target, draft, dcfg.to_hf())


def load_default(dtype=jnp.float32):
    """(params {"target", "draft"}, Qwen3Config, DFlashConfig) of the shipped pair.

    The orbax checkpoints are checked against their manifests (models/checkpoint.py);
    `fingerprint(params["target"])` / `fingerprint(params["draft"])` identify them.
    """
    tcfg = load_qwen3_config(PAIR_DIR / "target")
    dcfg = load_dflash_config(PAIR_DIR / "draft")
    params = {}
    for name, init, cfg in (("target", init_target, tcfg), ("draft", init_draft, dcfg)):
        template = jax.eval_shape(lambda: init(cfg, jax.random.key(0), jnp.bfloat16))
        _, tree = restore_orbax(PAIR_DIR / name, template)
        params[name] = jax.tree.map(lambda a: a.astype(dtype), tree)
    return params, tcfg, dcfg


def default_step_config(tcfg: Qwen3Config, dcfg: DFlashConfig | None, *, num_slots: int = 16,
                        max_seq_len: int = 9216, impl: str = "auto",
                        memory_budget_bytes: int = 1 << 30,
                        layer_loop: str = "auto", graph_loops: bool = False,
                        graph_copies: int = 1, target_kv_dtype: str = "fp8_e4m3") -> StepConfig:
    """The default cache: fp8 target KV (window and full pools), bf16 draft KV."""
    layers = tcfg.layer_specs(target_kv_dtype)
    if dcfg is not None:
        layers += dcfg.layer_specs("bf16")
    spec = CacheSpec(page_size=16, layers=tuple(layers), num_slots=num_slots,
                     max_seq_len=max_seq_len, memory_budget_bytes=memory_budget_bytes,
                     max_step_tokens=256)
    return StepConfig(tcfg, spec, dcfg, impl, layer_loop=layer_loop, graph_loops=graph_loops,
                      graph_copies=graph_copies)


def load_prompts() -> list[dict]:
    """The shipped held-out prompt set: [{"length", "tokens"}, ...]."""
    return json.loads(PROMPTS_FILE.read_text())["prompts"]


def load_acceptance_prompts() -> list[dict]:
    """The held-out set acceptance is measured on (16 a length, the shipped prompts
    first; drafter.make_prompts): [{"length", "tokens"}, ...]."""
    stored = json.loads(ACCEPTANCE_PROMPTS_FILE.read_text())["prompts"]
    return [{"length": p["length"], "tokens": decode_tokens(p["tokens"])} for p in stored]


def decode_tokens(stored: str) -> list[int]:
    """Token ids stored as base64 of zlib of little-endian uint16 (compact for files)."""
    return np.frombuffer(zlib.decompress(base64.b64decode(stored)), "<u2").tolist()
