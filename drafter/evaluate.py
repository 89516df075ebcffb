"""Acceptance and speed of the embedded default pair on held-out prompts.

    PYTHONPATH=. python -m drafter.evaluate [--quick] [--max-new N] [--impl I] [--json FILE]
        [--prompts acceptance|shipped] [--lengths N ...] [--context N] [--draft DIR]
        [--target DIR] [--compare-to JSON|shipped]

Per prompt length: acceptance length (AL: tokens committed per decode step, block 8,
over every step of the length's prompts) with a 95% interval over prompts, each
prompt's AL, per-position acceptance (how often draft k was accepted), and a check
that speculative output equals plain greedy output. Then plain vs speculative decode
tokens/s at batch 1 and batch 16 on this device (device time of the jitted steps,
rows prefilled with the shipped 128-token prompts).

Acceptance is measured on the acceptance set (16 prompts a length; the shipped
demo prompts are its first few): a continuation's AL varies from 2 to 8 from prompt
to prompt, so a few prompts a length say little about the length.

`--context N` cuts every prompt to its first token and its last N: the same
continuation points with less context, which tells what a length costs in AL
apart from what its continuations' content costs.

`--compare-to JSON` pairs this run with an earlier report over the same prompts (a
candidate drafter against the shipped one's report from the same machine): per length,
the AL difference with a bootstrap interval over prompts drawn for both runs at once.
`--draft DIR --compare-to shipped` evaluates the shipped drafter first in the same run,
so one run pairs a candidate with it (the plain decodes serve both). `--target DIR
--draft DIR` evaluates a new pair instead (against its own target's plain decodes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from drafter.acceptance_intervals import compare, interval, unpaired
from drafter.checkpoint import load_dflash
from drafter.default import (default_step_config, load_acceptance_prompts, load_default,
                             load_prompts)
from drafter.engine import Engine
from drafter.inspect import pair_checks
from drafter.uniform_steps import decode_step, plain_decode_step
from drafter.timing import machine, time_step_loop
from models.attention import IMPLS
from models.checkpoint import load_qwen3
from models.qwen3 import dense_forward


def per_position_acceptance(acceptance: list[int], block: int) -> list[float]:
    """Fraction of steps whose draft k (1..block-1) was accepted (committed n >= k+1)."""
    steps = np.asarray(acceptance)
    return [float((steps >= k + 1).mean()) for k in range(1, block)]


def cut_to_context(prompts: list[dict], context: int) -> list[dict]:
    """Each prompt as its first token (BOS) and its last `context` tokens; its
    `length` label stays the original's. Shorter prompts are kept whole."""
    if context < 1:
        raise ValueError(f"context={context}: keep at least one token before the continuation")
    return [{**p, "tokens": p["tokens"][:1] + p["tokens"][-context:]}
            if len(p["tokens"]) > context + 1 else p for p in prompts]


# A divergence between speculative and plain greedy output is a numeric near-tie, not a
# bug, when both tokens' exact logits sit within this many standard deviations of the
# best logit: the two passes' matmuls have other shapes and round apart (and fp8 KV
# turns a last-bit difference into a step of the fp8 grid). A wrong mask, position or
# KV page picks a token whose exact logit is a random draw, far below the best.
NEAR_TIE_STD = 0.1


def near_tie(logits, a: int, b: int) -> bool:
    """Whether tokens a and b are both within NEAR_TIE_STD standard deviations of
    the best of `logits` (f32[vocab], exact)."""
    return tie_gap(logits, a, b) <= NEAR_TIE_STD


def tie_gap(logits, a: int, b: int) -> float:
    """How far below the best logit the lower of tokens a and b is, in standard
    deviations of `logits`."""
    logits = np.asarray(logits, np.float64)
    return float((logits.max() - min(logits[a], logits[b])) / logits.std())


