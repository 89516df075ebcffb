"""Probe (not kept): host time to launch a context worker's export call by its rows (each
row returns six arrays), beside a decode call, on the embedded pair."""
import json, os, statistics, time
import jax
from benchmarks.serving_stream import DEMO_NEW_TOKENS, demo_prompts, make_engine
from drafter.default import default_step_config, load_default, load_prompts

params, tcfg, dcfg = load_default()
cfg = default_step_config(tcfg, dcfg, num_slots=16)
prompts = demo_prompts(load_prompts())
e = make_engine("disagg-shared", params, cfg)
for _ in range(3):
    e.generate(prompts, DEMO_NEW_TOKENS)
ex = e.kv_source.contexts[0].engine.executor
dummy = cfg.spec.dummy_slot
out = {"device": jax.devices()[0].device_kind, "export": {}}
for n in (1, 2, 4, 8):
    rows = [(dummy, 128)] * n
    jax.block_until_ready([p.buffers for p in ex.export(rows)])
    launch, done = [], []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(50):
            got = ex.export(rows)
        launch.append((time.perf_counter() - t) / 50 * 1e6)
        jax.block_until_ready([p.buffers for p in got])
    out["export"][n] = {"launch_us": statistics.median(launch),
                        "outputs": sum(len(p.buffers) + 3 for p in got)}
    # the jitted call alone, its index packed once
    from drafter.kv_io import sent_logical_pages, sent_pool_ids
    from drafter.transfer_calls import pack_export_index
    pool_ids = sent_pool_ids(cfg.spec, ex.mode)
    logical = sent_logical_pages(cfg.spec, pool_ids, 128, 128)
    index = pack_export_index([(dummy, logical)] * n)
    buckets = tuple(len(p) for p in logical)
    call = lambda: ex._export(ex.state, index, pool_ids=pool_ids, buckets=buckets)
    jax.block_until_ready(call())
    launch = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(50):
            got = call()
        launch.append((time.perf_counter() - t) / 50 * 1e6)
        jax.block_until_ready(got)
    out["export"][n]["jitted_call_us"] = statistics.median(launch)
    print("export rows", n, out["export"][n], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_calls.json"), "w"), indent=1)
