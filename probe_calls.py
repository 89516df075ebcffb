"""Probe (not kept): host time to launch a context worker's export call and a generation
worker's import call by their rows, HEAD's per-row form (probe_kv_io_old) against the
working tree's one gather / scatter / checksum a pool, and against export outputs stacked
per pool; with the optimized program's kernel count; on the embedded pair."""
import functools, json, os, re, statistics, time
import jax, jax.numpy as jnp
import probe_kv_io_old as old
from benchmarks.serving_stream import DEMO_NEW_TOKENS, demo_prompts, make_engine
from drafter import kv_io
from drafter.default import default_step_config, load_default, load_prompts
from drafter.kv_io import _physical, _split, checksum_of, sent_logical_pages, sent_pool_ids
from drafter.transfer_calls import pack_export_index, pack_import_index
from pallas_kernels.pool_layout import byte_view, from_byte_view


@functools.partial(jax.jit, static_argnames=("pool_ids", "buckets"))
def export_stacked(state, index, *, pool_ids, buckets):
    kv, slots = state.kv, index[:, 0]
    out = []
    for i, lg in zip(pool_ids, _split(index[:, 1:].T, buckets)):
        pages = jax.vmap(_physical, in_axes=(0, 1))(kv.page_tables[i][slots], lg)
        g = jnp.take(byte_view(kv.pools[i]), pages.reshape(-1), axis=1)
        out.append(from_byte_view(g.reshape(g.shape[0], len(slots), -1, *g.shape[2:]),
                                  kv.pools[i].dtype))
    sums = jnp.stack([jax.vmap(checksum_of, in_axes=1)(b) for b in out], axis=1)
    return tuple(out), sums, state.anchors[slots], state.drafts[slots]


def kernels(text):
    return {"fusions": len(re.findall(r"= \S+ fusion\(", text)),
            "custom_calls": len(re.findall(r"custom-call\(", text))}


def launch_us(call, reps=5, n=50):
    jax.block_until_ready(call())
    got, ts = None, []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            got = call()
        ts.append((time.perf_counter() - t) / n * 1e6)
        jax.block_until_ready(got)
    return statistics.median(ts)


params, tcfg, dcfg = load_default()
cfg = default_step_config(tcfg, dcfg, num_slots=16)
prompts = demo_prompts(load_prompts())
e = make_engine("disagg-shared", params, cfg)
for _ in range(3):
    e.generate(prompts, DEMO_NEW_TOKENS)
ex = e.kv_source.contexts[0].engine.executor
gx = e.executor
dummy = cfg.spec.dummy_slot
out = {"device": jax.devices()[0].device_kind, "export": {}, "import": {}}
pool_ids = sent_pool_ids(cfg.spec, ex.mode)
logical = sent_logical_pages(cfg.spec, pool_ids, 128, 128)
buckets = tuple(len(p) for p in logical)
static = dict(pool_ids=pool_ids, buckets=buckets)
for n in (1, 2, 4, 8):
    index = pack_export_index([(dummy, logical)] * n)
    fns = {"old": old.export_step, "new": kv_io.export_step, "stacked": export_stacked}
    r = out["export"][n] = {k: launch_us(lambda f=f: f(ex.state, index, **static))
                            for k, f in fns.items()}
    a, b = old.export_step(ex.state, index, **static), kv_io.export_step(ex.state, index, **static)
    r["new_equals_old"] = jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), a, b))
    r["kernels"] = {k: kernels(f.lower(ex.state, index, **static).compile().as_text())
                    for k, f in fns.items()}
    print("export rows", n, r, flush=True)
    # imports of the dummy slot (a call that changes nothing), not donated: the state stays
    payload = gx._empty_payload(buckets)
    pays = tuple((payload.first_token, payload.drafts, payload.buffers, payload.checksums)
                 for _ in range(n))
    iindex = pack_import_index(gx._no_slots(), [(dummy, 0, 0, payload.logical_pages)] * n)
    ifns = {k: jax.jit(functools.partial(m.import_step, cfg=cfg), static_argnames=("pool_ids", "mode"))
            for k, m in (("old", old), ("new", kv_io))}
    r = out["import"][n] = {k: launch_us(lambda f=f: f(gx.state, iindex, pays, pool_ids=pool_ids,
                                                       mode="shared"))
                            for k, f in ifns.items()}
    r["kernels"] = {k: kernels(f.lower(gx.state, iindex, pays, pool_ids=pool_ids,
                                       mode="shared").compile().as_text())
                    for k, f in ifns.items()}
    print("import rows", n, r, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_calls.json"), "w"), indent=1)
