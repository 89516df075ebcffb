"""Where a decode step's device time goes, kernel by kernel, at the 8B shape.

    PYTHONPATH=. python benchmarks/profile_step.py [--layers 36] [--batch 1]
        [--context 1024] [--layer-loop auto] [--precision highest] [--top 25]
        [--out DIR]

Prefills `batch` random prompts of `context` tokens, then runs the plain and
the speculative step in a jitted loop under the jax profiler, and reads the
Perfetto trace back: device time per step of each kernel (summed over its
launches), largest first, beside the step's weight-read bound at the copy
bandwidth measured in the same run. XLA flags (XLA_FLAGS) apply per process, so
compare them by running this once per setting; a step's own compiler options
(`StepConfig.compiler_options`) are applied.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_scale import step_config
from benchmarks.timing import device_copy_bandwidth
from drafter.engine import Engine
from drafter.shapes import param_bytes, qwen3_8b_pair, random_params
from drafter.steps import decode_step, plain_decode_step
from drafter.timing import time_step_loop
from models.layers import stack_params, unstack_params

# launches that are the profiler's own or the host's, not the step's kernels
_NOT_KERNELS = re.compile(r"^(Memcpy|Memset|cuda|cu[A-Z]|ThunkExecutor|\$)")


def kernel_times(trace_dir: str, calls: int) -> list[tuple[str, float, int]]:
    """(kernel name, device ms per call, launches per call), largest first, from
    the Perfetto trace the profiler wrote under `trace_dir`."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no Perfetto trace under {trace_dir}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        events = json.load(f)
    events = events.get("traceEvents", events)
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if "/device:GPU" in name}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e["pid"] in device_pids}
    # kernels sit on stream lines; other device lines (XLA modules, ops) summarise them
    streams = {key for key, name in threads.items() if name.startswith("Stream")}
    print(f"device lines: {sorted(set(threads.values()))}", flush=True)
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            continue
        if streams and (e["pid"], e.get("tid")) not in streams:
            continue
        if _NOT_KERNELS.match(e["name"]):
            continue
        total[e["name"]] += e["dur"] / 1e3
        count[e["name"]] += 1
    return [(n, t / calls, count[n] // calls) for n, t in total.most_common()]


def profile(engine, steps: int, top: int, label: str) -> dict:
    cfg, spec = engine.cfg, engine.spec
    step_fn = decode_step if engine.speculative else plain_decode_step
    slots = jnp.arange(spec.num_slots, dtype=jnp.int32)
    longest = int(np.max(np.asarray(engine.state.kv.target_lens))) + 4 * steps * cfg.block_size
    width = engine._table_width(longest)

    def step(params, state, key):
        return step_fn(params, state, slots, key, cfg=cfg, table_width=width)[0]

    trace_dir = tempfile.mkdtemp(prefix="profile_step_")
    repeats = 3
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        seconds, _, _ = time_step_loop(step, engine.params, engine.state, steps=steps,
                                       repeats=repeats, compiler_options=cfg.compiler_options)
    # the profiled region ran the loop 1 + repeats times (the compile-and-warm run first)
    kernels = kernel_times(trace_dir, (1 + repeats) * steps)
    step_ms = float(np.median(seconds)) * 1e3
    print(f"\n{label}: device step {step_ms:.3f} ms; kernels summed "
          f"{sum(t for _, t, _ in kernels):.3f} ms per step", flush=True)
    for name, ms, launches in kernels[:top]:
        print(f"  {ms:8.3f} ms  x{launches:<4d} {name[:110]}", flush=True)
    return {"device_step_ms": step_ms,
            "kernels": [{"name": n, "ms": t, "launches": c} for n, t, c in kernels[:top]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"))
    ap.add_argument("--precision", default="highest",
                    help="StepConfig.matmul_precision: highest, default or auto")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--plain-only", action="store_true")
    ap.add_argument("--quick", action="store_true", help="4K vocabulary: a CPU smoke test")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=args.layers,
                               num_draft_layers=5 if args.layers >= 8 else 1,
                               **({"vocab_size": 4096} if args.quick else {}))
    bw = device_copy_bandwidth(64 << 20, 3) if args.quick else device_copy_bandwidth()
    probe = step_config(tcfg, dcfg, args.batch, args.context, args.layer_loop)
    params = random_params(tcfg, dcfg)
    params = stack_params(params) if probe.scans_layers else unstack_params(params)
    weights_t = param_bytes(params["target"]) - param_bytes(params["target"]["embed"])
    weights_d = param_bytes(params["draft"]) + param_bytes(params["target"]["lm_head"])
    label = (f"L{args.layers} b{args.batch} ctx{args.context} "
             f"{'scan' if probe.scans_layers else 'unrolled'} {args.precision} "
             f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"{label}: copy bandwidth {bw / 1e12:.2f} TB/s; weight-read bound plain "
          f"{weights_t / bw * 1e3:.3f} ms, speculative {(weights_t + weights_d) / bw * 1e3:.3f} ms",
          flush=True)
    rng = np.random.default_rng(0)
    report = {"label": label, "copy_bandwidth_bytes_per_s": bw}
    for name, speculative in (("plain", False), ("speculative", True)):
        if speculative and args.plain_only:
            break
        cfg = step_config(tcfg, dcfg if speculative else None, args.batch, args.context,
                          args.layer_loop)
        cfg = dataclasses.replace(cfg, matmul_precision=args.precision)
        engine = Engine(params if speculative else {"target": params["target"]}, cfg,
                        speculative=speculative)
        for i in range(args.batch):
            engine.add_request(f"r{i}", rng.integers(0, tcfg.vocab_size - 1,
                                                     args.context).tolist(), 512)
        engine.prefill_submitted()
        report[name] = profile(engine, args.steps, args.top, f"{name} ({label})")
        del engine
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[:120]
        with open(os.path.join(args.out, f"profile_{tag}.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
