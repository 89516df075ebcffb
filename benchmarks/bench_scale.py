"""Real model scale: a Qwen3-8B-shaped target with a DFlash-b16-shaped drafter.

    PYTHONPATH=. python benchmarks/bench_scale.py --out DIR [--batches 1 32]
        [--contexts 1024] [--layers 36] [--steps 16] [--lone-request-slots 32]

Random bf16 weights (only step times matter), fp8 target KV and bf16 draft KV.
Every figure is set against a bound measured in the same run:

  copy bandwidth    bytes read + written by a 2 GiB copy, per second (queued calls)
  bf16 matmul peak  an 8192^3 bf16 matmul (f32 accumulation), FLOP/s (queued calls)
  decode roofline   (weights read + KV read) / copy bandwidth; the embedding
                    table is not read by a step (a gather of B rows)
  compute bound     2 x params x tokens / matmul peak (verify: block tokens per
                    row through the target; draft: block tokens through the
                    drafter's layers and the shared lm_head); prefill: the
                    layers at every prompt token, the head at its last one

Per batch and context: device step time of plain and speculative decode (one
jitted loop, no host), the engine's host loop beside it (`Engine.step`),
prefill tokens/s and utilisation (the batch's prompts, chunked and batched by
the scheduler), the wall time of each first call (compile included, minus the
same call warm), whether every prefill call updated the cache in place, and peak
device memory; and what admission takes at 32K tokens
a request in 90% of the memory the weights leave. Writes scale.json.
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_decode_speed import engine_rate
from benchmarks.timing import (device_copy_bandwidth, device_matmul_peak, report_goals,
                               write_results)
from drafter.engine import Engine
from drafter.evaluate import device_rate
from drafter.shapes import param_bytes, qwen3_8b_pair, random_step_params
from pallas_kernels import launch_plan
from drafter.steps import StepConfig
from disagg.frontend import kv_budget_bytes
from unified_kv import CacheSpec, budget_for, capacity

GOAL_KEYS = ("plain_b1_over_roofline", "plain_b32_over_roofline",
             "speculative_b1_over_plain_b1", "speculative_b32_over_compute_bound",
             "prefill_utilisation", "prefill_8k_utilisation", "compile_s",
             "projected_b1_tokens_per_s", "engine_over_device_b1",
             "lone_request_padded_over_every_slot")
DESIGN_AL = 6.5  # DFlash's reported acceptance length for Qwen3-8B-b16 (math / code, greedy)
# Prefill chunk (the cache's max_step_tokens): at 1,024 tokens a chunk's matmuls outweigh
# one read of the weights; 256-token chunks at this shape are close to bound by that read.
PREFILL_CHUNK = 1024


def step_config(tcfg, dcfg, batch: int, context: int, layer_loop: str = "auto",
                scan_unroll: int = 1, graph_loops: bool = False) -> StepConfig:
    layers = layer_specs(tcfg, dcfg)
    max_len = context + 1024
    budget = (int(1.3 * (batch + 1) * (max_len + PREFILL_CHUNK) * kv_bytes_per_token(layers))
              + (64 << 20))
    spec = CacheSpec(page_size=16, layers=tuple(layers), num_slots=batch + 1,
                     max_seq_len=max_len, memory_budget_bytes=budget,
                     max_step_tokens=PREFILL_CHUNK)
    return StepConfig(tcfg, spec, dcfg, layer_loop=layer_loop, scan_unroll=scan_unroll,
                      graph_loops=graph_loops)


def layer_specs(tcfg, dcfg) -> list:
    """fp8 target KV, bf16 draft KV (none without a drafter)."""
    return tcfg.layer_specs("fp8_e4m3") + (dcfg.layer_specs("bf16") if dcfg else [])


def weight_read_bytes(params) -> tuple[int, int]:
    """Weight bytes a plain step reads (the target's; the embedding table only as a tied
    lm_head, else just B rows of it), and what a speculative step reads on top (the
    drafter, and the lm_head again for the draft block)."""
    target = params["target"]
    plain = param_bytes(target) - param_bytes(target["embed"]) + (
        0 if "lm_head" in target else head_bytes(target))
    return plain, param_bytes(params["draft"]) + head_bytes(target)


def head_bytes(target) -> int:
    """Bytes of the target's head: its lm_head, or the embedding table it is tied to."""
    return param_bytes(target.get("lm_head", target["embed"]))


