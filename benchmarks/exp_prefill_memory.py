"""Where a batched long-context prefill's working memory goes, at the Qwen3-8B shape.

    XLA_FLAGS=--xla_dump_to=DIR/dump PYTHONPATH=. python benchmarks/exp_prefill_memory.py \
        --out DIR --batch 32 --context 8192

Builds the 8B-shaped engines of bench_scale (random weights, scanned layers), submits
`batch` prompts of `context` tokens, and compiles (never runs) the first prefill call
each engine makes: its memory analysis, and the largest values in XLA's buffer
assignment of the temporary allocation.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

import jax
import numpy as np

from benchmarks import bench_scale
from drafter import executor
from drafter.engine import Engine
from drafter.shapes import qwen3_8b_pair, random_params
from models.layers import step_params


def capture(records):
    """Each distinct prefill call (its static arguments and shapes): compiled first, its
    memory analysis recorded and printed, then run."""
    real = executor.packed_step_for
    seen = set()

    def packed_step_for(cfg, kind="decode", copy=0):
        jitted = real(cfg, kind, copy)

        def call(*args, **kwargs):
            key = (kind, tuple(sorted(kwargs.items())),
                   tuple(x.shape for x in jax.tree.leaves(args[2:])))
            if key not in seen:
                seen.add(key)
                m = jitted.lower(*args, **kwargs).compile().memory_analysis()
                rec = {k: getattr(m, k) for k in (
                    "temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                    "alias_size_in_bytes")} | {"kind": kind, "static": {
                        k: v for k, v in kwargs.items() if isinstance(v, (int, bool, str))}}
                records.append(rec)
                print(json.dumps(rec), flush=True)
            return jitted(*args, **kwargs)
        return call
    executor.packed_step_for = packed_step_for


def largest_values(dump: str, top: int = 12, min_bytes: int = 2 << 30) -> list[str]:
    """The largest values of each prefill program's temporary allocation."""
    out = []
    for path in sorted(glob.glob(os.path.join(dump, "*packed_step*buffer-assignment.txt"))):
        blocks = re.split(r"\n(?=allocation \d+:)", open(path).read())
        out.append(os.path.basename(path))
        for block in blocks:
            head = block.split("\n", 1)[0]
            size = re.match(r"allocation \d+: size (\d+)", head)
            if "preallocated-temp" not in head or int(size.group(1)) < min_bytes:
                continue
            out.append("  " + head[:100])
            values = re.findall(r"value: <\d+ ([^>]+)> \(size=(\d+),offset=(\d+)\): (\S+)",
                                block)
            values = sorted(set(values), key=lambda v: -int(v[1]))[:top]
            out += [f"  {int(s) / 2**20:10.1f} MiB @ {int(o) / 2**20:9.1f}  {name}  {shape}"
                    for name, s, o, shape in values]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--min-temp-bytes", type=int, default=2 << 30)
    ap.add_argument("--speculative", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=args.layers, num_draft_layers=5)
    probe = bench_scale.step_config(tcfg, dcfg, 1, 1024, "scan")
    params = step_params(random_params(tcfg, dcfg), probe.scans_layers)
    records = []
    capture(records)
    rng = np.random.default_rng(0)
    for speculative in map(bool, args.speculative):
        cfg = bench_scale.step_config(tcfg, dcfg if speculative else None, args.batch,
                                      args.context, "scan")
        eng = Engine(params if speculative else {"target": params["target"]}, cfg,
                     speculative=speculative)
        for i in range(args.batch):
            eng.add_request(f"r{i}", rng.integers(0, 150_000, args.context).tolist(), 16)
        try:
            eng.prefill_submitted()
            eng.step()
        except Exception as e:  # noqa: BLE001 - a throwaway probe reports and goes on
            print(f"failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        for r in records:
            r.setdefault("speculative", speculative)
        del eng
    lines = largest_values(os.environ.get("DUMP", os.path.join(args.out, "dump")),
                           min_bytes=args.min_temp_bytes)
    print("\n".join(lines))
    with open(os.path.join(args.out, "prefill_memory.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "batch": args.batch,
                   "context": args.context, "programs": records, "largest": lines}, f, indent=1)


if __name__ == "__main__":
    main()
