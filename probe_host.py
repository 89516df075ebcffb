"""Probe (not kept): the disaggregated handoff's host path on the GPU, event by event, and
variants of it against aggregated in the same process: demo ratio and handoff overhead."""
import sys, time, json, os, contextlib
import numpy as np
import jax
from benchmarks.profile_handoff import _wrap, host_summary
from benchmarks.serving_stream import DEMO_NEW_TOKENS, demo_prompts, make_engine
from benchmarks import bench_serving as BS
from drafter.default import default_step_config, load_default, load_prompts
import drafter.arrivals as A
import disagg.sources as S
from disagg.sources import ContextWorker
import drafter.engine as E
_real_init = E.Engine.__init__
def _init(self, *a, **k):
    _real_init(self, *a, **k)
    self.arrivals._engine_ref = self
E.Engine.__init__ = _init

params, tcfg, dcfg = load_default()
cfg = default_step_config(tcfg, dcfg, num_slots=16)
held = load_prompts()
prompts, new = demo_prompts(held), DEMO_NEW_TOKENS
OUT = os.environ.get("OUT", "/tmp")

def fine(engine, events):
    src = engine.kv_source
    ctx = src.contexts[0].engine
    for obj, names, who in ((engine, ("_dispatch", "_collect", "_import_arrived", "_take_arrivals", "_read_outputs"), "gen"),
                            (engine.executor, ("_step_fn", "_import", "import_payloads"), "gen"),
                            (engine.scheduler, ("schedule",), "gen"),
                            (engine.arrivals, ("_book_first_tokens", "take"), "gen"),
                            (src, ("poll", "_send", "_progress", "_arrived"), "src"),
                            (src.contexts[0], ("pump",), "ctx"),
                            (ctx, ("_dispatch", "_collect", "_read_outputs", "take_exports"), "ctx"),
                            (ctx.executor, ("_step_fn", "_export", "export_prefilled", "run", "export"), "ctx"),
                            (ctx.scheduler, ("schedule",), "ctx")):
        for n in names:
            _wrap(obj, n, f"{who} {n}", events)

# ---- variants (patches at class/module level, so every engine built after takes them)
real_book, real_move, real_pump = A.Arrivals._book_first_tokens, S.move_payloads, ContextWorker.pump
def book_unless_idle(self, now):
    eng = getattr(self, "_engine_ref", None)
    if eng is not None and not eng._inflight:
        return []
    return real_book(self, now)
def move_unless_same(payloads, mesh, **kw):
    return payloads if mesh is None else real_move(payloads, mesh, **kw)
def pump_read_after(self):
    e = self.engine
    real_read = e._read_outputs
    calls = []
    def read(*, idle):
        calls.append(1)
        return [] if len(calls) == 1 and not idle else real_read(idle=idle)
    e._read_outputs = read
    try:
        out = real_pump(self)
    finally:
        del e._read_outputs
    res = e._read_outputs(idle=False)
    return out[0], out[1] + res
VARIANTS = {"base": {}, "book_after_dispatch": {"book": book_unless_idle},
            "no_move_same_device": {"move": move_unless_same},
            "ctx_read_after": {"pump": pump_read_after}}
def apply(v):
    A.Arrivals._book_first_tokens = v.get("book", real_book)
    S.move_payloads = v.get("move", real_move)
    ContextWorker.pump = v.get("pump", real_pump)

engines = {m: make_engine(m, params, cfg) for m in ("aggregated", "disagg-shared")}
for e in engines.values():
    for _ in range(3):
        e.generate(prompts, new)

def rounds(n=int(os.environ.get("ROUNDS", 11))):
    rates = {m: [] for m in engines}
    toks = {m: [x.tokens for x in engines[m].generate(prompts, new)] for m in engines}
    assert toks["aggregated"] == toks["disagg-shared"], "tokens differ"
    for r in range(n):
        for m in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            t = time.perf_counter()
            res = engines[m].generate(prompts, new)
            rates[m].append(sum(len(x.tokens) for x in res) / (time.perf_counter() - t))
    paired = [a / b for a, b in zip(rates["disagg-shared"], rates["aggregated"])]
    return {"agg": float(np.median(rates["aggregated"])), "dis": float(np.median(rates["disagg-shared"])),
            "ratio": float(np.median(paired)), "p25_p75": [float(np.percentile(paired, 25)), float(np.percentile(paired, 75))]}

out = {"device": jax.devices()[0].device_kind, "demo": {}, "handoff": {}}
order = list(VARIANTS) + ["base"]
for k, name in enumerate(order):
    apply(VARIANTS[name])
    got = rounds()
    out["demo"][name if k < len(VARIANTS) else "base_again"] = got
    print("demo", name, got, flush=True)
apply({})
by_len = {}
for q in held:
    by_len.setdefault(q["length"], q["tokens"])
hp = {n: by_len[n] for n in (128, 512, 2048)} if os.environ.get("HREP") is None else {128: by_len[128]}
for name in VARIANTS:
    apply(VARIANTS[name])
    with contextlib.redirect_stdout(sys.stderr):
        got = BS.handoff_part(params, cfg, hp, int(os.environ.get("HREP", 9)))
    out["handoff"][name] = {r["prompt_tokens"]: [round(r["handoff_overhead_ms"], 3), round(r["ttft_disagg_ms"], 3), round(r["ttft_aggregated_ms"], 3)] for r in got["rows"]}
    print("handoff", name, out["handoff"][name], flush=True)
apply({})
json.dump(out, open(os.path.join(OUT, "probe_host.json"), "w"), indent=1)

events = []
fine(engines["disagg-shared"], events)
engines["disagg-shared"].generate(prompts, new)
events.clear()
start = time.perf_counter()
engines["disagg-shared"].generate(prompts, new)
wall = time.perf_counter() - start
print(f"disagg-shared fine timeline, wall {1e3*wall:.2f} ms", flush=True)
for label, a, b in sorted(events, key=lambda x: x[1]):
    if a - start < 0.008:
        print(f"  {1e3*(a-start):8.3f} +{1e3*(b-a):7.3f} {label}")
