"""Serving end to end through the one engine: disaggregated vs aggregated, the handoff,
the host loop, and a load run through `serve`.

    PYTHONPATH=. python benchmarks/bench_serving.py --out DIR [--quick] [--parts ...]

Every mode is the same `Engine` configured differently; both workers share
this machine's first device (as the demo does on one GPU). Parts:

  demo      the demo's workload (held-out prompts <= 512 tokens, 48 new tokens),
            aggregated / disaggregated-shared / -private, `--repeats` rounds that
            run every mode once (interleaved): tokens/s and TTFT;
            `disagg_shared_over_aggregated` is the median over rounds of the mode's
            tokens/s over aggregated's in the same round,
            `ttft_disagg_over_aggregated_p50` the ratio of the TTFT p50s;
            `calls_per_run`: the jitted calls a run dispatched, by kind, every worker;
            `disagg_shared_threaded_over_aggregated` the same with the context
            worker stepping in its own thread, and (asked for with `--demo-modes
            ... disagg-shared-process`) `disagg_shared_process_over_aggregated` with
            it in a child process on the same devices. `--profile DIR`: where each mode's
            time goes (host time by function; kernels and programs of one run).
  handoff   one request at a time (nothing queued) per prompt length, one decode step
            per call: the time to the first generation step's token, disaggregated
            minus aggregated, is what the handoff adds between prefill and generation
            (export, move, import + redraft, the loop); minus the move itself (the
            same payload moved in isolation: nothing is copied when both workers
            share a device) it is `handoff_overhead_ms_p50`. TTFT is reported beside
            it (a disaggregated request's first token is the context's).
  engine    engine tokens/s over device tokens/s of the same speculative steps
            (benchmarks/bench_decode_speed.py's two measurements), batch 1 and 16.
  load      `--load-requests` requests, prompts 128..8K tokens, arriving as a
            Poisson stream into `serve`'s JSON-line loop: tokens/s, TTFT and
            inter-token latency p50 / p99, aggregated vs disaggregated-shared;
            every request completes and both modes give the same tokens. The
            stream starts after `Engine.warmup` (its seconds are `warmup_s`);
            `compiles` lists what the stream still compiled (nothing, when the
            warm-up covers every shape the stream runs).

Writes serving.json (keys in `GOAL_KEYS` first; `host_launch_us`, a trivial call's launch
on this host, beside them). `--pair 8b` runs the demo and handoff parts on the
Qwen3-8B-shaped pair of benchmarks/bench_scale.py (random weights:
acceptance stays near 1, so every request decodes about one token a step) and writes
serving_8b.json: how much of the small pair's host-bound gap is left when steps take a
real model's time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import os
import time

import jax
import numpy as np

from benchmarks.bench_decode_speed import engine_rate
from benchmarks.bench_scale import step_config as scale_step_config
from benchmarks.profile_step import traced_kernel_ms, write_host_profile
from benchmarks.serving_stream import (DEMO_NEW_TOKENS, LOAD_MODES, close, demo_prompts,
                                       load_part, make_engine, p)
from benchmarks.timing import report_goals, write_results
from disagg.transfer import move_payload
from drafter.default import default_step_config, load_default, load_prompts
from drafter.engine import Engine
from drafter.evaluate import device_rate, prefilled_engine
from drafter.shapes import qwen3_8b_pair, random_step_params
from drafter.steps import CALL_KINDS
from drafter.timing import host_cpu, launch_us

GOAL_KEYS = ("disagg_shared_over_aggregated", "disagg_shared_threaded_over_aggregated",
             "handoff_overhead_ms_p50", "engine_over_device_b1", "engine_over_device_b16",
             "ttft_disagg_over_aggregated_p50")


# the demo part also runs the shared mode with its context worker in a thread of its own
# (as fan-in does): its host launches then overlap the generation engine's
DEMO_MODES = ("aggregated", "disagg-shared", "disagg-shared-threaded", "disagg-private")
# also on request (--demo-modes): the context worker in a process of its own
EXTRA_DEMO_MODES = ("disagg-shared-process",)


def executors(engine: Engine) -> list:
    """The engine's executor and those of its in-process context workers."""
    contexts = getattr(engine.kv_source, "contexts", ())
    return [engine.executor] + [ctx.engine.executor for ctx in contexts]


