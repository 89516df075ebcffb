"""Two devices: tensor parallelism, context and generation in two processes, heterogeneous
TP, and aggregated vs data-parallel vs disaggregated serving end to end (issue 30).

    PYTHONPATH=. python benchmarks/bench_two_gpu.py --out DIR [--quick] [--scale]
        [--parts tp hetero remote e2e] [--limit PART=SECONDS ...]

Made for one host with two GPUs (the `nvidia-h200-x2` machine); on a CPU machine every
part runs as a dry run, each process with its own forced host devices
(XLA_FLAGS=--xla_force_host_platform_device_count). The embedded default pair
throughout, through public APIs only: `drafter.engine.Engine`,
`disagg.sources.disaggregated_engine`, `python -m disagg serve-remote` (through
`disagg.processes.ContextProcess`) with `disagg.remote.RemoteSource`.

Every part runs in child processes of this script, each under its own time limit
(`--limit`, defaults in LIMITS), printing its lines as it goes and saving what it has
measured after each step, so a part stopped at its limit still reports what it
finished. A child sees only its devices: CUDA_VISIBLE_DEVICES on GPUs, its own host
device count on CPU. The GPU calls are limited to 600 s, so on the GPU machine run
`--parts tp hetero remote`, then `--parts e2e`, then `--scale --parts tp`
(benchmarks/gpu_all.sh stages two_gpu, two_gpu_e2e, two_gpu_scale): each run keeps
the other parts' entries of two_gpu.json. With one GPU only, tp and hetero are
skipped and both processes of a pair share it (a dry run; `shared_gpu` says so).

  tp      one process, both devices. The held-out prompts through an Engine on one
          device and on a 2-device mesh (KV split over kv heads): `tp2_equal_tp1`
          when every request's tokens and per-step acceptance are identical. Then
          device time per speculative step (drafter.evaluate.device_rate: a jitted
          loop, no host) on both meshes, rows prefilled with the 128-token prompts:
          `tp2_over_tp1_step`. With --scale the same step-time ratio at the Qwen3-8B
          shape (drafter/shapes.py, random weights; `--scale-layers` cuts the depth)
          is measured too and becomes `tp2_over_tp1_step`. What the mesh splits by
          construction is the KV pools and attention (kv heads); the engine places
          the weights replicated on every device, so how the matmuls divide is up
          to XLA's sharding propagation.
  hetero  one process, both devices: `disaggregated_engine` with a context worker on
          the 2-device mesh (TP=2) and the generation engine on one device (TP=1):
          `hetero_tp_equal` when tokens and acceptance equal aggregated TP=1.
  remote  the context process (`serve-remote --role context`) on device 0, this
          script's generation child on device 1 with a RemoteSource (KV through
          jax.experimental.transfer, metadata through the control channel):
            - `cross_process_equal`: the held-out prompts' tokens and acceptance equal
              aggregated serving's (an Engine on device 1 in the same child);
            - handoff, one request at a time per prompt length: time to the first
              generation step's token, remote minus aggregated, minus the pull
              itself (RemoteSource's own bytes / seconds, which include its polling
              for the pull's end, 0.1 to 10 ms apart): `handoff_overhead_ms_p50`;
            - a small Poisson stream of requests through both: TTFT and tokens/s;
            - the transport alone: one process offers N bytes on device 0 and another
              pulls them onto device 1 (jax.experimental.transfer, what RemoteSource
              pulls through), against the device-to-device link (`jax.device_put` of
              the same bytes between the two devices of one process) measured right
              after: `transfer_over_link` at the largest size (goal >= 0.8).
  e2e     a prompt-heavy mixed stream (held-out prompts of 128 to 8K tokens, Poisson
          arrivals, `--e2e-new` new tokens each) served three ways: aggregated on one
          device; aggregated data-parallel on two (two processes, one device each,
          requests split by turns, started together); disaggregated, 1 context
          process + 1 generation process. Tokens/s, TTFT, and inter-token latency:
          the gaps between successive token arrivals of a request (tokens one step
          commits arrive together), p50 / p99 over every request. Disaggregation is
          expected to win on p99 inter-token latency (no prompt chunk shares a
          generation step); the figures say what it does.

Writes two_gpu.json (keys in GOAL_KEYS first). A run of some parts keeps the other
parts' entries of an existing two_gpu.json (each part says when it ran).

--quick: short prompts, few tokens and requests, small transfers; the CPU dry run
(tests/disagg/test_two_gpu_dry_run.py runs the tp and hetero equality in-process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PARTS = ("tp", "hetero", "remote", "e2e")
GOAL_KEYS = ("tp2_equal_tp1", "tp2_over_tp1_step", "hetero_tp_equal", "cross_process_equal",
             "transfer_over_link", "handoff_overhead_ms_p50", "stream_ttft_ms_p50",
             "stream_tokens_per_s", "e2e_tokens_per_s", "e2e_itl_ms_p99",
             "e2e_itl_p99_disagg_over_aggregated", "e2e_tokens_equal")
# Seconds per part. GPU: tp + hetero + remote fit one 600 s device call, e2e another
# (benchmarks/gpu_all.sh: stages two_gpu and two_gpu_e2e); CPU dry run: ample.
LIMITS = {"gpu": {"tp": 130, "hetero": 90, "remote": 300, "e2e": 540},
          "cpu": {"tp": 600, "hetero": 400, "remote": 700, "e2e": 900}}
SCALE_LIMIT_S = 540   # the tp part with --scale (run it as its own call on the GPU machine)


# ============================================================ shared helpers

def say(tag: str, message: str) -> None:
    print(f"[{tag}] {message}", flush=True)


def outputs(results) -> dict:
    """Every request's tokens and per-step acceptance (drafter.request.Result list)."""
    return {"tokens": [[int(t) for t in r.tokens] for r in results],
            "acceptance": [[int(a) for a in r.acceptance] for r in results]}


