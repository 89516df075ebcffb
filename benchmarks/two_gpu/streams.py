"""Streams of requests for the two-GPU benchmark: Poisson arrivals, warming an engine
for a stream, serving it, and its tokens/s, TTFT and inter-token latency."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.two_gpu.common import pct


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
