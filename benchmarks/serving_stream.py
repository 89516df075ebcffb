"""Engines per serving mode, and a request stream through `serve` (bench_serving's load
part): arrivals as a Poisson stream into `serve`'s JSON-line loop through a pipe, and
answers compared request by request across passes and modes."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import threading
import time

import numpy as np

from benchmarks.timing import counting_compiles
from disagg.serving import serve_json_lines
from disagg.sources import disaggregated_engine
from drafter.corpus import ByteTokenizer
from drafter.engine import Engine


# context worker processes of "-process" engines, by engine id: `close` stops them
_CHILDREN: dict = {}


# bench_serving's demo workload: the held-out prompts of at most 512 tokens (the first
# six), 48 new tokens each
DEMO_NEW_TOKENS = 48


def demo_prompts(held_out) -> list:
    """The demo workload's prompts (token ids) from `drafter.default.load_prompts()`."""
    return [q["tokens"] for q in held_out if q["length"] <= 512][:6]


def make_engine(mode: str, params, cfg, **engine_kwargs) -> Engine:
    """aggregated; disagg-{shared,private}[-threaded]: a context engine in this process
    (`disagg.sources`); disagg-shared-process: a context worker in a child process on
    this machine's devices (the embedded pair, `serve-remote --role context`), its KV
    pulled through `jax.experimental.transfer`, so the two host loops run apart."""
    if mode == "aggregated":
        return Engine(params, cfg, **engine_kwargs)
    if mode == "disagg-shared-process":
        return _process_pair_engine(params, cfg, **engine_kwargs)
    return disaggregated_engine(params, cfg, mode=mode.split("-")[1],
                                threaded=mode.endswith("-threaded"), **engine_kwargs)


def _process_pair_engine(params, cfg, **engine_kwargs) -> Engine:
    import tempfile
    from benchmarks.two_gpu.cross_process import remote_engine
    from disagg.processes import ContextProcess, PairSource
    log = tempfile.NamedTemporaryFile(prefix="context_worker_", suffix=".log", delete=False)
    child = ContextProcess(PairSource(None, num_slots=cfg.spec.num_slots), log.name,
                           start_timeout=300.0)
    try:
        engine = remote_engine(child.address, params, cfg, None, 30.0, **engine_kwargs)
    except BaseException:
        child.stop()
        raise
    _CHILDREN[id(engine)] = child
    return engine


def close(engine: Engine) -> None:
    """Stop a threaded source's context threads, and a context worker process."""
    if engine.kv_source is not None:
        engine.kv_source.close()
    if (child := _CHILDREN.pop(id(engine), None)) is not None:
        child.stop()


def p(values, q) -> float:
    return float(np.percentile(np.asarray(values, float), q))


def stream_lines(write_fd: int, lines, gaps) -> None:
    with os.fdopen(write_fd, "w") as pipe:
        for line, gap in zip(lines, gaps):
            time.sleep(gap)
            pipe.write(line + "\n")
            pipe.flush()


def serve_stream(engine, lines, gaps) -> tuple[int, io.StringIO]:
    """`lines` into `serve_json_lines` through a pipe, `gaps` seconds apart: (errors,
    the answers' JSON lines)."""
    read_fd, write_fd = os.pipe()
    writer = threading.Thread(target=stream_lines, args=(write_fd, lines, gaps))
    buf = io.StringIO()
    writer.start()
    errors = serve_json_lines(engine, f"/dev/fd/{read_fd}", ByteTokenizer(), out=buf)
    writer.join()
    os.close(read_fd)
    return errors, buf


LOAD_MODES = ("aggregated", "disagg-shared")


def digests(tokens: dict) -> dict:
    """Per request id, a short digest of its tokens: runs compare request by request."""
    return {rid: hashlib.sha256(json.dumps(t).encode()).hexdigest()[:12]
            for rid, t in sorted(tokens.items())}


def differing(a: dict, b: dict) -> int:
    return sum(a.get(rid) != b.get(rid) for rid in set(a) | set(b))