def equal_outputs(a: dict, b: dict) -> bool:
    """Request by request, the same tokens and the same per-step acceptance; two empty
    runs (nothing generated) are not equal."""
    return (bool(a["tokens"]) and all(a["tokens"]) and a["tokens"] == b["tokens"]
            and a["acceptance"] == b["acceptance"])


def first_difference(a: dict, b: dict) -> str | None:
    """Where two runs first differ, in words (None: they do not)."""
    if len(a["tokens"]) != len(b["tokens"]):
        return f"{len(a['tokens'])} vs {len(b['tokens'])} requests"
    for i, (ta, tb, aa, ab) in enumerate(zip(a["tokens"], b["tokens"], a["acceptance"],
                                             b["acceptance"])):
        if ta != tb:
            k = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            return f"request {i}: tokens differ at {k} ({ta[k:k + 4]} vs {tb[k:k + 4]})"
        if aa != ab:
            return f"request {i}: acceptance {aa} vs {ab}"
    return None


def pct(values, q) -> float | None:
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else None


def held_out(quick: bool) -> dict:
    """{length: [prompts]} of the shipped held-out prompts; --quick: the first two,
    cut to 48 tokens."""
    from drafter.default import load_prompts
    by_len: dict[int, list] = {}
    for q in load_prompts():
        by_len.setdefault(q["length"], []).append(q["tokens"])
    if quick:
        return {48: [p[:48] for p in by_len[min(by_len)][:2]]}
    return by_len


def equality_prompts(quick: bool) -> list:
    """Two prompts of 128 and two of 512 tokens (--quick: two of 48)."""
    by_len = held_out(quick)
    return [p for n in sorted(by_len)[:2] for p in by_len[n][:2]]


def pair_source(quick: bool, num_slots: int | None = None):
    """The worker processes' pair and cache (both sides build the same one)."""
    from disagg.processes import PairSource
    if quick:
        return PairSource(None, num_slots=num_slots or 4, max_seq_len=512, kv_memory_mib=64)
    return PairSource(None, num_slots=num_slots or 16, max_seq_len=9216, kv_memory_mib=1024)


def meshes(n: int) -> list:
    """Meshes over the first 1..n devices ("tp" axis)."""
    import jax
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"this part needs {n} devices, the process sees {len(devices)} "
                         f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})")
    return [jax.sharding.Mesh(np.array(devices[:k]), ("tp",)) for k in range(1, n + 1)]


# ============================================================ part 1: tensor parallelism

def tp_equality(params, cfg, prompts, max_new: int, tag: str = "tp") -> dict:
    """The prompts on one device and on a 2-device mesh: outputs of both, and whether
    they are identical."""
    from drafter.engine import Engine
    mesh1, mesh2 = meshes(2)
    runs, pool_devices = {}, {}
    for name, mesh in (("tp1", mesh1), ("tp2", mesh2)):
        start = time.perf_counter()
        engine = Engine(params, cfg, mesh=mesh)
        runs[name] = outputs(engine.generate(prompts, max_new))
        pool_devices[name] = len(engine.state.kv.pools[0].sharding.device_set)
        al = np.mean([a for r in runs[name]["acceptance"] for a in r])
        say(tag, f"{name}: {len(prompts)} prompts x {max_new} new tokens, AL {al:.2f}, KV "
                 f"pools over {pool_devices[name]} device(s) "
                 f"({time.perf_counter() - start:.1f} s, compiles included)")
    diff = first_difference(runs["tp1"], runs["tp2"])
    equal = equal_outputs(runs["tp1"], runs["tp2"])
    say(tag, f"tp2_equal_tp1 = {equal}" + (f" ({diff})" if diff else ""))
    return {**runs, "tp2_equal_tp1": equal, "difference": diff, "pool_devices": pool_devices}


def step_ms(params, cfg, prompts, batch: int, mesh, steps: int, repeats: int,
            room: int | None = None) -> dict:
    """Device time per speculative step (drafter.evaluate.device_rate) of an Engine on
    `mesh` whose `batch` rows hold the prompts (cycled), prefilled."""
    import jax
    from drafter.engine import Engine
    from drafter.evaluate import device_rate
    engine = Engine(params, cfg, mesh=mesh)
    room = room or (steps * (repeats + 1) + 4) * cfg.block_size + 64
    for i in range(batch):
        engine.add_request(f"r{i}", prompts[i % len(prompts)], room, ignore_eos=True)
    engine.prefill_submitted()
    with jax.set_mesh(mesh):   # the kernels run per device, as the engine's steps do
        rate = device_rate(engine, steps, repeats)
    del engine
    return rate


def tp_step_ratio(params, cfg, prompts, batch: int, steps: int, repeats: int, *,
                  tag: str, sink, key: str, room: int | None = None, meta=None) -> dict:
    """Device step time on one device and on the 2-device mesh, saved into sink[key]
    as each is measured; their ratio."""
    out = sink[key] = {"batch": batch, **(meta or {})}
    for name, mesh in zip(("tp1", "tp2"), meshes(2)):
        out[name] = step_ms(params, cfg, prompts, batch, mesh, steps, repeats, room)
        say(tag, f"{key} {name}: {out[name]['device_step_ms']:.3f} ms per step, "
                 f"{out[name]['tokens_per_step']:.2f} tokens per step")
        sink.save()
    out["tp2_over_tp1"] = out["tp2"]["device_step_ms"] / out["tp1"]["device_step_ms"]
    sink.save()
    say(tag, f"{key}: tp2 / tp1 step time = {out['tp2_over_tp1']:.3f}")
    return out