def calls_of(engine: Engine) -> collections.Counter:
    """Jitted calls the engine and its context workers dispatched so far, by kind."""
    return sum((e.calls for e in executors(engine)), collections.Counter())


def demo_part(params, cfg, prompts, max_new: int, repeats: int,
              max_num_batched_tokens: int | None = None, profile_dir: str | None = None,
              modes=DEMO_MODES, decode_steps_per_call: int | None = None) -> dict:
    """Every mode's engine is built and compiled first; then `repeats` rounds each run
    every mode once, in an order that rotates by round, so drift (clocks, the host)
    falls on all modes alike. Per mode: median tokens/s over the rounds; `paired` ratios
    (a mode's run over the aggregated run of its round) give each mode's ratio.
    `profile_dir`: then one more run per mode under cProfile (host time by function,
    demo_profile_<mode>.txt) and one under the jax profiler (kernels and host dispatch
    per jitted function); the timed rounds run unprofiled. `decode_steps_per_call`:
    every engine's (default: Engine's)."""
    engines = {}
    for mode in modes:
        engines[mode] = make_engine(mode, params, cfg,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    decode_steps_per_call=decode_steps_per_call)
        for _ in range(cfg.graph_copies):  # compile (every copy) outside the timing
            engines[mode].generate(prompts, max_new)
    runs = {m: {"rates": [], "ttfts": [], "als": [], "tokens": None, "calls": {}} for m in modes}
    for r in range(repeats):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            engine, got = engines[mode], runs[mode]
            before = calls_of(engine)
            start = time.perf_counter()
            results = engine.generate(prompts, max_new)
            got["rates"].append(sum(len(x.tokens) for x in results)
                                / (time.perf_counter() - start))
            got["ttfts"] += [x.time_to_first_token_s for x in results]
            got["als"].append(float(np.mean([a for x in results for a in x.acceptance])))
            got["tokens"] = [x.tokens for x in results]
            got["calls"] = dict(sorted((calls_of(engine) - before).items()))
    out = {}
    if profile_dir is not None:
        for mode, engine in engines.items():
            profiler = cProfile.Profile()
            profiler.enable()
            engine.generate(prompts, max_new)
            profiler.disable()
            write_host_profile(profiler, os.path.join(profile_dir, f"demo_profile_{mode}.txt"))
            trace_dir = os.path.join(profile_dir, f"trace_{mode}")
            out.setdefault("device_ms_per_run", {})[mode] = traced_kernel_ms(
                lambda: engine.generate(prompts, max_new), trace_dir, mode)
    for engine in engines.values():
        close(engine)
    base = runs["aggregated"]["rates"]
    for mode in modes:
        got = runs[mode]
        paired = [a / b for a, b in zip(got["rates"], base)]
        out[mode] = {"tokens_per_s_median": float(np.median(got["rates"])),
                     "tokens_per_s_runs": got["rates"],
                     "paired_ratio_median": float(np.median(paired)),
                     "paired_ratio_p25_p75": [p(paired, 25), p(paired, 75)],
                     "ttft_ms_p50": 1e3 * p(got["ttfts"], 50),
                     "acceptance_length": got["als"][-1], "calls_per_run": got["calls"],
                     "tokens": got["tokens"]}
        rates = got["rates"]
        print(f"  {mode:>15}: {out[mode]['tokens_per_s_median']:.0f} tok/s (p25-p75 "
              f"{p(rates, 25):.0f}-{p(rates, 75):.0f} over {len(rates)} rounds), paired ratio "
              f"{out[mode]['paired_ratio_median']:.2f} (p25-p75 "
              f"{out[mode]['paired_ratio_p25_p75'][0]:.2f}-"
              f"{out[mode]['paired_ratio_p25_p75'][1]:.2f}), TTFT p50 "
              f"{out[mode]['ttft_ms_p50']:.1f} ms, AL {got['als'][-1]:.2f}; jitted calls per "
              f"run {sum(got['calls'].values())} {got['calls']}", flush=True)
    agg = out["aggregated"]
    out["shared_equals_aggregated"] = all(out[m]["tokens"] == agg["tokens"] for m in
                                          ("disagg-shared", "disagg-shared-threaded",
                                           "disagg-shared-process") if m in out)
    for mode in modes:
        out[mode].pop("tokens")
    return out


