"""Throwaway: 8B-shaped prefill tokens/s with the head at each row's last position (the
build) beside the head over every chunk position (at_index patched to the identity: the
same work as before, tokens unused), same process."""
import sys, time
import jax
import numpy as np
import drafter.steps as steps
from benchmarks.bench_scale import step_config
from drafter.engine import Engine
from drafter.shapes import qwen3_8b_pair, random_params
from models.layers import step_params

quick = "--quick" in sys.argv
tcfg, dcfg = qwen3_8b_pair(num_target_layers=2 if quick else 36, num_draft_layers=1 if quick else 5,
                           **({"vocab_size": 4096} if quick else {}))
real_at = steps.at_index
for batch, context in (((1, 512), (2, 256)) if quick else ((1, 8192), (8, 1024))):
    probe = step_config(tcfg, None, batch, context, "scan")
    params = {"target": step_params(random_params(tcfg, dcfg), probe.scans_layers)["target"]} \
        if batch == 1 else params
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tcfg.vocab_size - 8, context).tolist() for _ in range(batch)]
    for rnd in range(2):
        for name, at in (("last position", real_at), ("every position", lambda x, i: x)):
            steps.at_index = at
            jax.clear_caches()  # the step programs are cached by config
            eng = Engine(params, step_config(tcfg, None, batch, context, "scan"),
                         speculative=False)
            times = []
            for r in range(3):
                start = time.perf_counter()
                for i in range(batch):
                    eng.add_request(f"{r}-{i}", prompts[i], 4)
                eng.prefill_submitted()
                times.append(time.perf_counter() - start)
                for i in range(batch):
                    eng.cancel(f"{r}-{i}")
                eng.run()
            warm = min(times[1:])
            print(f"round {rnd} b{batch} ctx{context} head at {name}: cold {times[0]:.1f} s, "
                  f"warm {warm*1e3:.1f} ms, {batch*context/warm:.0f} tok/s", flush=True)
            del eng
