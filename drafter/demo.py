"""Speculative decoding on the embedded default pair: `python -m drafter.demo`.

Loads the shipped byte-level code model and its DFlash drafter, builds the
unified cache (fp8 target pools, bf16 draft pool), generates for held-out
prompts with the drafter and without, checks the outputs match, and prints
acceptance length and tokens/s. The disaggregated serving demo is
`python -m disagg demo`.
"""

from __future__ import annotations

import argparse
import time

import jax

from drafter.corpus import ByteTokenizer
from drafter.default import default_step_config, load_default, load_prompts
from drafter.engine import Engine
from unified_kv import bytes_per_pool


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=48)
    args = ap.parse_args(argv)
    params, tcfg, dcfg = load_default()
    cfg = default_step_config(tcfg, dcfg, num_slots=4)
    print(f"device {jax.devices()[0].device_kind}; target {tcfg.num_layers} layers, drafter "
          f"{dcfg.num_layers} layers, block {dcfg.block_size}")
    for pool, nbytes in zip(cfg.spec.pools, bytes_per_pool(cfg.spec).values()):
        print(f"  pool {pool.pool_id}: {pool.kv_dtype:8s} window={str(pool.sliding_window):4s} "
              f"{len(pool.layer_names)} layers ({', '.join(pool.layer_names)}), "
              f"{pool.num_pages} pages, {nbytes / 2**20:.1f} MiB")
    prompts = [p["tokens"] for p in load_prompts() if p["length"] == 128][:args.num_prompts]
    runs = {}
    for name, step_cfg, speculative in (("speculative", cfg, True),
                                        ("plain", default_step_config(tcfg, None, num_slots=4),
                                         False)):
        engine = Engine(params, step_cfg, speculative=speculative)
        engine.generate(prompts[:1], 4)  # compile outside the timing
        start = time.perf_counter()
        runs[name] = engine.generate(prompts, args.max_new)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.tokens) for r in runs[name])
        print(f"{name:>12}: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} tok/s")
    tok = ByteTokenizer()
    for prompt, result in zip(prompts, runs["speculative"]):
        print(f"\n...{tok.decode(prompt[-70:])!r}\n  -> {tok.decode(result.tokens)!r}"
              f"\n  acceptance length {result.acceptance_length:.2f}")
    same = [r.tokens for r in runs["speculative"]] == [r.tokens for r in runs["plain"]]
    print(f"\nspeculative output == plain greedy output: {same}")
    if not same:
        raise SystemExit("speculative decoding changed the output: a bug")


if __name__ == "__main__":
    main()