def child_tp(spec: dict, sink) -> None:
    quick = spec["quick"]
    params, cfg = pair_source(quick).load()
    prompts = equality_prompts(quick)
    max_new = 8 if quick else 64
    sink.update(tp_equality(params, cfg, prompts, max_new))
    if sink["tp2_equal_tp1"]:   # the outputs are kept where they differ
        sink["tokens_per_request"] = [len(t) for t in sink.pop("tp1")["tokens"]]
        sink.pop("tp2")
    sink.save()
    short = held_out(quick)[min(held_out(quick))]
    steps, repeats = (2, 1) if quick else (32, 3)
    for batch in ([1] if quick else [1, 16]):
        cfg_b = pair_source(quick, num_slots=batch).load()[1]
        tp_step_ratio(params, cfg_b, short, batch, steps, repeats, tag="tp", sink=sink,
                      key=f"default_pair_b{batch}")
    if spec.get("scale"):
        scale_step_ratio(spec["scale"], sink)


def scale_step_ratio(scale: dict, sink) -> None:
    """tp2 / tp1 device step time at the Qwen3-8B shape (random bf16 weights, fp8
    target KV, bf16 draft KV), batch 1, `context`-token rows."""
    from benchmarks.bench_scale import step_config
    from drafter.shapes import qwen3_8b_pair, random_params
    layers = scale["layers"]
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=layers,
                               num_draft_layers=5 if layers >= 8 else 1,
                               **({"vocab_size": scale["vocab"]} if scale.get("vocab") else {}))
    params = random_params(tcfg, dcfg)
    cfg = step_config(tcfg, dcfg, 1, scale["context"], scale.get("layer_loop", "auto"))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, min(150_000, tcfg.vocab_size - 1), scale["context"]).tolist()
    loop = "scan" if cfg.scans_layers else "unrolled"
    say("tp", f"Qwen3-8B shape: {layers} target layers, context {scale['context']}, "
              f"layers {loop}")
    tp_step_ratio(params, cfg, [prompt], 1, scale["steps"], 3, tag="tp", sink=sink,
                  key="qwen3_8b", room=min(768, cfg.spec.max_seq_len - scale["context"]),
                  meta={"layers": layers, "context": scale["context"], "layer_loop": loop})


# ============================================================ part 3: heterogeneous TP

def hetero_equality(params, cfg, prompts, max_new: int, reference: dict | None = None,
                    tag: str = "hetero") -> dict:
    """Context TP=2 (both devices) into generation TP=1 (device 0), in one process,
    against aggregated TP=1 on device 0 (`reference`: its outputs, if already run)."""
    from disagg.sources import disaggregated_engine
    from drafter.engine import Engine
    mesh1, mesh2 = meshes(2)
    start = time.perf_counter()
    if reference is None:
        reference = outputs(Engine(params, cfg, mesh=mesh1).generate(prompts, max_new))
        say(tag, f"aggregated tp1: {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
    engine = disaggregated_engine(params, cfg, context_meshes=(mesh2,), mesh=mesh1)
    got = outputs(engine.generate(prompts, max_new))
    moved = engine.kv_source.bytes_moved
    context_devices = len(engine.kv_source.contexts[0].engine.state.kv.pools[0]
                          .sharding.device_set)
    diff = first_difference(reference, got)
    equal = equal_outputs(reference, got)
    say(tag, f"context tp2 -> generation tp1: {len(prompts)} prompts, {moved} KV bytes "
             f"moved ({time.perf_counter() - start:.1f} s); hetero_tp_equal = {equal}"
             + (f" ({diff})" if diff else ""))
    engine.kv_source.close()
    return {"aggregated_tp1": reference, "context_tp2_generation_tp1": got,
            "hetero_tp_equal": equal, "difference": diff, "kv_bytes_moved": moved,
            "context_pool_devices": context_devices,
            "generation_pool_devices": len(engine.state.kv.pools[0].sharding.device_set)}


def child_hetero(spec: dict, sink) -> None:
    quick = spec["quick"]
    params, cfg = pair_source(quick).load()
    sink.update(hetero_equality(params, cfg, equality_prompts(quick), 8 if quick else 64))
    if sink["hetero_tp_equal"]:   # the outputs are kept where they differ
        sink["tokens_per_request"] = [len(t) for t in sink.pop("aggregated_tp1")["tokens"]]
        sink.pop("context_tp2_generation_tp1")
    sink.save()


# ============================================================ streams of requests

def make_stream(prompts_by_len: dict, weights: dict, num: int, rate: float, max_new: int,
                seed: int, prefix: str) -> list[dict]:
    """`num` requests, prompt lengths drawn by `weights`, Poisson arrivals at `rate`/s."""
    rng = np.random.default_rng(seed)
    lengths = sorted(weights)
    p = np.asarray([weights[n] for n in lengths], float)
    times = np.cumsum(rng.exponential(1.0 / rate, num))
    stream = []
    for i in range(num):
        n = lengths[rng.choice(len(lengths), p=p / p.sum())]
        prompt = prompts_by_len[n][rng.integers(len(prompts_by_len[n]))]
        stream.append({"id": f"{prefix}{i}", "tokens": prompt, "max_new": max_new,
                       "arrival_s": float(times[i] - times[0])})
    return stream


def warm_stream(engine, stream: list[dict]) -> None:
    """Compile what the stream will run: each prompt length in bursts of 1, 2, 4, ...
    requests (KV exports and imports compile per page bucket and power-of-two row
    count), every pair and triple of lengths together (an export's shape also follows
    the prefill step's row count), decode at every table width the stream reaches,
    then the stream itself once, untimed (prefill chunks batched with decode rows as
    its arrivals mix them)."""
    import itertools
    distinct = list({len(r["tokens"]): r["tokens"] for r in stream}.values())
    for prompt in distinct:
        k = 1
        while k <= engine.spec.num_slots:
            engine.generate([prompt] * k, 2, ignore_eos=True)
            k *= 2
    for n in (2, 3):
        for group in itertools.combinations(distinct, n):
            engine.generate(list(group), 2, ignore_eos=True)
    engine.generate(distinct, 4, ignore_eos=True)
    engine.warmup(max(len(r["tokens"]) + r["max_new"] for r in stream)
                  + 4 * engine.cfg.block_size)
    run_stream(engine, [{**r, "id": f"warm-{r['id']}"} for r in stream])


def run_stream(engine, stream: list[dict]) -> dict:
    """Submit each request at its arrival time (seconds from the start), step until all
    have ended; every request's tokens, acceptance and token arrival times."""
    from disagg.compile_cache import CompileCounter
    pending = sorted(stream, key=lambda r: r["arrival_s"])
    results, i = {}, 0
    counter = CompileCounter()
    started_at = time.time()
    start = time.perf_counter()
    while i < len(pending) or engine.has_work:
        now = time.perf_counter() - start
        while i < len(pending) and pending[i]["arrival_s"] <= now:
            r = pending[i]
            engine.submit(engine.make_request(r["id"], r["tokens"], max_new_tokens=r["max_new"],
                                              ignore_eos=True))
            i += 1
        if engine.has_work:
            for result in engine.step():
                results[result.request_id] = result
        elif i < len(pending):
            time.sleep(min(0.002, max(0.0, pending[i]["arrival_s"] - now)))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "started_at": started_at, "ended_at": time.time(),
            "programs_compiled": counter.compiled,
            "programs_from_cache": counter.hits, "requests": [
        {"id": r["id"], "prompt_len": len(r["tokens"]), "arrival_s": r["arrival_s"],
         **({"tokens": [int(t) for t in results[r["id"]].tokens],
             "acceptance": [int(a) for a in results[r["id"]].acceptance],
             "ttft_s": results[r["id"]].time_to_first_token_s,
             "token_times_s": list(results[r["id"]].token_times_s),
             "decode_time_s": results[r["id"]].decode_time_s,
             "finish_reason": results[r["id"]].finish_reason,
             "error": results[r["id"]].error} if r["id"] in results else
            {"finish_reason": "missing", "error": "no result"})}
        for r in stream]}