def pool_addresses(engine) -> list[int]:
    """Where each of `engine`'s KV pools lives on its device."""
    return [p.unsafe_buffer_pointer() for p in engine.state.kv.pools]


def kv_bytes_per_token(layers) -> int:
    """K and V of one token in every layer."""
    return sum(2 * l.num_kv_heads * l.head_dim * jnp.dtype(l.dtype).itemsize for l in layers)


def measure(params, tcfg, dcfg, batch: int, context: int, steps: int, bw: float,
            peak: float, layer_loop: str = "auto", scan_unroll: int = 1,
            graph_loops: bool = False) -> dict:
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, min(150_000, tcfg.vocab_size - 1), context).tolist()
               for _ in range(batch + 1)]
    out = {"batch": batch, "context": context}
    weights_t, weights_d = weight_read_bytes(params)
    # FLOPs per token through a set of bf16 weights: 2 per parameter, 2 bytes each
    flops_t, flops_d = weights_t, weights_d
    for name, speculative in (("plain", False), ("speculative", True)):
        cfg = step_config(tcfg, dcfg if speculative else None, batch, context, layer_loop,
                          scan_unroll, graph_loops)
        eng = Engine(params if speculative else {"target": params["target"]}, cfg,
                     speculative=speculative)
        # Cold: the batch's prompts prefilled (every prefill and decode variant they
        # use compiles), then cancelled. Warm: the same prompts again, compiled.
        times = []
        pools = pool_addresses(eng)
        for round_ in ("cold", "warm"):
            start = time.perf_counter()
            for i in range(batch):
                eng.add_request(f"{round_}{i}", prompts[i], 768)
            eng.prefill_submitted()
            times.append(time.perf_counter() - start)
            if round_ == "cold":
                for i in range(batch):
                    eng.cancel(f"cold{i}")
                eng.run()
        cold, warm = times
        # Every prefill call updates the cache in its own buffers (donated): a call that
        # copied it would hold two caches, which large batch x context cannot afford.
        in_place = pools == pool_addresses(eng)
        if not in_place:
            print(f"  b{batch} ctx {context} {name}: a prefill call COPIED the KV cache "
                  f"instead of updating it in place", flush=True)
        print(f"  b{batch} ctx {context} {name}: prefill cold {cold:.1f} s, warm {warm:.2f} s",
              flush=True)  # progress: a run cut short by its time limit still reports
        # the engine's host loop first: the device loop then takes the state (donated: a
        # second copy of the cache would not fit at large batch x context)
        host = engine_rate(eng, max(steps // eng.decode_steps, 4)) if batch == 1 else {}
        start = time.perf_counter()
        dev = device_rate(eng, steps, 3, donate=True)
        timed = time.perf_counter() - start
        compile_decode = timed - dev["device_step_ms"] * 1e-3 * steps * 4
        kv = batch * context * kv_bytes_per_token(cfg.spec.layers)
        roof = (weights_t + (weights_d if speculative else 0) + kv) / bw
        row = {**dev, "prefill_cold_s": cold, "prefill_warm_s": warm,
               "cache_in_place": in_place,
               "prefill_tokens_per_s": batch * context / warm,
               "compile_decode_s": compile_decode, "roofline_ms": roof * 1e3,
               "over_roofline": dev["device_step_ms"] * 1e-3 / roof}
        if speculative:
            block = dcfg.block_size
            compute = batch * block * (flops_t + flops_d) / peak
            row["compute_bound_ms"] = compute * 1e3
            row["over_compute_bound"] = dev["device_step_ms"] * 1e-3 / compute
        print(f"  b{batch} ctx {context} {name}: device step {dev['device_step_ms']:.2f} ms "
              f"(roofline {roof * 1e3:.2f} ms), {dev['rows']} rows, "
              f"{dev['tokens_per_step']:.2f} tokens a step", flush=True)
        if host:
            row.update(host)
            row["engine_over_device"] = row["engine_tokens_per_s"] / dev["device_tokens_per_s"]
        out[name] = row
        print(f"  b{batch} ctx {context} {name}: step {dev['device_step_ms']:.2f} ms "
              f"(roofline {roof * 1e3:.2f} ms, x{row['over_roofline']:.2f}), prefill "
              f"{row['prefill_tokens_per_s']:.0f} tok/s, cold prefill {cold:.1f} s, decode "
              f"compile ~{compile_decode:.1f} s", flush=True)
        del eng
    # the layers at every prompt position, the head at the last one alone
    head = head_bytes(params["target"])
    flops_prefill = (flops_t - head) * context + head + 4 * tcfg.num_layers * \
        tcfg.num_heads * tcfg.head_dim * context * context // 2
    out["prefill_utilisation"] = batch * flops_prefill / out["plain"]["prefill_warm_s"] / peak
    out["compile_s"] = (out["plain"]["prefill_cold_s"] - out["plain"]["prefill_warm_s"]
                        + out["plain"]["compile_decode_s"]
                        + out["speculative"]["compile_decode_s"])
    return out


def lone_request(params, tcfg, dcfg, slots: int, context: int, steps: int,
                 layer_loop: str = "auto") -> dict:
    """One speculative request on an engine of `slots` slots, its host loop's tokens/s
    with decode calls of padded rows (the default: one row here) beside a row per slot
    (`batch_invariant`), same weights and prompt: what a lightly loaded server pays."""
    prompt = np.random.default_rng(0).integers(0, min(150_000, tcfg.vocab_size - 1),
                                               context).tolist()
    out = {"slots": slots, "context": context}
    for name, every_slot in (("padded_rows", False), ("every_slot", True)):
        eng = Engine(params, step_config(tcfg, dcfg, slots - 1, context, layer_loop),
                     batch_invariant=every_slot)
        eng.add_request("lone", prompt, 768)
        eng.prefill_submitted()
        out[name] = engine_rate(eng, max(steps // eng.decode_steps, 4))
        print(f"  one request in {slots} slots, {name}: "
              f"{out[name]['engine_tokens_per_s']:.1f} tok/s", flush=True)
        del eng
    out["padded_over_every_slot"] = (out["padded_rows"]["engine_tokens_per_s"]
                                     / out["every_slot"]["engine_tokens_per_s"])
    return out


def memory_plan(tcfg, dcfg, batch: int = 64, context: int = 32768,
                fraction: float = 0.9) -> dict | None:
    """What admission takes at `context` tokens a request in `fraction` of this device's
    memory left by the weights (as `serve --kv-memory-fraction`), beside what `batch` such
    requests need. None on a device that does not report its memory."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    budget = kv_budget_bytes(None, fraction)
    spec = CacheSpec(page_size=16, layers=tuple(layer_specs(tcfg, dcfg)), num_slots=batch,
                     max_seq_len=context, memory_budget_bytes=budget, max_step_tokens=256)
    held, need = capacity(spec), budget_for(spec, batch)
    plan = {"device_bytes": stats["bytes_limit"], "weights_bytes": stats["bytes_in_use"],
            "kv_fraction": fraction, "kv_budget_bytes": budget, "context": context,
            "requests_held": held.requests, f"kv_bytes_for_b{batch}": need,
            f"fits_b{batch}": held.requests >= batch}
    print(f"memory: {held.describe()} (of {stats['bytes_limit'] / 2**30:.1f} GiB, weights "
          f"{stats['bytes_in_use'] / 2**30:.1f} GiB); batch {batch} needs "
          f"{need / 2**30:.1f} GiB of KV", flush=True)
    return plan


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--layers", type=int, default=None,
                    help="target layers (default 36: Qwen3-8B; 2 with --quick)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tag", default="", help="results file scale{TAG}.json (runs split "
                    "over several calls)")
    ap.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"),
                    help="how steps run the layers (StepConfig.layer_loop)")
    ap.add_argument("--scan-unroll", type=int, default=1,
                    help="scanned target layers per loop trip (StepConfig.scan_unroll)")
    ap.add_argument("--graph-loops", action="store_true",
                    help="loops in CUDA graphs (StepConfig.graph_loops)")
    ap.add_argument("--quick", action="store_true",
                    help="small probes, a 4K vocabulary and 2 layers: a smoke test on CPU")
    ap.add_argument("--split-keys", type=int, nargs="+", default=None,
                    help="keys per attention key split at small batch "
                         "(launch_plan.SMALL_BATCH_SPLIT_KEYS; 0: none), each measured in "
                         "turn on the same weights; the goal keys come from the first")
    ap.add_argument("--lone-request-slots", type=int, default=None,
                    help="also time one request on an engine of this many slots, its decode "
                         "calls at padded rows beside a row per slot")
    args = ap.parse_args(argv)
    split_keys = args.split_keys or [launch_plan.SMALL_BATCH_SPLIT_KEYS]
    if args.layers is None:
        args.layers = 2 if args.quick else 36
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=args.layers,
                               num_draft_layers=5 if args.layers >= 8 else 1,
                               **({"vocab_size": 4096} if args.quick else {}))
    bw, peak = ((device_copy_bandwidth(64 << 20, 3), device_matmul_peak(512, 3)) if args.quick
                else (device_copy_bandwidth(), device_matmul_peak()))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s",
          flush=True)
    # once, in the form the steps run (the engines then take them as they are)
    probe = step_config(tcfg, dcfg, 1, 1024, args.layer_loop)
    start = time.perf_counter()
    params = random_step_params(tcfg, dcfg, probe.scans_layers)
    jax.block_until_ready(params)
    # progress: a run that stalls before its first row shows where
    print(f"random weights in step form: {time.perf_counter() - start:.1f} s", flush=True)
    report = {"device": jax.devices()[0].device_kind, "target_layers": args.layers,
              "layer_loop": "scan" if probe.scans_layers else "unrolled",
              "scan_unroll": args.scan_unroll, "graph_loops": args.graph_loops,
              "small_batch_split_keys": split_keys[0],
              "weight_bytes": {"target": param_bytes(params["target"]),
                               "draft": param_bytes(params["draft"])},
              "copy_bandwidth_bytes_per_s": bw, "bf16_matmul_flops_per_s": peak, "runs": []}
    report["memory"] = memory_plan(tcfg, dcfg)
    for keys, context, batch in itertools.product(split_keys, args.contexts, args.batches):
        launch_plan.SMALL_BATCH_SPLIT_KEYS = keys  # read when the engines' steps trace
        print(f"small-batch key splits of {keys} keys", flush=True)
        report["runs"].append({"split_keys": keys, **measure(
            params, tcfg, dcfg, batch, context, args.steps, bw, peak, args.layer_loop,
            args.scan_unroll, args.graph_loops)})
        if args.out:  # a run stopped at its time limit keeps the runs it finished
            write_results(f"scale{args.tag}", {"partial": True, **report}, args.out)
    if args.lone_request_slots:
        lone = lone_request(params, tcfg, dcfg, args.lone_request_slots, min(args.contexts),
                            args.steps, args.layer_loop)
        report["lone_request"] = lone
        report["lone_request_padded_over_every_slot"] = lone["padded_over_every_slot"]
    stats = jax.devices()[0].memory_stats() or {}
    report["peak_memory_bytes"] = stats.get("peak_bytes_in_use")
    by = {(r["batch"], r["context"]): r for r in report["runs"]
          if r["split_keys"] == split_keys[0]}
    base = min(args.contexts)
    if (1, base) in by:
        b1 = by[(1, base)]
        report["plain_b1_over_roofline"] = b1["plain"]["over_roofline"]
        speculative = b1["speculative"]
        report["speculative_b1_over_plain_b1"] = (speculative["device_step_ms"]
                                                  / b1["plain"]["device_step_ms"])
        # The least that ratio can be: both steps at their rooflines (the drafter's
        # weights and the second lm_head read are the speculative step's extra bytes).
        report["speculative_b1_over_plain_b1_at_rooflines"] = (
            speculative["roofline_ms"] / b1["plain"]["roofline_ms"])
        report["speculative_b1_over_roofline"] = speculative["over_roofline"]
        report["projected_b1_tokens_per_s"] = DESIGN_AL / (speculative["device_step_ms"] * 1e-3)
        report["engine_over_device_b1"] = speculative.get("engine_over_device")
        report["prefill_utilisation"] = b1["prefill_utilisation"]
        report["compile_s"] = b1["compile_s"]
    if (1, 8192) in by:
        report["prefill_8k_utilisation"] = by[(1, 8192)]["prefill_utilisation"]
    if (32, base) in by:
        report["plain_b32_over_roofline"] = by[(32, base)]["plain"]["over_roofline"]
        report["speculative_b32_over_compute_bound"] = (
            by[(32, base)]["speculative"]["over_compute_bound"])
    return report_goals(f"scale{args.tag}", report, GOAL_KEYS, args.out)


if __name__ == "__main__":
    main()
