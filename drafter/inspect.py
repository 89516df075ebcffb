"""What the loader understood from a DFlash drafter, a target, or a pair directory.

    python -m drafter.inspect DIR [--target-kv-dtype fp8_e4m3] [--verify]

DIR is a drafter checkpoint, a target checkpoint (as `python -m models.inspect`),
or a pair: a directory with `target/` and `draft/` (drafter/default_pair/).
For a drafter it adds what the drafter reads from the target (feature layers,
embedding, lm_head, mask token) and, for a pair, whether the two fit together
and the unified cache's pools over both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from drafter.checkpoint import load_dflash, load_dflash_config
from drafter.dflash import init_params as init_draft
from models import inspect as target_inspect
from models.config import CheckpointError, read_config
from unified_kv.spec import KV_DTYPES


def is_drafter(path: Path) -> bool:
    hf = read_config(path)
    return "dflash_config" in hf or "DFlashDraftModel" in (hf.get("architectures") or [])


def draft_report(path: Path, kv_dtype: str = "bf16"):
    cfg = load_dflash_config(path)
    hf = read_config(path)
    block = ("causal for sliding layers, bidirectional for full layers"
             if cfg.causal_in_sliding_block else "bidirectional")
    lines = [f"draft {path}",
             f"  DFlash: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} q / "
             f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}, ffn {cfg.intermediate_size}; block "
             f"{cfg.block_size} (anchor + {cfg.block_size - 1} drafts), attention in block: "
             f"{block}",
             f"  reads from the target: the residual stream after layers "
             f"{list(cfg.target_layer_ids)} (of {cfg.num_target_layers}), fused by fc "
             f"({len(cfg.target_layer_ids)} x {cfg.hidden_size} -> {cfg.hidden_size}); the "
             f"embedding (block input, mask token {cfg.mask_token_id}); the lm_head (drafts)",
             f"  RoPE: {target_inspect.describe_rope(cfg, hf)}",
             f"  layers: {target_inspect.describe_layers(cfg.layer_types, cfg.sliding_window)}"]
    lines += ["  " + line for line in target_inspect.describe_weights(path)]
    return lines, cfg, cfg.layer_specs(kv_dtype)


def pair_checks(tcfg, dcfg) -> list[str]:
    """Mismatches that would make the pair unservable (empty when it fits)."""
    problems = []
    if dcfg.num_target_layers != tcfg.num_layers:
        problems.append(f"drafter num_target_layers={dcfg.num_target_layers}, target has "
                        f"{tcfg.num_layers} layers")
    if dcfg.hidden_size != tcfg.hidden_size:
        problems.append(f"drafter hidden_size={dcfg.hidden_size}, target {tcfg.hidden_size}")
    if any(not 0 <= i < tcfg.num_layers for i in dcfg.target_layer_ids):
        problems.append(f"drafter target_layer_ids={list(dcfg.target_layer_ids)} reach past "
                        f"the target's {tcfg.num_layers} layers")
    if not 0 <= dcfg.mask_token_id < tcfg.vocab_size:
        problems.append(f"mask_token_id={dcfg.mask_token_id} outside the target's vocabulary "
                        f"({tcfg.vocab_size})")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--target-kv-dtype", default="bf16", choices=sorted(KV_DTYPES))
    ap.add_argument("--draft-kv-dtype", default="bf16", choices=sorted(KV_DTYPES))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--verify", action="store_true", help="load the weights and check them")
    args = ap.parse_args(argv)
    path: Path = args.dir
    try:
        pair = (path / "target").is_dir() and (path / "draft").is_dir()
        target_dir = path / "target" if pair else (None if is_drafter(path) else path)
        draft_dir = path / "draft" if pair else (path if target_dir is None else None)
        lines, layers, tcfg, dcfg = [], [], None, None
        if target_dir is not None:
            from models.config import load_qwen3_config
            t_lines, t_layers = target_inspect.target_report(target_dir, args.target_kv_dtype)
            lines += t_lines
            layers += t_layers
            tcfg = load_qwen3_config(target_dir)
            if args.verify:
                from models.checkpoint import load_qwen3
                from models.qwen3 import init_params as init_target
                lines.append(target_inspect.verify(target_dir, tcfg, load_qwen3, init_target))
        if draft_dir is not None:
            d_lines, dcfg, d_layers = draft_report(draft_dir, args.draft_kv_dtype)
            lines += d_lines
            layers += d_layers
            if args.verify:
                lines.append(target_inspect.verify(draft_dir, dcfg, load_dflash, init_draft))
        if tcfg is not None and dcfg is not None:
            problems = pair_checks(tcfg, dcfg)
            lines.append("pair: " + ("fits" if not problems else "DOES NOT FIT: "
                                     + "; ".join(problems)))
        lines.append(f"KV cache, page {args.page_size}:")
        lines += ["  " + line for line in target_inspect.describe_pools(layers, args.page_size)]
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0 if tcfg is None or dcfg is None or not pair_checks(tcfg, dcfg) else 1


if __name__ == "__main__":
    sys.exit(main())