def load_part(params, cfg, prompts, num_requests: int, rate: float, max_new: int,
              progress=lambda out: None, max_num_batched_tokens: int | None = None,
              modes=LOAD_MODES, passes: int = 1, batch_invariant: bool = False) -> dict:
    """`progress(out)` after each mode: what is measured so far. Figures are the first
    pass's; later passes of the same stream on the same engine count the requests whose
    answers changed (`requests_differing_between_passes`: the stream's batches form by
    arrival timing, and a GPU's sums differ with batch shape). `requests_differing`
    compares the modes request by request when both ran; `request_digests` lets runs of
    one mode each compare too. `batch_invariant`: the engines' (Engine), which makes a
    request's answer independent of its batches."""
    rng = np.random.default_rng(0)
    chosen = [prompts[i % len(prompts)] for i in rng.permutation(num_requests)]
    lines = [json.dumps({"id": f"q{i}", "tokens": prompt, "max_new_tokens": max_new})
             for i, prompt in enumerate(chosen)]
    gaps = rng.exponential(1.0 / rate, num_requests)
    out, tokens = {}, {}
    for mode in modes:
        engine = make_engine(mode, params, cfg, max_num_batched_tokens=max_num_batched_tokens,
                             batch_invariant=batch_invariant)
        start = time.perf_counter()
        engine.warmup()
        warmup_s = time.perf_counter() - start
        with counting_compiles() as compiled:
            start = time.perf_counter()
            errors, buf = serve_stream(engine, lines, gaps)
            seconds = time.perf_counter() - start
        answers = [json.loads(l) for l in buf.getvalue().splitlines()]
        done = [a for a in answers if "tokens" in a]
        tokens[mode] = digests({a["id"]: a["tokens"] for a in done})
        changed = []
        for _ in range(passes - 1):
            again = [json.loads(l) for l in serve_stream(engine, lines, gaps)[1].getvalue()
                     .splitlines()]
            changed.append(differing(tokens[mode], digests(
                {a["id"]: a["tokens"] for a in again if "tokens" in a})))
        ttft = [1e3 * a["time_to_first_token_s"] for a in done]
        itl = [1e3 * a["decode_time_s"] / (len(a["tokens"]) - 1) for a in done
               if len(a["tokens"]) > 1]
        out[mode] = {"requests": num_requests, "completed": len(done), "errors": errors,
                     "seconds": seconds,
                     "tokens_per_s": sum(len(a["tokens"]) for a in done) / seconds,
                     "ttft_ms_p50": p(ttft, 50), "ttft_ms_p99": p(ttft, 99),
                     "itl_ms_p50": p(itl, 50), "itl_ms_p99": p(itl, 99),
                     "warmup_s": warmup_s,
                     "compiles": sorted(collections.Counter(compiled).items()),
                     "requests_differing_between_passes": changed,
                     "request_digests": tokens[mode]}
        print(f"  {mode:>14}: {len(done)}/{num_requests} done, "
              f"{out[mode]['tokens_per_s']:.0f} tok/s, TTFT p50/p99 "
              f"{out[mode]['ttft_ms_p50']:.0f}/{out[mode]['ttft_ms_p99']:.0f} ms, ITL p50/p99 "
              f"{out[mode]['itl_ms_p50']:.2f}/{out[mode]['itl_ms_p99']:.2f} ms; warm-up "
              f"{warmup_s:.0f} s, {len(compiled)} compiles during the stream; requests whose "
              f"answer changed in later passes: {changed}", flush=True)
        progress(out)
    if set(LOAD_MODES) <= set(tokens):
        out["requests_differing"] = differing(tokens["aggregated"], tokens["disagg-shared"])
    out["prompt_tokens"] = sorted({len(x) for x in prompts})
    out["arrival_rate_per_s"] = rate
    out["max_num_batched_tokens"] = engine.scheduler.budget
    out["batch_invariant"] = batch_invariant
    return out
