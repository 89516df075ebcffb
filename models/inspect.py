"""What the loader understood from a checkpoint, before serving it.

    python -m models.inspect DIR [--kv-dtype fp8_e4m3]     # an HF Qwen3 target
    python -m drafter.inspect DIR                          # a DFlash drafter, or a pair

Prints the layers and their windows, RoPE (theta, scaling, YaRN's attention
factor), tied or untied head, the KV pools the layers make (layers with the
same pool key share a pool) with their bytes per token, and the weights' files,
dtype, manifest and fingerprint. Reads configs and file headers only: no
weights are loaded unless `--verify` asks for a full load (manifest hashes,
NaN / inf, unused tensors).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

from models.config import CheckpointError, load_qwen3_config, read_config
from models.rope import rope_frequencies
from unified_kv import LayerSpec
from unified_kv.spec import KV_DTYPES


def describe_layers(layer_types, window) -> str:
    """'0-1 sliding 256, 2 full, ...': runs of equal layers."""
    runs, start = [], 0
    for i in range(1, len(layer_types) + 1):
        if i == len(layer_types) or layer_types[i] != layer_types[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            kind = f"sliding {window}" if layer_types[start] == "sliding_attention" else "full"
            runs.append(f"{span} {kind}")
            start = i
    return ", ".join(runs)


def describe_rope(cfg, hf: dict) -> str:
    max_pos = hf.get("max_position_embeddings", 32768)
    s = cfg.rope_scaling
    if s is None:
        return f"theta {cfg.rope_theta:g}, no scaling; max_position_embeddings {max_pos}"
    _, factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, s)
    text = f"theta {cfg.rope_theta:g}, {s.rope_type} x{s.factor:g}"
    if s.rope_type == "yarn":
        text += (f" from {s.original_max_position_embeddings} positions (beta_fast "
                 f"{s.beta_fast:g}, beta_slow {s.beta_slow:g}), attention factor {factor:.6f} "
                 f"on q and k")
    return text + f"; max_position_embeddings {max_pos}"


def describe_pools(layers: list[LayerSpec], page_size: int = 16) -> list[str]:
    """One line per pool (layers with one pool key), with bytes per token, and the total."""
    pools: dict[tuple, list[LayerSpec]] = {}
    for layer in layers:
        pools.setdefault(layer.pool_key, []).append(layer)
    lines, total = [], 0
    for i, (pool_key, members) in enumerate(pools.items()):
        window, kv_dtype, heads, head_dim = pool_key
        per_token = len(members) * 2 * heads * head_dim * np.dtype(KV_DTYPES[kv_dtype]).itemsize
        total += per_token
        names = [m.name for m in members]
        live = (f"at most {window} + {page_size} tokens live per row" if window
                else "every token stays")
        lines.append(f"pool {i}: {kv_dtype}, {heads} kv heads x {head_dim}, "
                     f"{'window ' + str(window) if window else 'full'}: {len(names)} layers "
                     f"({', '.join(names)}): {per_token} B/token ({live})")
    lines.append(f"all pools: {total} B/token before windows")
    return lines


def safetensors_summary(path: Path) -> str | None:
    """'N tensors in F files, dtype' from the headers only."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    count, dtypes = 0, set()
    for f in files:
        with open(f, "rb") as fh:
            try:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{f}: unreadable safetensors header ({e})") from None
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        count += len(entries)
        dtypes |= {v["dtype"] for v in entries.values()}
    return f"safetensors, {count} tensors in {len(files)} file(s), {'/'.join(sorted(dtypes))}"


def describe_weights(path: Path) -> list[str]:
    lines = []
    st = safetensors_summary(path)
    if st:
        lines.append(f"weights: {st}")
    elif (path / "params").is_dir():
        lines.append("weights: orbax (params/)")
    else:
        lines.append("weights: none found")
    manifest = path / "manifest.json"
    if manifest.exists():
        m = read_config(manifest)
        dtypes = sorted({a.get("dtype") for a in m.get("arrays", {}).values()})
        lines.append(f"manifest: {len(m.get('arrays', {}))} arrays ({'/'.join(dtypes)}), "
                     f"fingerprint {m.get('fingerprint')}")
    else:
        lines.append("manifest: none (hashes are not checked; NaN / inf, keys and shapes are)")
    return lines


def target_report(path: Path, kv_dtype: str = "bf16") -> tuple[list[str], list[LayerSpec]]:
    cfg = load_qwen3_config(path)
    hf = read_config(path)
    lines = [f"target {path}",
             f"  Qwen3: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} q / "
             f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}, ffn {cfg.intermediate_size}, "
             f"vocab {cfg.vocab_size}, rms eps {cfg.rms_norm_eps:g}",
             f"  lm_head: {'tied to the embedding' if cfg.tie_word_embeddings else 'its own'}",
             f"  RoPE: {describe_rope(cfg, hf)}",
             f"  layers: {describe_layers(cfg.layer_types, cfg.sliding_window)}"]
    lines += ["  " + line for line in describe_weights(path)]
    return lines, cfg.layer_specs(kv_dtype)


def verify(path: Path, cfg, load_safetensors, init_params) -> str:
    """Load the weights (safetensors or orbax) with every check the loaders make."""
    if (path / "params").is_dir() and not list(path.glob("*.safetensors")):
        import jax
        import jax.numpy as jnp
        from models.checkpoint import fingerprint, read_manifest
        from models.orbax_params import restore_orbax
        manifest = read_manifest(path) or {"arrays": {}}
        dtypes = {a["dtype"] for a in manifest["arrays"].values()} or {"float32"}
        dtype = jnp.dtype(dtypes.pop()) if len(dtypes) == 1 else jnp.float32
        template = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype))
        _, params = restore_orbax(path, template)
    else:
        from models.checkpoint import fingerprint
        _, params = load_safetensors(path)
    return (f"  verify: loaded and checked (manifest, NaN / inf, keys, shapes, unused "
            f"tensors); fingerprint {fingerprint(params)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="an HF Qwen3 checkpoint directory")
    ap.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPES))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--verify", action="store_true", help="load the weights and check them")
    args = ap.parse_args(argv)
    try:
        hf = read_config(args.dir)
        if "dflash_config" in hf or "DFlashDraftModel" in (hf.get("architectures") or []):
            print(f"{args.dir} is a DFlash drafter: python -m drafter.inspect {args.dir}",
                  file=sys.stderr)
            return 2
        lines, layers = target_report(args.dir, args.kv_dtype)
        lines += ["KV cache, page " + str(args.page_size) + ":"]
        lines += ["  " + line for line in describe_pools(layers, args.page_size)]
        if args.verify:
            from models.checkpoint import load_qwen3
            from models.qwen3 import init_params
            lines.append(verify(args.dir, load_qwen3_config(args.dir), load_qwen3, init_params))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
