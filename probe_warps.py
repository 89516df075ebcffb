"""Probe (not kept): the shipped Gluon kernel's fp8 decode / verify with more warps a
program (NUM_WARPS, WARPS_M patched into launch's constexprs), bit equality checked."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
import pallas_kernels.paged_attention_gluon as g
from benchmarks.bench_paged_attention import FP8, setup
from benchmarks.timing import time_alternating

VAR = {}
orig_launch = g.launch
def launch(*a, **k):
    s, cx, grid = orig_launch(*a, **k)
    return s, dict(cx, **VAR), grid
g.launch = launch

def fn_for(cx):
    def f(*a):
        VAR.clear(); VAR.update(cx)
        return g.paged_attention_gluon(*a, layer_offset=0)
    return jax.jit(f)

plans = {"decode": {"base": {}, "w4x1": dict(NUM_WARPS=4, WARPS_M=1)},
         "verify8": {"base": {}, "w4x2": dict(NUM_WARPS=4, WARPS_M=2),
                     "w8x2": dict(NUM_WARPS=8, WARPS_M=2)},
         "verify16": {"base": {}, "w8x4": dict(NUM_WARPS=8, WARPS_M=4),
                      "w8x2": dict(NUM_WARPS=8, WARPS_M=2)}}
out = {"device": jax.devices()[0].device_kind, "rows": []}
for ctx in [int(c) for c in sys.argv[1:]] or [32768]:
    q, pool, table, kv_lens, _ = setup(ctx, FP8, max_q=16)
    batch = q.shape[0]
    row, res = {"ctx": ctx}, {}
    for name, tokens in (("decode", 1), ("verify8", 8), ("verify16", 16)):
        args = (q[:, 16 - tokens:], pool, table, kv_lens, jnp.full((batch,), tokens, jnp.int32))
        fns = {}
        for v, cx in plans[name].items():
            try:
                f = fn_for(cx)
                res[(name, v)] = np.asarray(f(*args).astype(jnp.float32))
                fns[v] = f
            except Exception as e:
                print(name, v, "FAILED", str(e)[-800:], flush=True)
        for v, ms in time_alternating(fns, *args).items():
            row[f"{name}_{v}_ms"] = ms
        print(ctx, name, {k: round(x, 4) for k, x in row.items() if k.startswith(name)}, flush=True)
    for name in ("decode", "verify8", "verify16"):
        for v in plans[name]:
            if (name, v) in res:
                row[f"{name}_{v}_last_eq_decode_base"] = bool(np.array_equal(
                    res[(name, v)][:, -1], res[("decode", "base")][:, 0]))
    print(json.dumps({k: v for k, v in row.items() if k.endswith("decode_base")}), flush=True)
    out["rows"].append(row)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_warps.json"), "w"), indent=1)