def stream_metrics(runs: list[dict]) -> dict:
    """Tokens/s, TTFT and inter-token latency of one stream served by `runs` (several:
    data-parallel engines, each serving its share over its own window)."""
    requests = [r for run in runs for r in run["requests"]]
    done = [r for r in requests if r["finish_reason"] not in ("error", "missing")]
    wall = max(run["wall_s"] for run in runs)
    gaps = [1e3 * (b - a) for r in done for a, b in zip(r["token_times_s"],
                                                        r["token_times_s"][1:]) if b > a]
    tpot = [1e3 * r["decode_time_s"] / (len(r["tokens"]) - 1) for r in done
            if len(r["tokens"]) > 1]
    ttft = [1e3 * r["ttft_s"] for r in done]
    steps = [a for r in done for a in r["acceptance"]]
    return {"requests": len(requests), "completed": len(done),
            # programs needed while timed (compiled or read from the compilation
            # cache), the context process's included: each stalls the stream
            "programs_compiled_while_timed": sum(run.get("programs_compiled", 0) +
                                                 run.get("programs_from_cache", 0) +
                                                 run.get("context_programs_compiled", 0)
                                                 for run in runs),
            "errors": [r["error"] for r in requests if r not in done][:5],
            "wall_s": wall, "tokens": sum(len(r["tokens"]) for r in done),
            "tokens_per_s": sum(len(r["tokens"]) for r in done) / wall,
            "prompt_tokens": sum(r["prompt_len"] for r in requests),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(gaps, 50), "itl_ms_p99": pct(gaps, 99),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
            "acceptance_length": float(np.mean(steps)) if steps else None}


def stream_tokens(runs: list[dict]) -> dict:
    return {r["id"]: r.get("tokens") for run in runs for r in run["requests"]}


def describe(name: str, m: dict) -> str:
    def f(x, fmt=".1f"):
        return "-" if x is None else format(x, fmt)
    return (f"{name}: {m['completed']}/{m['requests']} done, {m['tokens_per_s']:.0f} tok/s, "
            f"TTFT p50/p99 {f(m['ttft_ms_p50'])}/{f(m['ttft_ms_p99'])} ms, ITL p50/p99 "
            f"{f(m['itl_ms_p50'], '.2f')}/{f(m['itl_ms_p99'], '.2f')} ms, AL "
            f"{f(m['acceptance_length'], '.2f')}"
            + (f" ({m['programs_compiled_while_timed']} programs compiled while timed)"
               if m["programs_compiled_while_timed"] else ""))


# ============================================================ part 2: two processes

def context_process(spec: dict, log_path: Path):
    """`serve-remote --role context` on this run's context device (spec["context_env"])."""
    from disagg.processes import ContextProcess
    source = pair_source(spec["quick"], spec.get("num_slots"))
    return ContextProcess(source, log_path, tp=1, timeout=spec.get("timeout", 30.0),
                          extra_args=["--warmup"], extra_env=spec.get("context_env") or {},
                          start_timeout=spec.get("start_timeout", 300.0))


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*Compiling ")


def compiles_in_log(log_path: Path, run: dict) -> int:
    """Programs the context process compiled while `run` was timed (its log, written
    with JAX_LOG_COMPILES=1: each compile a timestamped line)."""
    count = 0
    for line in log_path.read_text(errors="replace").splitlines():
        if m := _LOG_TIME.match(line):
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            count += run["started_at"] <= t <= run["ended_at"]
    return count


def remote_engine(address: str, params, cfg, mesh, timeout: float):
    from disagg.handshake import Weights
    from disagg.kv_format import KVFormat
    from disagg.remote import RemoteSource
    from drafter.engine import Engine
    source = RemoteSource(address, KVFormat.of(cfg.spec, "shared"), weights=Weights.of(params),
                          mesh=mesh, timeout=timeout)
    return Engine(params, cfg, mesh=mesh, kv_source=source, mode="shared",
                  kv_timeout_s=source.engine_timeout_s)