def first_divergence(a, b) -> int | None:
    """The first index where token lists a and b differ (or one ends), None if equal."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if at == len(a) == len(b) else at


def divergences(params, tcfg, prompts, speculative, plain) -> list[dict]:
    """Where speculative and plain greedy outputs part, per prompt that parts: the
    position, both tokens, and their gap under the exact logits there (f32 weights,
    f32-exact matmuls, no cache)."""
    exact = jax.jit(lambda p, t: dense_forward(p, tcfg, t)[0][0, -1])
    target32 = jax.tree.map(lambda a: a.astype(jnp.float32), params["target"])
    out = []
    for i, (prompt, s, p) in enumerate(zip(prompts, speculative, plain)):
        at = first_divergence(s.tokens, p.tokens)
        if at is None:
            continue
        if at == min(len(s.tokens), len(p.tokens)):   # one ended (a stop) and not the other
            out.append({"prompt": i, "at": at, "tokens": None, "gap_std": None,
                        "near_tie": False})
            continue
        with jax.default_matmul_precision("highest"):
            logits = np.asarray(exact(target32, jnp.asarray([prompt + p.tokens[:at]])))
        gap = tie_gap(logits, s.tokens[at], p.tokens[at])
        out.append({"prompt": i, "at": at, "tokens": [s.tokens[at], p.tokens[at]],
                    "gap_std": gap, "near_tie": gap <= NEAR_TIE_STD})
    return out


def _parting(d: dict) -> str:
    if d["tokens"] is None:
        return "a stop"
    tie = "" if d["near_tie"] else ": NOT a near-tie"
    return f"{d['tokens']} ({d['gap_std']:.3f} sd{tie})"


def acceptance_by_length(params, tcfg, dcfg, prompts, max_new, impl="auto", num_slots=16,
                         plain_outputs: dict | None = None):
    """Per prompt length, speculative beside plain greedy decoding of its prompts (in
    batches of `num_slots`). `plain_outputs` (length -> plain results) keeps the plain
    decodes for another drafter's evaluation over the same prompts and target: one
    already there is used instead of decoding again."""
    speculative_cfg = default_step_config(tcfg, dcfg, num_slots=num_slots, impl=impl)
    plain_cfg = default_step_config(tcfg, None, num_slots=num_slots, impl=impl)
    plain_outputs = {} if plain_outputs is None else plain_outputs
    rows = []
    for length in sorted({p["length"] for p in prompts}):
        group = [p["tokens"] for p in prompts if p["length"] == length]
        speculative = Engine(params, speculative_cfg).generate(group, max_new)
        if length not in plain_outputs:
            plain_outputs[length] = Engine(params, plain_cfg, speculative=False).generate(
                group, max_new)
        plain = plain_outputs[length]
        steps = [a for r in speculative for a in r.acceptance]
        parted = divergences(params, tcfg, group, speculative, plain)
        row = {"prompt_length": length, "num_prompts": len(group),
               "acceptance_length": float(np.mean(steps)),
               "acceptance_length_95": interval([r.acceptance for r in speculative]),
               "per_prompt_al": [r.acceptance_length for r in speculative],
               "per_prompt_steps": [[sum(r.acceptance), len(r.acceptance)]
                                    for r in speculative],
               "per_position_acceptance": per_position_acceptance(steps, dcfg.block_size),
               "lossless": not parted,
               # prompts whose outputs part only at near-ties of the exact logits
               "lossless_up_to_near_ties": all(d["near_tie"] for d in parted),
               "divergences": parted}
        low, high = row["acceptance_length_95"]
        equal = f"{len(group) - len(parted)} of {len(group)} equal to plain greedy"
        if parted:
            equal += "; parting at " + ", ".join(_parting(d) for d in parted)
        print(f"  prompt {length:>5}: AL {row['acceptance_length']:.2f} (95% over its "
              f"{len(group)} prompts: {low:.2f}-{high:.2f})  per-position "
              f"{[round(x, 2) for x in row['per_position_acceptance']]}  {equal}",
              flush=True)
        rows.append(row)
    return rows


def prefilled_engine(params, tcfg, dcfg, prompts, batch: int, speculative: bool,
                     impl: str = "auto", decode_steps_per_call: int | None = None,
                     graph_loops: bool = False, graph_copies: int = 1):
    """An Engine whose `batch` slots hold the prompts (cycled), prefilled, with
    room for 2048 new tokens each."""
    cfg = default_step_config(tcfg, dcfg if speculative else None, num_slots=batch, impl=impl,
                              graph_loops=graph_loops, graph_copies=graph_copies)
    engine = Engine(params, cfg, speculative=speculative,
                    decode_steps_per_call=decode_steps_per_call)
    for i in range(batch):
        engine.add_request(f"r{i}", prompts[i % len(prompts)], 2048)
    engine.prefill_submitted()
    return engine


def device_rate(engine, steps: int, repeats: int, *, donate: bool = False) -> dict:
    """Device time per step and tokens per step, from a copy of the engine's state, or
    with `donate` from the state itself (no second copy of the cache in memory; the
    engine is then spent: its state is the timed loop's, which its host side never saw).
    Only the slots holding requests step and count: a free slot would add tokens no
    request keeps."""
    cfg = engine.cfg
    step_fn = decode_step if engine.speculative else plain_decode_step
    held = sorted(seq.slot for seq in engine.scheduler.active.values())
    if not held:
        raise ValueError("device_rate needs an engine holding requests: add and prefill some")
    slots = jnp.asarray(held, dtype=jnp.int32)
    longest = int(np.max(np.asarray(engine.state.kv.target_lens))) + \
        (steps * (repeats + 1) + 2) * cfg.block_size
    width = engine.executor.table_width(longest)

    def step(params, state, key):
        return step_fn(params, state, slots, key, cfg=cfg, table_width=width)[0]

    def committed(state):
        return int(np.asarray(state.kv.target_lens)[held].sum())

    state = engine.state
    if donate:
        engine.state = None  # the loop consumes it
    seconds, lens, _ = time_step_loop(step, engine.params, state, steps=steps,
                                      repeats=repeats, probe=committed, donate=donate,
                                      compiler_options=cfg.compiler_options)
    tokens = [(after - before) / steps for before, after in zip(lens, lens[1:])]
    step_s, per_step = float(np.median(seconds)), float(np.mean(tokens))
    return {"device_step_ms": step_s * 1e3, "tokens_per_step": per_step,
            "device_tokens_per_s": per_step / step_s, "rows": len(held)}


def tokens_per_second(params, tcfg, dcfg, prompts, batch, *, steps: int = 32,
                      repeats: int = 3, impl: str = "auto"):
    """Decode tokens/s, plain vs speculative, `batch` rows prefilled with
    `prompts`: device time of the jitted steps (no host loop; the host loop's
    own cost is in benchmarks/bench_decode_speed.py)."""
    out = {"batch": batch}
    for name, speculative in (("plain", False), ("speculative", True)):
        engine = prefilled_engine(params, tcfg, dcfg, prompts, batch, speculative, impl)
        rate = device_rate(engine, steps, repeats)
        out[f"{name}_tokens_per_s"] = rate["device_tokens_per_s"]
        out[f"{name}_tokens_per_step"] = rate["tokens_per_step"]
    out["speedup"] = out["speculative_tokens_per_s"] / out["plain_tokens_per_s"]
    print(f"  batch {batch:>2}: plain {out['plain_tokens_per_s']:.1f} tok/s, speculative "
          f"{out['speculative_tokens_per_s']:.1f} tok/s ({out['speedup']:.2f}x)", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts per length, up to 2048")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--json", default=None, help="output file (default eval_default_<backend>[_quick].json here)")
    ap.add_argument("--impl", choices=IMPLS, default="auto",
                    help="attention kernels (models/attention.py)")
    ap.add_argument("--prompts", choices=("acceptance", "shipped"), default="acceptance",
                    help="the acceptance set (16 a length) or the demo's shipped prompts")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="only the prompts of these lengths (default: every length)")
    ap.add_argument("--context", type=int, default=None,
                    help="cut each prompt to BOS + its last N tokens (same continuations)")
    ap.add_argument("--draft", default=None, metavar="DIR",
                    help="a candidate drafter for the shipped target (a DFlash checkpoint "
                         "directory, e.g. make_default's DIR/draft) instead of the shipped one")
    ap.add_argument("--target", default=None, metavar="DIR",
                    help="a candidate target (make_default's DIR/target) instead of the "
                         "shipped one, with a drafter trained for it (--draft)")
    ap.add_argument("--compare-to", default=None, metavar="JSON|shipped",
                    help="an earlier report over the same prompts (e.g. the shipped "
                         "drafter's, same machine), or `shipped` to evaluate the shipped "
                         "drafter first in this run (with --draft; the plain decodes "
                         "serve both): print and keep this one's AL minus its, per "
                         "length, with a paired 95%% interval over prompts")
    args = ap.parse_args(argv)
    base = None
    if args.compare_to == "shipped" and args.draft is None:
        raise SystemExit("--compare-to shipped evaluates the shipped drafter beside a "
                         "candidate: give the candidate with --draft DIR")
    if args.compare_to not in (None, "shipped"):
        try:
            base = json.loads(Path(args.compare_to).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--compare-to {args.compare_to}: not a readable report: {e}")
    if args.target is not None and args.draft is None:
        raise SystemExit(f"--target {args.target}: give its drafter with --draft DIR too")
    params, tcfg, dcfg = load_default()
    shipped_params, shipped_tcfg, shipped_dcfg = dict(params), tcfg, dcfg
    if args.target is not None:
        tcfg, params["target"] = load_qwen3(args.target, jnp.float32)
    if args.draft is not None:
        dcfg, params["draft"] = load_dflash(args.draft, jnp.float32)
        if problems := pair_checks(tcfg, dcfg):
            which = f"the target {args.target}" if args.target else "the shipped target"
            raise SystemExit(f"--draft {args.draft}: it does not fit {which}: "
                             f"{'; '.join(problems)}; give a drafter trained for it "
                             f"(python -m drafter.make_default)")
    prompts = load_acceptance_prompts() if args.prompts == "acceptance" else load_prompts()
    if args.lengths:
        lengths = sorted({p["length"] for p in prompts})
        prompts = [p for p in prompts if p["length"] in args.lengths]
        if not prompts:
            raise SystemExit(f"--lengths {args.lengths}: the prompts have lengths {lengths}")
    if args.context is not None:
        prompts = cut_to_context(prompts, args.context)
    if args.quick:
        keep = {}
        prompts = [p for p in prompts if p["length"] <= 2048
                   and keep.setdefault(p["length"], []).append(1) is None
                   and len(keep[p["length"]]) <= 2]
    print(f"device: {jax.devices()[0].device_kind}; {len(prompts)} held-out prompts", flush=True)
    report = {"machine": machine(), "impl": args.impl, "block_size": dcfg.block_size,
              "prompts": args.prompts,
              "target": args.target or "shipped", "draft": args.draft or "shipped",
              "max_new": args.max_new, "context": args.context}
    if base is not None and (differing := unpaired(base, report)):  # before any decoding
        raise SystemExit(f"--compare-to {args.compare_to}: {differing}")
    plain_outputs = {}
    if args.compare_to == "shipped":
        print("the shipped pair:" if args.target else "the shipped drafter:", flush=True)
        base = report | {"target": "shipped", "draft": "shipped",
                         "by_length": acceptance_by_length(
                             shipped_params, shipped_tcfg, shipped_dcfg, prompts,
                             args.max_new, args.impl, plain_outputs=plain_outputs)}
        print(f"the candidate, {args.target or 'the shipped target'} with {args.draft}:",
              flush=True)
    # the shipped target's plain decodes serve a candidate drafter, not a candidate target
    report["by_length"] = acceptance_by_length(
        params, tcfg, dcfg, prompts, args.max_new, args.impl,
        plain_outputs=plain_outputs if args.target is None else None)
    if base is not None:
        try:
            rows = compare(base, report, f"--compare-to {args.compare_to}")
        except ValueError as e:
            raise SystemExit(str(e)) from None
        in_run = args.compare_to == "shipped"
        report["compared_to"] = {"file": None if in_run else args.compare_to,
                                 "draft": base.get("draft"), "by_length": rows}
        if in_run:  # the baseline's own figures, measured here
            report["compared_to"]["baseline_by_length"] = base["by_length"]
        for row in rows:
            low, high = row["difference_95"]
            print(f"  prompt {row['prompt_length']:>5}: AL {row['difference']:+.2f} against "
                  f"{args.compare_to} (paired 95%: {low:+.2f} to {high:+.2f})", flush=True)
    path = Path(args.json) if args.json else Path(
        f"eval_default_{jax.default_backend()}{'_quick' if args.quick else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    # written now and again with the speeds: a run cut short keeps its acceptance figures
    path.write_text(json.dumps(report, indent=2))
    short = [p["tokens"] for p in load_prompts() if p["length"] == 128]
    if args.context is None and (not args.lengths or 128 in args.lengths):  # speed: shipped 128s
        report["speed"] = [tokens_per_second(params, tcfg, dcfg, short, b, impl=args.impl)
                           for b in ((1,) if args.quick else (1, 16))]
        path.write_text(json.dumps(report, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
