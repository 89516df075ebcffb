"""Part e2e of the two-GPU benchmark: a prompt-heavy mixed stream served aggregated on
one device, data-parallel on two, and disaggregated (1 context + 1 generation process)."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.two_gpu.common import held_out, meshes, pair_source, say
from benchmarks.two_gpu.cross_process import compiles_in_log, context_process, remote_engine
from benchmarks.two_gpu.runner import Runner
from benchmarks.two_gpu.streams import (describe, make_stream, run_stream, stream_metrics,
                                        stream_tokens, warm_stream)


def child_e2e(spec: dict, sink) -> None:
    """One serving process of the e2e comparison: aggregated on this process's device,
    or the generation side of a remote pair (the context a child process)."""
    quick, mode, label = spec["quick"], spec["mode"], spec["label"]
    stream = spec["stream"]
    ctx, log = None, Path(spec["log_dir"]) / f"two_gpu_context_{label}.log"
    try:
        if mode == "remote":
            ctx = context_process(spec, log)
        params, cfg = pair_source(quick, spec.get("num_slots")).load()
        mesh = meshes(1)[0]
        if mode == "remote":
            engine = remote_engine(ctx.address, params, cfg, mesh, spec.get("timeout", 30.0))
        else:
            from drafter.engine import Engine
            engine = Engine(params, cfg, mesh=mesh)
        start = time.perf_counter()
        warm_stream(engine, stream)
        say("e2e", f"{label}: compiled in {time.perf_counter() - start:.1f} s "
                   f"({len(stream)} requests to serve)")
        barrier(spec.get("barrier"), label)
        run = run_stream(engine, stream)
        if mode == "remote":
            run["context_programs_compiled"] = compiles_in_log(log, run)
        sink["run"] = run
        sink.save()
        say("e2e", describe(label, stream_metrics([run])))
        if mode == "remote":
            engine.kv_source.close()
    finally:
        if ctx is not None:
            ctx.stop()


def barrier(spec: dict | None, label: str, timeout: float = 300.0) -> None:
    """Wait until every process of a group is ready (data parallel: both start together)."""
    if not spec:
        return
    folder = Path(spec["dir"])
    (folder / f"ready-{label}").touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("ready-*"))) < spec["count"]:
        if time.monotonic() > deadline:
            say("e2e", f"{label}: the other process was not ready within {timeout:.0f} s; "
                       f"starting alone")
            return
        time.sleep(0.01)


# ============================================================ the parent's side

def e2e_workload(quick: bool, num: int, rate: float, max_new: int) -> list[dict]:
    by_len = held_out(quick)
    if quick:
        base = by_len[48]
        cut = {n: [p[:n] for p in base] for n in (16, 32, 48)}
        return make_stream(cut, {16: 0.3, 32: 0.3, 48: 0.4}, num, rate, max_new, seed=2,
                           prefix="e")
    return make_stream(by_len, {128: 0.2, 512: 0.3, 2048: 0.3, 8192: 0.2}, num, rate,
                       max_new, seed=2, prefix="e")


def part_e2e(runner: Runner, args, limit: float) -> dict:
    start = time.monotonic()
    num = args.e2e_requests or (6 if args.quick else 160)
    rate = args.e2e_rate or (20.0 if args.quick else 20.0)
    max_new = args.e2e_new or (6 if args.quick else 48)
    stream = e2e_workload(args.quick, num, rate, max_new)
    prompt_tokens = sum(len(r["tokens"]) for r in stream)
    say("e2e", f"{num} requests, Poisson at {rate:g}/s, {prompt_tokens} prompt tokens, "
               f"{num * max_new} new tokens ({prompt_tokens / (num * max_new):.0f}:1)")
    base = {"quick": args.quick, "log_dir": str(runner.log_dir), "timeout": 30.0}
    out = {"workload": {"requests": num, "rate_per_s": rate, "max_new": max_new,
                        "prompt_tokens": prompt_tokens,
                        "prompt_lengths": sorted({len(r["tokens"]) for r in stream})}}
    runs = {}

    def left(share: float) -> float:
        return share * (limit - (time.monotonic() - start))

    runs["aggregated"] = [runner.run("e2e", {**base, "mode": "aggregated", "label": "aggregated",
                                             "stream": stream}, [0], left(0.3), "e2e")]
    folder = runner.work / "dp-barrier"
    folder.mkdir(exist_ok=True)
    jobs = [runner.start("e2e", {**base, "mode": "aggregated", "label": f"data-parallel-{k}",
                                 "stream": stream[k::2],
                                 "barrier": {"dir": str(folder), "count": 2}}, [k])
            for k in (0, 1)]
    runs["data_parallel"] = runner.wait(jobs, left(0.45), "e2e")
    runs["disaggregated"] = [runner.run("e2e", {**base, "mode": "remote",
                                                "label": "disaggregated", "stream": stream,
                                                "context_env": {**runner.device_env([0]),
                                                                "JAX_LOG_COMPILES": "1"}},
                                        [1], left(1.0), "e2e")]
    tokens = {}
    for mode, results in runs.items():
        done = [r["run"] for r in results if "run" in r]
        out[mode] = {"status": [r["status"] for r in results]}
        if len(done) == len(results):
            out[mode].update(stream_metrics(done))
            tokens[mode] = stream_tokens(done)
            say("e2e", describe(mode, out[mode]))
    if len(tokens) > 1:
        ref = next(iter(tokens.values()))
        out["tokens_equal_across_modes"] = all(t == ref for t in tokens.values())
    return out