def handoff_rows(agg, remote, prompts_by_len: dict, repeats: int, sink) -> list:
    """One request at a time per prompt length: TTFT, the first generation step, the pull
    (RemoteSource's bytes and seconds) and the overhead beyond it."""
    source, rows = remote.kv_source, []
    for length, prompts in sorted(prompts_by_len.items()):
        prompt = prompts[0]
        for engine in (agg, remote):
            engine.generate([prompt], 2, ignore_eos=True)   # this length's compiles
        got = {"ttft_a": [], "ttft_r": [], "first_a": [], "first_r": [], "pull": [], "bytes": []}
        for _ in range(repeats):
            a = agg.generate([prompt], 2, ignore_eos=True)[0]
            nbytes, seconds = source.bytes_pulled, source.pull_seconds
            r = remote.generate([prompt], 2, ignore_eos=True)[0]
            got["bytes"].append(source.bytes_pulled - nbytes)
            got["pull"].append(1e3 * (source.pull_seconds - seconds))
            got["ttft_a"].append(1e3 * a.time_to_first_token_s)
            got["ttft_r"].append(1e3 * r.time_to_first_token_s)
            got["first_a"].append(1e3 * a.token_times_s[1])
            got["first_r"].append(1e3 * r.token_times_s[1])
        med = {k: float(np.median(v)) for k, v in got.items()}
        row = {"prompt_tokens": length, "ttft_aggregated_ms": med["ttft_a"],
               "ttft_remote_ms": med["ttft_r"], "first_step_aggregated_ms": med["first_a"],
               "first_step_remote_ms": med["first_r"], "pull_ms": med["pull"],
               "kv_bytes": int(med["bytes"]),
               "pull_GBps": med["bytes"] / (med["pull"] / 1e3) / 1e9 if med["pull"] else None,
               "handoff_overhead_ms": med["first_r"] - med["first_a"] - med["pull"]}
        rows.append(row)
        say("remote", f"{length:>5} tokens: TTFT aggregated {row['ttft_aggregated_ms']:.2f} / "
                      f"remote {row['ttft_remote_ms']:.2f} ms; first generation step "
                      f"{row['first_step_aggregated_ms']:.2f} / {row['first_step_remote_ms']:.2f} "
                      f"ms; pull {row['kv_bytes'] / 1e6:.2f} MB in {row['pull_ms']:.3f} ms -> "
                      f"overhead beyond the pull {row['handoff_overhead_ms']:.2f} ms")
        sink["handoff"] = rows
        sink.save()
    return rows


def child_remote(spec: dict, sink) -> None:
    """Generation side on this process's device; the context a child process."""
    quick = spec["quick"]
    log = Path(spec["log_dir"]) / "two_gpu_context_remote.log"
    start = time.perf_counter()
    with context_process(spec, log) as ctx:
        say("remote", f"context process listening on {ctx.address}")
        params, cfg = pair_source(quick, spec.get("num_slots")).load()
        mesh = meshes(1)[0]
        from drafter.engine import Engine
        agg = Engine(params, cfg, mesh=mesh)
        remote = remote_engine(ctx.address, params, cfg, mesh, spec.get("timeout", 30.0))
        prompts = spec["equality_prompts"]
        max_new = spec["max_new"]
        ref = outputs(agg.generate(prompts, max_new))
        got = outputs(remote.generate(prompts, max_new))
        diff = first_difference(ref, got)
        sink["cross_process_equal"] = equal_outputs(ref, got)
        sink["difference"] = diff
        sink["acceptance_length"] = float(np.mean([a for r in got["acceptance"] for a in r]))
        sink.save()
        say("remote", f"cross_process_equal = {sink['cross_process_equal']}"
                      + (f" ({diff})" if diff else "")
                      + f" ({len(prompts)} prompts, {time.perf_counter() - start:.1f} s so far)")
        by_len = {int(k): v for k, v in spec["handoff_prompts"].items()}
        handoff_rows(agg, remote, by_len, spec["repeats"], sink)
        stream = spec["stream"]
        for name, engine in (("aggregated", agg), ("remote", remote)):
            warm_stream(engine, stream)
            run = run_stream(engine, stream)
            if name == "remote":
                run["context_programs_compiled"] = compiles_in_log(log, run)
            sink[f"stream_{name}"] = run
            sink.save()
            say("remote", "stream " + describe(name, stream_metrics([run])))
        stats = remote.kv_source.close()
        sink["context_stats_at_close"] = stats
        sink.save()