def move_ms(payload) -> float:
    """The KV move alone: the payload's buffers put again, in isolation."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(move_payload(payload, None).buffers)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def handoff_part(params, cfg, prompts_by_len, repeats: int) -> dict:
    # One decode step per call on both sides: the first generation step's token then
    # comes from one step in either mode (the aggregated engine would otherwise run its
    # first decode call as several steps, the disaggregated one, importing, as one).
    agg, dis = (make_engine(mode, params, cfg, decode_steps_per_call=1)
                for mode in ("aggregated", "disagg-shared"))
    captured = []
    source = dis.kv_source
    real_arrived = source._arrived

    def capture(item):
        got = real_arrived(item)
        captured.extend(x[1] for x in got
                        if x[1] is not None and not isinstance(x[1], BaseException))
        return got

    source._arrived = capture
    rows = []
    for length, prompt in sorted(prompts_by_len.items()):
        for engine in (agg, dis):
            for _ in range(cfg.graph_copies):  # compile this length's shapes, every copy
                engine.generate([prompt], 2)
        ttft = {"aggregated": [], "disagg": []}
        first_step = {"aggregated": [], "disagg": []}  # to the first generation step's token
        moves = []
        for _ in range(repeats):
            for name, engine in (("aggregated", agg), ("disagg", dis)):
                captured.clear()
                r = engine.generate([prompt], 2, ignore_eos=True)[0]
                ttft[name].append(1e3 * r.time_to_first_token_s)
                first_step[name].append(1e3 * r.token_times_s[1])
            moves.append(move_ms(captured[-1]))
        a, d, m, ga, gd = (float(np.median(x)) for x in (
            ttft["aggregated"], ttft["disagg"], moves, first_step["aggregated"],
            first_step["disagg"]))
        rows.append({"prompt_tokens": length, "ttft_aggregated_ms": a, "ttft_disagg_ms": d,
                     "first_step_aggregated_ms": ga, "first_step_disagg_ms": gd,
                     "move_ms": m, "handoff_overhead_ms": gd - ga - m,
                     "kv_bytes": captured[-1].nbytes})
        print(f"  {length:>5} tokens: TTFT aggregated {a:.2f} ms, disaggregated {d:.2f} ms; "
              f"first generation step {ga:.2f} / {gd:.2f} ms, move {m:.3f} ms -> handoff "
              f"overhead {gd - ga - m:.2f} ms", flush=True)
    return {"rows": rows,
            "handoff_overhead_ms_p50": float(np.median([r["handoff_overhead_ms"]
                                                        for r in rows]))}


def engine_part(params, tcfg, dcfg, prompts, batches, steps: int,
                decode_steps=(None,), graph_loops: bool = False,
                graph_copies: int = 1) -> dict:
    """Per batch: device rate once, then the engine's rate for each decode-steps-per-call
    setting (None: the engine's default); the ratio is the default's (or the first)."""
    out = {}
    for batch in batches:
        device = None
        for k in decode_steps:
            engine = prefilled_engine(params, tcfg, dcfg, prompts, batch, True,
                                      decode_steps_per_call=k, graph_loops=graph_loops,
                                      graph_copies=graph_copies)
            device = device or device_rate(engine, steps, 3)
            # Enough calls that filling and draining the one-ahead pipeline is a small
            # part of the window (steady decoding is what the device rate measures).
            host = engine_rate(engine, max(4 * steps // engine.decode_steps, 8))
            row = {**device, **host, "decode_steps_per_call": engine.decode_steps,
                   "ratio": host["engine_tokens_per_s"] / device["device_tokens_per_s"]}
            out.setdefault(f"b{batch}", row)
            out[f"b{batch}_k{engine.decode_steps}"] = row
            print(f"  batch {batch:>2}, {engine.decode_steps} decode steps per call: engine "
                  f"{host['engine_tokens_per_s']:.0f} tok/s / device "
                  f"{device['device_tokens_per_s']:.0f} tok/s = {row['ratio']:.2f} (dispatch "
                  f"{host['dispatch_ms']:.3f} ms, wait {host['wait_ms']:.3f} ms per call, "
                  f"device step {device['device_step_ms']:.3f} ms)", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test on CPU")
    ap.add_argument("--parts", nargs="+", default=["demo", "handoff", "engine", "load"])
    ap.add_argument("--engine-batches", type=int, nargs="+", default=[1, 16],
                    help="batches the engine part measures")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--load-requests", type=int, default=200)
    ap.add_argument("--load-passes", type=int, default=1,
                    help="streams per mode on one engine (later ones only compare answers)")
    ap.add_argument("--load-rate", type=float, default=20.0, help="arrivals per second")
    ap.add_argument("--load-modes", nargs="+", choices=LOAD_MODES, default=list(LOAD_MODES),
                    help="load part: the modes to run (one each fits a 600 s call)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="demo and load parts: the engines' per-step token budget, the same "
                         "for every mode (default: Engine's)")
    ap.add_argument("--demo-modes", nargs="+", choices=DEMO_MODES + EXTRA_DEMO_MODES,
                    default=list(DEMO_MODES),
                    help="demo part: the modes to run (aggregated always runs: the baseline)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="demo part: profile each mode's timed runs on the host (cProfile) "
                         "into DIR/demo_profile_<mode>.txt")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="load part: batch-invariant engines (a request's answer does not "
                         "depend on its batches)")
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[None],
                    help="engine part: decode steps per call to compare (default: the "
                         "engine's own)")
    ap.add_argument("--graph-loops", action="store_true",
                    help="every part: StepConfig.graph_loops (loops in CUDA graphs)")
    ap.add_argument("--graph-copies", type=int, default=1,
                    help="every part: StepConfig.graph_copies (alternated copies of each "
                         "step, import and export program, so CUDA graphs can keep their "
                         "buffers' addresses)")
    ap.add_argument("--handoff-lengths", type=int, nargs="+", default=None,
                    help="handoff part: the prompt lengths to time (default: every length "
                         "of the held-out set)")
    ap.add_argument("--graph-calls", nargs="+", choices=CALL_KINDS, default=list(CALL_KINDS),
                    help="demo, handoff and load parts: StepConfig.graph_calls (the kinds of "
                         "call that launch as CUDA graphs; the others launch kernel by kernel)")
    ap.add_argument("--demo-decode-steps", type=int, default=None,
                    help="demo part: every engine's decode steps per call (default: the "
                         "engine's own; 1 shows what a call of several steps adds to TTFT)")
    ap.add_argument("--pair", choices=("embedded", "8b"), default="embedded",
                    help="8b: the demo part on the Qwen3-8B-shaped pair (module doc)")
    args = ap.parse_args(argv)
    held_out = load_prompts()
    if args.pair == "8b":
        if not set(args.parts) <= {"demo", "handoff"}:
            ap.error("--pair 8b runs the demo and handoff parts: give --parts demo handoff")
        tcfg, dcfg = qwen3_8b_pair()
        # 8 slots (the demo's six prompts and the dummy): at 1K contexts the fp8 pool stays
        # under 2^31 elements, which the fused Pallas K/V store addresses
        # (pallas_kernels/rope_store); the handoff's longest prompt sets the context
        longest = max(args.handoff_lengths or [q["length"] for q in held_out])
        context = max(1024, longest if "handoff" in args.parts else 0)
        cfg = dataclasses.replace(scale_step_config(tcfg, dcfg, 7, context),
                                  graph_loops=args.graph_loops, graph_copies=args.graph_copies)
        # in step form, in one piece below the caches (drafter.shapes.random_step_params)
        params = random_step_params(tcfg, dcfg, cfg.scans_layers)
    else:
        params, tcfg, dcfg = load_default()
        cfg = default_step_config(tcfg, dcfg, num_slots=4 if args.quick else 16,
                                  graph_loops=args.graph_loops, graph_copies=args.graph_copies)
    cfg = dataclasses.replace(cfg, graph_calls=tuple(args.graph_calls))
    by_len = {}
    for q in held_out:
        by_len.setdefault(q["length"], q["tokens"])
    report = {"device": jax.devices()[0].device_kind, "num_devices": len(jax.devices()),
              "pair": args.pair,
              "graph_loops": args.graph_loops, "graph_copies": args.graph_copies,
              "graph_calls": list(cfg.graph_calls),
              # the host's fixed cost a call, beside which the host-bound ratios are read
              "host_launch_us": launch_us()}
    print(f"host: {report['host_launch_us']:.1f} us to launch a trivial jitted call "
          f"({host_cpu()})", flush=True)
    if args.quick:
        short = [q["tokens"][:40] for q in held_out[:4]]
        demo_tokens, handoff_prompts, load_prompts_ = short, {24: short[0][:24]}, short
        repeats, new, batches, steps = 1, 6, [1, 2], 4
    else:
        demo_tokens = demo_prompts(held_out)
        handoff_prompts, load_prompts_ = by_len, [q["tokens"] for q in held_out]
        if args.handoff_lengths:
            if missing := sorted(set(args.handoff_lengths) - set(by_len)):
                ap.error(f"--handoff-lengths: no held-out prompt is {missing} tokens long; "
                         f"the lengths are {sorted(by_len)}")
            handoff_prompts = {n: by_len[n] for n in args.handoff_lengths}
        repeats, new, batches, steps = args.repeats, DEMO_NEW_TOKENS, args.engine_batches, 32

    name = "serving" if args.pair == "embedded" else "serving_8b"

    def save() -> None:
        """The parts so far: a run stopped at its time limit keeps what it measured."""
        if args.out:
            write_results(name, {"partial": True, **report}, args.out)

    if "demo" in args.parts:
        print("demo workload:", flush=True)
        modes = ["aggregated"] + [m for m in args.demo_modes if m != "aggregated"]
        report["demo"] = d = demo_part(params, cfg, demo_tokens, new, repeats,
                                       args.max_num_batched_tokens, args.profile, modes,
                                       args.demo_decode_steps)
        base = d["aggregated"]
        for mode, key in (("disagg-shared", "disagg_shared_over_aggregated"),
                          ("disagg-shared-threaded", "disagg_shared_threaded_over_aggregated"),
                          ("disagg-shared-process", "disagg_shared_process_over_aggregated")):
            if mode in d:
                report[key] = d[mode]["paired_ratio_median"]
        if "disagg-shared" in d:
            report["ttft_disagg_over_aggregated_p50"] = (d["disagg-shared"]["ttft_ms_p50"]
                                                         / base["ttft_ms_p50"])
        save()
    if "handoff" in args.parts:
        print("handoff (one request at a time):", flush=True)
        report["handoff"] = handoff_part(params, cfg, handoff_prompts, repeats)
        report["handoff_overhead_ms_p50"] = report["handoff"]["handoff_overhead_ms_p50"]
        save()
    if "engine" in args.parts:
        print("engine over device (speculative):", flush=True)
        short = [q["tokens"] for q in held_out if q["length"] == 128]
        report["engine"] = {}
        for b in batches:  # saved after each batch: a run cut at its limit keeps the first
            report["engine"].update(engine_part(
                params, tcfg, dcfg, [s[:40] for s in short] if args.quick else short, [b],
                steps, args.decode_steps, args.graph_loops, args.graph_copies))
            report[f"engine_over_device_b{b}"] = report["engine"][f"b{b}"]["ratio"]
            save()
    if "load" in args.parts:
        print("load run through serve:", flush=True)
        def progress(load):
            report["load"] = load
            save()

        report["load"] = load_part(params, cfg, load_prompts_,
                                   8 if args.quick else args.load_requests,
                                   50.0 if args.quick else args.load_rate, new, progress,
                                   args.max_num_batched_tokens, args.load_modes,
                                   args.load_passes, args.batch_invariant)
    return report_goals(name, report, GOAL_KEYS, args.out)


if __name__ == "__main__":
    main()
