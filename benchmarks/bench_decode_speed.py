"""Plain vs speculative decode speed of the embedded default pair on this device.

    PYTHONPATH=. python benchmarks/bench_decode_speed.py [--out DIR] [--batches 1 16]

For each batch size, the batch's rows are prefilled with held-out 128-token
prompts, then decoded two ways:

  device   `steps` decode steps in one jitted loop (no host in between):
           device seconds per step and tokens committed per step, so
           tokens/s = rows x tokens per step / step time
  engine   `Engine.step()` from the host, as `generate` runs it (the next
           step dispatched before the last one's outputs are read): wall
           seconds per step, split into planning + dispatch and the wait for
           the previous step's outputs

Speculative tokens per step is the acceptance length; plain commits one.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.timing import write_results
from drafter.default import load_default, load_prompts
from drafter.evaluate import device_rate, prefilled_engine


def warm_for_calls(engine, calls: int) -> None:
    """Compile what `calls` more Engine.step() calls after 3 warm ones use: the rows
    cross table-width buckets while timed, so those widths (and only those) first."""
    lens = np.asarray(engine.state.kv.target_lens)[
        [s.slot for s in engine.scheduler.active.values()]]
    longest = int(lens.max()) + (calls + 3) * engine.decode_steps * engine.cfg.block_size
    engine.warmup(longest, min_len=int(lens.min()))
    for _ in range(3):
        engine.step()
    engine.flush()


def engine_rate(engine, steps: int) -> dict:
    """Wall time of Engine.step() (the host loop, one step in flight ahead), and
    where it goes: planning + dispatch, then the wait for the previous step."""
    warm_for_calls(engine, steps)
    engine.step_times.clear()

    def committed():
        return sum(len(s.tokens) for s in engine.scheduler.active.values())

    before, start = committed(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.flush()
    wall = (time.perf_counter() - start) / steps
    tokens = (committed() - before) / steps
    dispatch, wait = np.median(np.asarray(engine.step_times), axis=0)
    return {"engine_step_ms": wall * 1e3, "engine_tokens_per_s": tokens / wall,
            "dispatch_ms": float(dispatch) * 1e3, "wait_ms": float(wait) * 1e3}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    params, tcfg, dcfg = load_default()
    prompts = [p["tokens"] for p in load_prompts() if p["length"] == 128]
    rows = []
    for batch in args.batches:
        row = {"batch": batch}
        for name, speculative in (("plain", False), ("speculative", True)):
            engine = prefilled_engine(params, tcfg, dcfg, prompts, batch, speculative)
            got = {**device_rate(engine, args.steps, args.repeats),
                   **engine_rate(engine, args.steps)}
            row.update({f"{name}_{k}": v for k, v in got.items()})
            print(f"batch {batch:>2} {name:>11}: " + "  ".join(
                f"{k} {v:.3f}" for k, v in got.items()), flush=True)
        for kind in ("device", "engine"):
            row[f"{kind}_speedup"] = (row[f"speculative_{kind}_tokens_per_s"]
                                      / row[f"plain_{kind}_tokens_per_s"])
        print(f"batch {batch:>2}: speculative / plain = {row['device_speedup']:.2f}x (device), "
              f"{row['engine_speedup']:.2f}x (engine)", flush=True)
        rows.append(row)
        write_results("decode_speed", {"rows": rows}, args.out)


if __name__ == "__main__":
    main()