def child_bulk_offer(spec: dict, sink) -> None:
    """Offer `sizes` bytes (rounds + 1 single-use offers each) on this process's device,
    write the offers to spec["offer_file"], wait until spec["done_file"] exists."""
    import secrets
    import jax
    import jax.numpy as jnp
    from benchmarks.bench_transfer import random_array
    from disagg.wire import start_transfer_server
    server = start_transfer_server("127.0.0.1")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    arrays, offers = [], {}
    for size in spec["sizes"]:
        x = jax.block_until_ready(random_array((size,), jnp.uint8, device, 3))
        uuids = [secrets.randbits(62) for _ in range(spec["rounds"] + 1)]
        for uuid in uuids:
            server.await_pull(uuid, [x])
        arrays.append(x)
        offers[str(size)] = uuids
    Path(spec["offer_file"] + ".tmp").write_text(json.dumps(
        {"address": server.address(), "offers": offers}))
    os.replace(spec["offer_file"] + ".tmp", spec["offer_file"])
    deadline = time.monotonic() + spec["wait_s"]
    while not Path(spec["done_file"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sink["offered"] = list(offers)
    sink.save()


def child_bulk_pull(spec: dict, sink) -> None:
    """Pull each offered size onto this process's device: seconds per pull (the first
    pull of a size warms up), median of the rest."""
    import jax
    import jax.numpy as jnp
    from disagg.wire import start_transfer_server
    deadline = time.monotonic() + spec["wait_s"]
    while not Path(spec["offer_file"]).exists():
        if time.monotonic() > deadline:
            raise SystemExit("the offering process wrote no offers in time")
        time.sleep(0.05)
    offer = json.loads(Path(spec["offer_file"]).read_text())
    server = start_transfer_server("127.0.0.1")
    connection = server.connect(offer["address"])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rows = []
    for size, uuids in offer["offers"].items():
        size = int(size)
        aval = jax.ShapeDtypeStruct((size,), jnp.uint8, sharding=device)
        jax.block_until_ready(connection.pull(uuids[0], [aval]))
        seconds = []
        for uuid in uuids[1:]:
            start = time.perf_counter()
            jax.block_until_ready(connection.pull(uuid, [aval]))
            seconds.append(time.perf_counter() - start)
        row = {"bytes": size, "pull_ms": 1e3 * float(np.median(seconds)),
               "pull_ms_runs": [1e3 * s for s in seconds]}
        row["pull_GBps"] = size / (row["pull_ms"] / 1e3) / 1e9
        rows.append(row)
        say("remote", f"transport pull {size / 2**20:.1f} MiB: {row['pull_ms']:.3f} ms, "
                      f"{row['pull_GBps']:.2f} GB/s")
        sink["pulls"] = rows
        sink.save()


def child_link(spec: dict, sink) -> None:
    """The device-to-device link: one `jax.device_put` of N contiguous bytes from device
    0 to device 1 of this process (bench_transfer's timing: median of rounds)."""
    import jax
    import jax.numpy as jnp
    from benchmarks import bench_transfer
    if spec["quick"]:
        bench_transfer.TIMING.update(budget_s=0.01, repeats=2)
    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit("the link needs 2 devices in one process")
    src, dst = (jax.sharding.SingleDeviceSharding(d) for d in devices[:2])
    rows = []
    for size in spec["sizes"]:
        x = jax.block_until_ready(bench_transfer.random_array((size,), jnp.uint8, src, 7))
        ms = 1e3 * bench_transfer.median_seconds(lambda: jax.device_put(x, dst), out_bytes=size)
        rows.append({"bytes": size, "d2d_ms": ms, "d2d_GBps": size / (ms / 1e3) / 1e9})
        say("remote", f"link device 0 -> 1, {size / 2**20:.2f} MiB: {ms:.3f} ms, "
                      f"{rows[-1]['d2d_GBps']:.2f} GB/s")
        sink["link"] = rows
        sink.save()
        del x


# ============================================================ part 4: end to end

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


CHILDREN = {"tp": child_tp, "hetero": child_hetero, "remote": child_remote,
            "bulk-offer": child_bulk_offer, "bulk-pull": child_bulk_pull, "link": child_link,
            "e2e": child_e2e}


class Sink(dict):
    """A child's results, written to its result file after every step (atomically)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def save(self) -> None:
        Path(self.path + ".tmp").write_text(json.dumps(self, default=_jsonable))
        os.replace(self.path + ".tmp", self.path)


def _jsonable(x):
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def child_main(name: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    sink = Sink(result_path)
    import jax
    sink["devices"] = [str(d) for d in jax.devices()]
    sink["device_kind"] = jax.devices()[0].device_kind
    sink.save()
    CHILDREN[name](spec, sink)
    sink["finished"] = True
    sink.save()


# ============================================================ the parent

class Runner:
    """Starts children on chosen devices, each under a time limit; reads their results."""

    def __init__(self, platform: str, visible: list[str], work: Path, log_dir: Path):
        self.platform, self.visible, self.work, self.log_dir = platform, visible, work, log_dir
        self.count = 0
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                               self.env.get("PYTHONPATH")]))
        self.env["PYTHONUNBUFFERED"] = "1"
        # One compilation cache for the run's children (each GPU is its process's
        # device 0, so the data-parallel and generation processes reuse compiles).
        self.env.setdefault("JAX_COMPILATION_CACHE_DIR", str(work / "jax_cache"))
        self.env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

    @property
    def shared_gpu(self) -> bool:
        return self.platform == "gpu" and len(self.visible) < 2

    def device_env(self, devices: list[int]) -> dict:
        """The environment of a process that sees `devices` (indices 0 / 1 of the pair)."""
        if self.platform == "gpu":
            ids = [self.visible[min(d, len(self.visible) - 1)] for d in devices]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(dict.fromkeys(ids))}
            if self.shared_gpu:   # one GPU: every process gets a share of its memory
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.4"
            return env
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                       os.environ.get("XLA_FLAGS", ""))
        return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count="
                             f"{len(devices)}".strip()}

    def start(self, name: str, spec: dict, devices: list[int]):
        self.count += 1
        stem = self.work / f"{self.count:02d}-{name}"
        spec_path, result_path = f"{stem}.spec.json", f"{stem}.result.json"
        Path(spec_path).write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "benchmarks.bench_two_gpu", "--child", name,
               "--spec", spec_path, "--result", result_path]
        proc = subprocess.Popen(cmd, cwd=REPO, env={**self.env, **self.device_env(devices)},
                                start_new_session=True)
        return proc, result_path

    def wait(self, jobs: list, limit_s: float, tag: str) -> list[dict]:
        """Wait for every job until `limit_s`; one still running then is stopped with its
        children (its process group). Each job's results, with "status"."""
        deadline = time.monotonic() + max(limit_s, 1.0)
        out = []
        for proc, result_path in jobs:
            try:
                rc = proc.wait(max(0.0, deadline - time.monotonic()))
                status = "ok" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                self.stop(proc)
                status = f"stopped at its {limit_s:.0f} s limit"
            result = json.loads(Path(result_path).read_text()) if Path(result_path).exists() \
                else {}
            result["status"] = status
            if status != "ok":
                say(tag, f"child {' '.join(proc.args[3:5])}: {status}")
            out.append(result)
        return out

    def stop(self, proc) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(10)
                return
            except subprocess.TimeoutExpired:
                continue

    def run(self, name: str, spec: dict, devices: list[int], limit_s: float,
            tag: str) -> dict:
        return self.wait([self.start(name, spec, devices)], limit_s, tag)[0]


def probe() -> tuple[str, list[str]]:
    """(platform, visible GPU ids) without initialising a backend in this process."""
    code = ("import jax; d = jax.devices(); print(d[0].platform, len(d))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    if out.returncode:
        raise SystemExit(f"cannot start jax: {out.stderr[-2000:]}")
    platform, count = out.stdout.split()[-2:]
    if platform != "gpu":
        return "cpu", []
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return "gpu", visible or [str(i) for i in range(int(count))]


def part_tp(runner: Runner, args, limit: float) -> dict:
    if runner.shared_gpu:
        return {"status": "skipped: needs 2 GPUs"}
    scale = None
    if args.scale:
        scale = ({"layers": args.scale_layers or 2, "vocab": 4096, "context": 128, "steps": 2}
                 if args.quick else
                 {"layers": args.scale_layers or 36, "vocab": None, "context": 1024,
                  "steps": 8})
        scale["layer_loop"] = args.layer_loop
    return runner.run("tp", {"quick": args.quick, "scale": scale}, [0, 1], limit, "tp")


def part_hetero(runner: Runner, args, limit: float) -> dict:
    if runner.shared_gpu:
        return {"status": "skipped: needs 2 GPUs"}
    return runner.run("hetero", {"quick": args.quick}, [0, 1], limit, "hetero")


def remote_workload(quick: bool) -> dict:
    by_len = held_out(quick)
    if quick:
        stream = make_stream(by_len, {48: 1.0}, 3, 20.0, 6, seed=1, prefix="s")
        return {"equality_prompts": equality_prompts(True), "max_new": 8,
                "handoff_prompts": {48: by_len[48]}, "repeats": 1, "stream": stream}
    short = {n: v for n, v in by_len.items() if n <= 2048}
    stream = make_stream(short, {128: 0.4, 512: 0.4, 2048: 0.2}, 16, 8.0, 48, seed=1,
                         prefix="s")
    return {"equality_prompts": equality_prompts(False) + by_len[2048][:1], "max_new": 64,
            "handoff_prompts": {n: v[:1] for n, v in by_len.items()}, "repeats": 3,
            "stream": stream}


def part_remote(runner: Runner, args, limit: float) -> dict:
    start = time.monotonic()

    def left(share: float) -> float:
        return share * (limit - (time.monotonic() - start))

    spec = {"quick": args.quick, "log_dir": str(runner.log_dir), "timeout": 30.0,
            "context_env": {**runner.device_env([0]), "JAX_LOG_COMPILES": "1"},
            **remote_workload(args.quick)}
    say("remote", f"context process on device 0, generation process on device 1 "
                  f"({len(spec['equality_prompts'])} equality prompts, handoff at "
                  f"{sorted(spec['handoff_prompts'])} tokens, a stream of "
                  f"{len(spec['stream'])} requests)")
    out = {"serving": runner.run("remote", spec, [1], left(0.7), "remote")}
    sizes = [1 << 20, 4 << 20] if args.quick else [64 << 20, 256 << 20, 1 << 30]
    files = {"offer_file": str(runner.work / "offer.json"),
             "done_file": str(runner.work / "pulled")}
    budget = left(0.5)
    offer = runner.start("bulk-offer", {"sizes": sizes, "rounds": 3, "wait_s": budget,
                                        **files}, [0])
    pulled = runner.run("bulk-pull", {"wait_s": budget, **files}, [1], budget, "remote")
    Path(files["done_file"]).touch()
    runner.wait([offer], 30.0, "remote")
    out["transport"] = pulled
    serving_bytes = [r["kv_bytes"] for r in out["serving"].get("handoff", []) if r["kv_bytes"]]
    link_sizes = sizes + sorted(set(serving_bytes))
    if runner.shared_gpu:
        out["link"] = {"status": "skipped: needs 2 GPUs"}
    else:
        out["link"] = runner.run("link", {"quick": args.quick, "sizes": link_sizes}, [0, 1],
                                 left(1.0), "remote")
    return out


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


def goals(parts: dict) -> dict:
    """The goal keys from whichever parts ran (those missing are left out)."""
    g = {}
    tp = parts.get("tp", {})
    if "tp2_equal_tp1" in tp:
        g["tp2_equal_tp1"] = tp["tp2_equal_tp1"]
    scale = tp.get("qwen3_8b", {})
    if "tp2_over_tp1" in scale:
        g["tp2_over_tp1_step"] = scale["tp2_over_tp1"]
        g["tp2_over_tp1_step_shape"] = f"Qwen3-8B shape, {scale['layers']} layers, batch 1"
    elif "tp2_over_tp1" in tp.get("default_pair_b1", {}):
        g["tp2_over_tp1_step"] = tp["default_pair_b1"]["tp2_over_tp1"]
        g["tp2_over_tp1_step_shape"] = "embedded default pair, batch 1"
    if "hetero_tp_equal" in parts.get("hetero", {}):
        g["hetero_tp_equal"] = parts["hetero"]["hetero_tp_equal"]
    remote = parts.get("remote", {})
    serving = remote.get("serving", {})
    if "cross_process_equal" in serving:
        g["cross_process_equal"] = serving["cross_process_equal"]
    pulls = remote.get("transport", {}).get("pulls", [])
    link = {r["bytes"]: r for r in remote.get("link", {}).get("link", [])}
    if pulls and pulls[-1]["bytes"] in link:
        biggest = pulls[-1]
        g["transfer_over_link"] = link[biggest["bytes"]]["d2d_ms"] / biggest["pull_ms"]
        g["transfer_over_link_bytes"] = biggest["bytes"]
    rows = serving.get("handoff", [])
    if rows:
        g["handoff_overhead_ms_p50"] = float(np.median([r["handoff_overhead_ms"]
                                                        for r in rows]))
    m = serving.get("stream_remote_metrics") or (
        stream_metrics([serving["stream_remote"]]) if "stream_remote" in serving else None)
    if m:
        g["stream_ttft_ms_p50"], g["stream_tokens_per_s"] = m["ttft_ms_p50"], m["tokens_per_s"]
    e2e = parts.get("e2e", {})
    modes = [m for m in ("aggregated", "data_parallel", "disaggregated")
             if "tokens_per_s" in e2e.get(m, {})]
    if modes:
        g["e2e_tokens_per_s"] = {m: e2e[m]["tokens_per_s"] for m in modes}
        g["e2e_itl_ms_p99"] = {m: e2e[m]["itl_ms_p99"] for m in modes}
        if {"aggregated", "disaggregated"} <= set(modes) and e2e["aggregated"]["itl_ms_p99"]:
            g["e2e_itl_p99_disagg_over_aggregated"] = (e2e["disaggregated"]["itl_ms_p99"]
                                                       / e2e["aggregated"]["itl_ms_p99"])
    if "tokens_equal_across_modes" in e2e:
        g["e2e_tokens_equal"] = e2e["tokens_equal_across_modes"]
    return g


def summarise_remote(out: dict) -> dict:
    """Stream metrics and the link comparison in the report (raw streams dropped)."""
    serving = out.get("serving", {})
    for name in ("aggregated", "remote"):
        run = serving.pop(f"stream_{name}", None)
        if run is not None:
            serving[f"stream_{name}_metrics"] = stream_metrics([run])
            serving.setdefault("_streams", {})[name] = stream_tokens([run])
    streams = serving.pop("_streams", {})
    if len(streams) == 2:
        serving["stream_tokens_equal"] = streams["aggregated"] == streams["remote"]
    link = {r["bytes"]: r for r in out.get("link", {}).get("link", [])}
    for r in out.get("transport", {}).get("pulls", []):
        if r["bytes"] in link:
            r["over_link"] = link[r["bytes"]]["d2d_ms"] / r["pull_ms"]
    for r in serving.get("handoff", []):
        if r["kv_bytes"] in link and r["pull_ms"]:
            r["pull_over_link"] = link[r["kv_bytes"]]["d2d_ms"] / r["pull_ms"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for two_gpu.json")
    ap.add_argument("--quick", action="store_true", help="the CPU dry run's small sizes")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--scale", action="store_true",
                    help="tp: also the step-time ratio at the Qwen3-8B shape")
    ap.add_argument("--scale-layers", type=int, default=None,
                    help="target layers at --scale (default 36; --quick: 2)")
    ap.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"))
    ap.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS",
                    help="a part's time limit (default: LIMITS; tp with --scale: "
                         f"{SCALE_LIMIT_S})")
    ap.add_argument("--e2e-requests", type=int, default=None)
    ap.add_argument("--e2e-rate", type=float, default=None, help="arrivals per second")
    ap.add_argument("--e2e-new", type=int, default=None, help="new tokens per request")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child, args.spec, args.result)

    platform, visible = probe()
    limits = dict(LIMITS[platform])
    if args.scale:
        limits["tp"] = SCALE_LIMIT_S
    for item in args.limit:
        part, _, seconds = item.partition("=")
        if part not in PARTS or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(f"--limit {item!r}: give PART=SECONDS with PART in {PARTS}")
        limits[part] = float(seconds)
    work = Path(tempfile.mkdtemp(prefix="two_gpu-"))
    log_dir = Path(args.out) if args.out else work
    log_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(platform, visible, work, log_dir)
    say("two_gpu", f"platform {platform}"
                   + (f", GPUs {visible}" if platform == "gpu" else ", forced host devices")
                   + (" (one GPU: both processes share it; tp and hetero skipped)"
                      if runner.shared_gpu else "")
                   + f"; parts {args.parts}; limits {[limits[p] for p in args.parts]} s")
    run = {"tp": part_tp, "hetero": part_hetero, "remote": part_remote, "e2e": part_e2e}
    parts = {}
    for name in args.parts:
        start = time.monotonic()
        say(name, f"--- part {name} (limit {limits[name]:.0f} s)")
        try:
            parts[name] = run[name](runner, args, limits[name])
        except Exception as e:   # noqa: BLE001 - one part's failure does not lose the others
            parts[name] = {"status": f"failed: {type(e).__name__}: {e}"}
            say(name, parts[name]["status"])
        if name == "remote":
            summarise_remote(parts[name])
        parts[name]["seconds"] = time.monotonic() - start
        parts[name]["finished_at"] = datetime.datetime.now().isoformat(timespec="seconds")
        parts[name]["quick"] = args.quick
        say(name, f"--- part {name} done in {parts[name]['seconds']:.0f} s")
    import shutil
    shutil.rmtree(work, ignore_errors=True)   # the children's specs, results, compile cache
    previous = {}
    if args.out and (Path(args.out) / "two_gpu.json").exists():
        previous = json.loads((Path(args.out) / "two_gpu.json").read_text()).get("parts", {})
    merged = {**{k: v for k, v in previous.items() if k not in parts}, **parts}
    report = {**goals(merged), "platform": platform, "gpus": visible,
              "shared_gpu": runner.shared_gpu, "parts": merged}
    from benchmarks.timing import report_goals
    return report_goals("two_gpu", report, GOAL_KEYS, args.out)


if __name__ == "__main__":
    main()
