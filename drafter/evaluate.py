"""Acceptance and speed of the embedded default pair on the shipped held-out prompts.

    PYTHONPATH=. python -m drafter.evaluate [--quick] [--max-new N] [--json FILE]

Per prompt length: mean acceptance length (AL, tokens committed per decode
step, block 8), per-position acceptance (how often draft k was accepted),
and a check that speculative output equals plain greedy output. Then plain
vs speculative decode tokens/s at batch 1 and batch 16 on this device.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.timing import machine
from drafter.default import default_step_config, load_default, load_prompts
from drafter.engine import Engine

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def per_position_acceptance(acceptance: list[int], block: int) -> list[float]:
    """Fraction of steps whose draft k (1..block-1) was accepted (committed n >= k+1)."""
    steps = np.asarray(acceptance)
    return [float((steps >= k + 1).mean()) for k in range(1, block)]


def acceptance_by_length(params, tcfg, dcfg, prompts, max_new):
    spec_cfg = default_step_config(tcfg, dcfg, num_slots=4)
    plain_cfg = default_step_config(tcfg, None, num_slots=4)
    rows = []
    for length in sorted({p["length"] for p in prompts}):
        group = [p["tokens"] for p in prompts if p["length"] == length]
        spec = Engine(params, spec_cfg).generate(group, max_new)
        plain = Engine(params, plain_cfg, speculative=False).generate(group, max_new)
        steps = [a for r in spec for a in r.acceptance]
        row = {"prompt_length": length, "num_prompts": len(group),
               "acceptance_length": float(np.mean(steps)),
               "per_prompt_al": [r.acceptance_length for r in spec],
               "per_position_acceptance": per_position_acceptance(steps, dcfg.block_size),
               "lossless": [r.tokens for r in spec] == [r.tokens for r in plain]}
        print(f"  prompt {length:>5}: AL {row['acceptance_length']:.2f}  per-position "
              f"{[round(x, 2) for x in row['per_position_acceptance']]}  "
              f"lossless={row['lossless']}", flush=True)
        rows.append(row)
    return rows


def tokens_per_second(params, tcfg, dcfg, prompts, batch, max_new):
    """Decode tokens/s, plain vs speculative, `batch` concurrent requests."""
    group = [p["tokens"] for p in prompts][:batch]
    group = (group * batch)[:batch]
    out = {"batch": batch}
    for name, cfg, speculative in (("plain", default_step_config(tcfg, None, num_slots=batch),
                                    False),
                                   ("speculative", default_step_config(tcfg, dcfg,
                                                                       num_slots=batch), True)):
        engine = Engine(params, cfg, speculative=speculative)
        engine.generate(group[:1], 8)  # compile prefill and decode
        engine.warmup(max(len(g) for g in group) + max_new)  # and every table width used
        start = time.perf_counter()
        results = engine.generate(group, max_new)
        seconds = time.perf_counter() - start
        out[f"{name}_tokens_per_s"] = sum(len(r.tokens) for r in results) / seconds
    out["speedup"] = out["speculative_tokens_per_s"] / out["plain_tokens_per_s"]
    print(f"  batch {batch:>2}: plain {out['plain_tokens_per_s']:.1f} tok/s, speculative "
          f"{out['speculative_tokens_per_s']:.1f} tok/s ({out['speedup']:.2f}x)", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts per length, up to 2048")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--json", default=None, help="output file (default benchmarks/results/)")
    args = ap.parse_args(argv)
    params, tcfg, dcfg = load_default()
    prompts = load_prompts()
    if args.quick:
        keep = {}
        prompts = [p for p in prompts if p["length"] <= 2048
                   and keep.setdefault(p["length"], []).append(1) is None
                   and len(keep[p["length"]]) <= 2]
    print(f"device: {jax.devices()[0].device_kind}; {len(prompts)} held-out prompts", flush=True)
    report = {"machine": machine(), "block_size": dcfg.block_size, "max_new": args.max_new,
              "by_length": acceptance_by_length(params, tcfg, dcfg, prompts, args.max_new)}
    short = [p for p in prompts if p["length"] == 128]
    report["speed"] = [tokens_per_second(params, tcfg, dcfg, short, b, args.max_new)
                       for b in ((1,) if args.quick else (1, 16))]
    path = Path(args.json) if args.json else RESULTS / (
        f"eval_default_{jax.default_backend()}{'_quick' if args.quick else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
